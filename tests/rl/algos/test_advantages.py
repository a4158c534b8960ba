"""Advantage estimators vs hand-computed cases and slow loop references (rl/algos/advantages.py)."""
from __future__ import annotations

import math

import pytest
import torch

from tests.rl.algos.algos_refs import random_batch, ref_gae, ref_grpo, ref_outcome_rewards, ref_reinforce_pp, ref_rloo, tolist2
from rl.algos.advantages import (
    AdvantageInputs,
    AdvantageParams,
    compute_advantages,
    gae_advantages_BT,
    gae_returns_BT,
    grpo_advantages_B,
    outcome_to_token_rewards,
    reinforce_pp_advantages_BT,
    rloo_advantages_B,
)

SEEDS = [0, 1, 2]


# ----------------------------------------------------------------------------- hand-computed
def test_grpo_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5], dtype=torch.float64)
    g = torch.tensor([0, 0, 0, 0, 9])
    adv, m = grpo_advantages_B(r, g, norm_std=True, eps=0.0)
    # group 0: mean 0.5, sample std sqrt(4 * 0.25 / 3) = sqrt(1/3); +-0.5 / sqrt(1/3) = +-0.8660254
    s = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([s, -s, -s, s, 0.0], dtype=torch.float64))
    assert m["adv/num_groups"] == 2.0
    adv, _ = grpo_advantages_B(r, g, norm_std=False)  # Dr. GRPO
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0], dtype=torch.float64))


def test_grpo_zero_variance_group_gives_zero_not_nan():
    adv, m = grpo_advantages_B(torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.long))
    assert torch.equal(adv, torch.zeros(4, dtype=torch.float64))
    assert m["adv/zero_std_group_frac"] == 1.0


def test_rloo_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0], dtype=torch.float64)
    g = torch.tensor([5, 5, 5, 2, 2])
    adv, _ = rloo_advantages_B(r, g)
    # group 5: 1 - mean(0,0) = 1; 0 - mean(1,0) = -0.5 (x2). group 2: 3 - 1 = 2; 1 - 3 = -2
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, 2.0, -2.0], dtype=torch.float64))
    # RLOO = G/(G-1) * (r - mean)
    torch.testing.assert_close(adv[:3], 3 / 2 * (r[:3] - r[:3].mean()))


def test_gae_hand_computed_skips_tool_tokens():
    # positions: gen, gen, tool output, gen, pad ; rewards [0, 0, -, 1], values [.5, .6, -, .7], gamma .9, lam .8
    mask = torch.tensor([[1, 1, 0, 1, 0]])
    rewards = torch.tensor([[0.0, 0.0, 5.0, 1.0, 7.0]], dtype=torch.float64)  # values off the mask are ignored
    values = torch.tensor([[0.5, 0.6, float("nan"), 0.7, float("nan")]], dtype=torch.float64)
    adv, _ = gae_advantages_BT(rewards, values, mask, gamma=0.9, lam=0.8)
    # delta = [0 + .9*.6 - .5, 0 + .9*.7 - .6, 1 + 0 - .7] = [.04, .03, .3]
    # A = [.04 + .72*.246, .03 + .72*.3, .3] = [.21712, .246, .3]
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.0, 0.3, 0.0]], dtype=torch.float64))
    ret = gae_returns_BT(adv, values, mask)
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 0.0, 1.0, 0.0]], dtype=torch.float64))


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    mask = torch.tensor([[1, 1, 1]])
    r = torch.tensor([[0.0, 0.0, 2.0]], dtype=torch.float64)
    v = torch.tensor([[0.3, 0.1, 0.9]], dtype=torch.float64)
    adv, _ = gae_advantages_BT(r, v, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, 2.0 - v)


def test_outcome_reward_sits_on_last_generated_token():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    out = outcome_to_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    expected = torch.zeros(3, 6)
    expected[0, 4] = 2.0
    expected[2, 0] = 4.0
    assert torch.equal(out, expected)


# ----------------------------------------------------------------------------- vs loop references
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm_std", [True, False])
def test_grpo_matches_loop(seed, norm_std):
    b = random_batch(seed)
    name = "grpo" if norm_std else "dr_grpo"
    adv_BT, m = compute_advantages(name, AdvantageInputs(b.rewards_B, b.mask_BT, b.group_ids_B))
    ref_B = ref_grpo(b.rewards_B.tolist(), b.group_ids_B.tolist(), norm_std)
    expected = torch.tensor([[ref_B[i] if bool(b.mask_BT[i, t]) else 0.0 for t in range(b.mask_BT.shape[1])] for i in range(len(ref_B))], dtype=torch.float64)
    torch.testing.assert_close(adv_BT, expected)
    assert m["adv/empty_rows"] == 1.0


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_loop(seed):
    b = random_batch(seed)
    adv_BT, _ = compute_advantages("rloo", AdvantageInputs(b.rewards_B, b.mask_BT, b.group_ids_B))
    ref_B = ref_rloo(b.rewards_B.tolist(), b.group_ids_B.tolist())
    for i in range(len(ref_B)):
        for t in range(b.mask_BT.shape[1]):
            assert adv_BT[i, t].item() == pytest.approx(ref_B[i] if bool(b.mask_BT[i, t]) else 0.0, abs=1e-12)


def test_rloo_singleton_group_is_zero():
    adv, m = rloo_advantages_B(torch.tensor([1.0, 0.0, 5.0]), torch.tensor([0, 0, 1]))
    assert adv.tolist() == [1.0, -1.0, 0.0]
    assert m["adv/singleton_groups"] == 1.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.97, 0.9), (0.5, 0.0)])
def test_gae_matches_definition(seed, gamma, lam):
    b = random_batch(seed)
    tok_r = torch.randn(b.mask_BT.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 100))
    inputs = AdvantageInputs(b.rewards_B, b.mask_BT, b.group_ids_B, values_BT=b.values_BT, token_rewards_BT=tok_r)
    adv, _ = compute_advantages("gae", inputs, AdvantageParams(gamma=gamma, lam=lam))
    outcome = ref_outcome_rewards(b.rewards_B.tolist(), b.mask_BT)
    total = [[outcome[i][t] + (float(tok_r[i, t]) if bool(b.mask_BT[i, t]) else 0.0) for t in range(b.mask_BT.shape[1])] for i in range(b.mask_BT.shape[0])]
    expected = ref_gae(total, tolist2(b.values_BT), b.mask_BT, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))
    assert not torch.isnan(adv).any()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,normalize,baseline", [(1.0, True, False), (0.9, True, True), (0.95, False, False)])
def test_reinforce_pp_matches_loop(seed, gamma, normalize, baseline):
    b = random_batch(seed)
    tok_r = torch.randn(b.mask_BT.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 7)) * 0.1
    inputs = AdvantageInputs(b.rewards_B, b.mask_BT, b.group_ids_B, token_rewards_BT=tok_r)
    adv, _ = compute_advantages("reinforce_pp", inputs, AdvantageParams(gamma=gamma, batch_normalize=normalize, group_baseline=baseline))
    r = b.rewards_B.tolist()
    if baseline:
        r = ref_grpo(r, b.group_ids_B.tolist(), norm_std=False)
    outcome = ref_outcome_rewards(r, b.mask_BT)
    total = [[outcome[i][t] + (float(tok_r[i, t]) if bool(b.mask_BT[i, t]) else 0.0) for t in range(b.mask_BT.shape[1])] for i in range(b.mask_BT.shape[0])]
    expected = ref_reinforce_pp(total, b.mask_BT, gamma, normalize)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))


def test_reinforce_pp_whitened_has_zero_mean_unit_std():
    b = random_batch(3)
    adv, _ = reinforce_pp_advantages_BT(b.rewards_B, b.mask_BT)
    v = adv[b.mask_BT]
    assert abs(v.mean().item()) < 1e-9
    assert v.std(unbiased=False).item() == pytest.approx(1.0, rel=1e-5)


def test_grpo_folds_token_rewards_into_sequence_reward():
    b = random_batch(4)
    tok_r = torch.randn(b.mask_BT.shape, dtype=torch.float64)
    with_tok, _ = compute_advantages("grpo", AdvantageInputs(b.rewards_B, b.mask_BT, b.group_ids_B, token_rewards_BT=tok_r))
    summed = b.rewards_B + torch.where(b.mask_BT, tok_r, 0.0).sum(1)
    direct, _ = compute_advantages("grpo", AdvantageInputs(summed, b.mask_BT, b.group_ids_B))
    torch.testing.assert_close(with_tok, direct)


# ----------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="non-finite rewards at indices \\[1\\]"):
        compute_advantages("grpo", AdvantageInputs(torch.tensor([1.0, float("nan")]), mask, torch.tensor([0, 0])))
    with pytest.raises(ValueError, match="group_ids_B: expected 2 entries"):
        compute_advantages("grpo", AdvantageInputs(torch.tensor([1.0, 0.0]), mask, torch.tensor([0, 0, 1])))
    with pytest.raises(TypeError, match="group_ids_B: expected an integer tensor"):
        compute_advantages("rloo", AdvantageInputs(torch.tensor([1.0, 0.0]), mask, torch.tensor([0.0, 0.0])))
    with pytest.raises(ValueError, match="mask values must be 0 or 1"):
        compute_advantages("grpo", AdvantageInputs(torch.tensor([1.0, 0.0]), torch.full((2, 3), 2.0), torch.tensor([0, 0])))
    with pytest.raises(ValueError, match="needs AdvantageInputs.values_BT"):
        compute_advantages("gae", AdvantageInputs(torch.tensor([1.0, 0.0]), mask, torch.tensor([0, 0])))
    with pytest.raises(ValueError, match="gamma=1.5"):
        compute_advantages("gae", AdvantageInputs(torch.tensor([1.0, 0.0]), mask, torch.tensor([0, 0]), values_BT=torch.zeros(2, 3)), AdvantageParams(gamma=1.5))
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; registered names: dr_grpo, gae, grpo, reinforce_pp, rloo"):
        compute_advantages("ppo", AdvantageInputs(torch.tensor([1.0, 0.0]), mask, torch.tensor([0, 0])))


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.0, 0.5)])
def test_gae_long_sequences_span_several_chunks(gamma, lam):
    """The chunked scan (64 generated tokens per chunk) must carry across chunk boundaries."""
    b = random_batch(21, n_groups=2, group_size=3, T=400)
    assert int(b.mask_BT.sum(1).max()) > 130  # at least three chunks in some row
    tok_r = torch.where(b.mask_BT, torch.randn(b.mask_BT.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), 0.0)
    adv, _ = gae_advantages_BT(tok_r, b.values_BT, b.mask_BT, gamma=gamma, lam=lam)
    expected = ref_gae(tolist2(tok_r), tolist2(b.values_BT), b.mask_BT, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))


def test_gae_float32_long_horizon_stays_finite():
    T = 5000
    mask = torch.ones(2, T)
    r = torch.zeros(2, T)
    r[:, -1] = 1.0
    adv, _ = gae_advantages_BT(r, torch.zeros(2, T), mask, gamma=0.999, lam=0.95)
    assert torch.isfinite(adv).all()
    assert adv[0, -1].item() == pytest.approx(1.0) and adv[0, 0].item() == pytest.approx((0.999 * 0.95) ** (T - 1), rel=1e-3, abs=1e-30)


# ----------------------------------------------------------------------------- algorithm.whiten_advantages
@pytest.mark.parametrize("seed", [0, 1])
def test_whiten_advantages_matches_the_formula_and_ignores_nan_padding(seed):
    from rl.algos import ADVANTAGE_TRANSFORMS
    from tests.rl.algos.algos_refs import ref_whiten

    b = random_batch(seed)
    x_BT = torch.where(b.mask_BT, b.adv_BT * 3.0 + 0.7, torch.tensor(float("nan"), dtype=torch.float64))
    out_BT, m = ADVANTAGE_TRANSFORMS.get("whiten")(x_BT, b.mask_BT)
    torch.testing.assert_close(out_BT, torch.tensor(ref_whiten(x_BT, b.mask_BT), dtype=torch.float64), rtol=1e-12, atol=1e-12)
    sel = out_BT[b.mask_BT]
    assert abs(float(sel.mean())) < 1e-12 and float(sel.std()) == pytest.approx(1.0, rel=1e-6)
    assert m["adv/whiten/mean"] == pytest.approx(float(x_BT[b.mask_BT].mean()))
    assert not torch.isnan(out_BT).any() and (out_BT[~b.mask_BT] == 0).all()


def test_whiten_advantages_degenerate_batches_give_zero_not_nan():
    from rl.algos import whiten_advantages

    one = torch.zeros(2, 3, dtype=torch.bool)
    one[1, 2] = True
    out, _ = whiten_advantages(torch.full((2, 3), 5.0), one)
    assert (out == 0).all()
    out, _ = whiten_advantages(torch.full((2, 3), 5.0), torch.zeros(2, 3, dtype=torch.bool))
    assert (out == 0).all()
    out, _ = whiten_advantages(torch.full((2, 3), 5.0), torch.ones(2, 3, dtype=torch.bool))  # no variance
    assert (out == 0).all()


def test_loss_advantages_auto_whitens_gae_only_and_true_false_force_it():
    from rl.objective import loss_advantages, whitens

    assert whitens("gae", "auto") and not any(whitens(n, "auto") for n in ("grpo", "dr_grpo", "rloo", "reinforce_pp"))
    assert whitens("grpo", True) and not whitens("gae", False)
    with pytest.raises(ValueError, match="whiten_advantages must be one of"):
        whitens("gae", "on")
    b = random_batch(0)
    adv = torch.where(b.mask_BT, b.adv_BT + 2.0, torch.zeros((), dtype=torch.float64))
    kept, m = loss_advantages(adv, b.mask_BT, "grpo", "auto")
    assert kept is adv and m == {"adv/whitened": 0.0}
    out, m = loss_advantages(adv, b.mask_BT, "gae", "auto")
    assert m["adv/whitened"] == 1.0 and abs(float(out[b.mask_BT].mean())) < 1e-12


def test_config_key_is_validated_with_the_allowed_values():
    from rl.config import ConfigError, load_config

    assert load_config(None, ["algorithm.whiten_advantages=false"]).algorithm.whiten_advantages is False
    assert load_config(None).algorithm.whiten_advantages == "auto"
    with pytest.raises(ConfigError, match=r"'algorithm.whiten_advantages': value 'on' is not allowed; allowed values: 'auto', True, False"):
        load_config(None, ["algorithm.whiten_advantages=on"])


def test_driver_whitens_gae_advantages_over_the_step_batch_and_keeps_raw_critic_targets():
    """rl/train.with_advantages on a collated batch: auto whitens gae's advantages (mean 0, std 1 over the
    batch's generated tokens, equal to the formula applied to the definition-written GAE); the critic's
    returns stay raw advantage + value; grpo is left as it was."""
    from dataclasses import replace

    from rl.config import AlgorithmSection
    from rl.train import with_advantages
    from rl.trainer.batch import collate
    from rl.types import Episode
    from tests.rl.algos.algos_refs import ref_whiten

    eps = [Episode(task_id=f"t{i // 2}", domain="a", group_id=f"g{i // 2}", token_ids=tuple(range(11, 11 + 12 + i)),
                   loss_mask=tuple([0] * 4 + [1] * (8 + i)), rollout_logprobs=tuple([-1.0] * (12 + i)), messages=(),
                   reward=float(i % 3 == 0)) for i in range(6)]
    batch = collate(eps, [0.0] * 6, domains=("a",))
    mask = batch.loss_mask_BT > 0
    values = torch.where(mask, torch.linspace(-0.5, 0.5, mask.numel()).reshape(mask.shape), torch.zeros(()))
    a = AlgorithmSection(advantage="gae", gamma=0.99, lam=0.9)
    raw = torch.tensor(ref_gae(ref_outcome_rewards(batch.rewards_B.tolist(), mask), values.tolist(), mask, a.gamma, a.lam))
    b, m = with_advantages(batch, a, values)
    assert m["adv/whitened"] == 1.0
    torch.testing.assert_close(b.advantages_BT, torch.tensor(ref_whiten(raw, mask), dtype=torch.float32), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(b.returns_BT, torch.where(mask, raw + values, torch.zeros(())).float(), rtol=1e-5, atol=1e-5)
    b_off, m_off = with_advantages(batch, replace(a, whiten_advantages=False), values)
    assert m_off["adv/whitened"] == 0.0
    torch.testing.assert_close(b_off.advantages_BT, raw.float(), rtol=1e-5, atol=1e-5)
    b_grpo, m_grpo = with_advantages(batch, AlgorithmSection(advantage="grpo"), None)
    grpo_B = ref_grpo(batch.rewards_B.tolist(), batch.group_ids_B.tolist(), norm_std=True)
    assert m_grpo["adv/whitened"] == 0.0
    torch.testing.assert_close(b_grpo.advantages_BT, torch.where(mask, torch.tensor(grpo_B)[:, None], torch.zeros(())).float(),
                               rtol=1e-5, atol=1e-5)
