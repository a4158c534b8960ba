"""Logits only over the loss window (`logits_to_keep`) give the same token logprobs, and gradients,
as full logits on every loss-masked target: checked on the tiny HybridMoe and a tiny Qwen3-MoE
against a slow per-position reference computed from the full logits."""
from __future__ import annotations

import pytest
import torch

from rl.trainer.batch import logits_window, token_logprobs


def _reference(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
    B, T = ids_BT.shape
    out = torch.zeros(B, T)
    for b in range(B):
        for t in range(1, T):
            out[b, t] = torch.log_softmax(logits_BTV[b, t - 1].double(), -1)[ids_BT[b, t]].float()
    return out


def _models():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config

    torch.manual_seed(0)
    yield "hybrid_moe", HybridMoeForCausalLM(load_shipped_config("tiny")).eval()
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2)
    yield "qwen3_moe", Qwen3MoeForCausalLM(cfg).eval()


def test_window_covers_first_masked_target():
    mask = torch.zeros(3, 20, dtype=torch.long)
    mask[0, 12:15] = 1
    mask[1, 9:11] = 1          # earliest masked column: 9 -> logits from position 8 -> 12 positions
    mask[2, 17:] = 1
    assert logits_window(mask) == 20 - 8
    assert logits_window(torch.zeros(2, 7)) == 7
    m = torch.zeros(1, 5)
    m[0, 0] = 1                # a target at 0 has no predicting logit; the window is everything
    assert logits_window(m) == 5


@pytest.mark.parametrize("which", ["hybrid_moe", "qwen3_moe"])
def test_windowed_logprobs_and_grads_equal_full(which):
    name, model = next((n, m) for n, m in _models() if n == which)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids_BT = torch.randint(11, V, (3, 40), generator=g)
    mask_BT = torch.zeros(3, 40)
    mask_BT[0, 25:31] = 1
    mask_BT[1, 22:40] = 1
    mask_BT[2, 30:36] = 1
    attn = torch.ones_like(ids_BT)
    W = logits_window(mask_BT)
    assert W == 40 - 21

    full = model(input_ids=ids_BT, attention_mask=attn).logits
    ref = _reference(full.detach(), ids_BT)
    lp_full = token_logprobs(full, ids_BT)
    torch.testing.assert_close(lp_full, ref, atol=1e-5, rtol=0)

    win = model(input_ids=ids_BT, attention_mask=attn, logits_to_keep=W).logits
    assert win.shape[1] == W
    lp_win = token_logprobs(win, ids_BT)
    m = mask_BT > 0
    torch.testing.assert_close(lp_win[m], ref[m], atol=1e-5, rtol=0)
    assert (lp_win[:, : 40 - W + 1] == 0).all()      # no logits there: left at 0, never read under the mask

    # Same loss, same gradient.
    params = [p for p in model.parameters() if p.requires_grad]
    (-(lp_full * mask_BT).sum()).backward()
    g_full = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    model.zero_grad()
    lp_win2 = token_logprobs(model(input_ids=ids_BT, attention_mask=attn, logits_to_keep=W).logits, ids_BT)
    (-(lp_win2 * mask_BT).sum()).backward()
    for p, gf in zip(params, g_full):
        gw = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(gw, gf, atol=1e-5, rtol=1e-4)


def test_too_many_logit_positions_refused():
    with pytest.raises(ValueError, match="logit positions"):
        token_logprobs(torch.zeros(1, 5, 8), torch.zeros(1, 4, dtype=torch.long))


def _ragged_batch():
    """Six right-padded episodes of lengths 9, 30, 12, 30, 5, 20 in a [6, 30] batch."""
    from rl.trainer.batch import TrainBatch

    lengths = [9, 30, 12, 30, 5, 20]
    B, T = len(lengths), max(lengths)
    g = torch.Generator().manual_seed(3)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(11, 500, (n,), generator=g)
        attn[i, :n] = 1
    loss = attn.float()
    loss[:, :3] = 0
    return TrainBatch(input_ids_BT=ids, attention_mask_BT=attn, loss_mask_BT=loss, rollout_logprobs_BT=-loss,
                      advantages_BT=loss * 0.5, group_ids_B=torch.arange(B), domain_ids_B=torch.zeros(B, dtype=torch.long),
                      domains=("d",), rewards_B=torch.arange(B, dtype=torch.float32),
                      routed_experts_BTLK=torch.where(attn[:, :, None, None] > 0, torch.ones(B, T, 2, 2, dtype=torch.long), -1)), lengths


def test_micro_batches_group_rows_by_length_and_cut_padding():
    from rl.trainer.batch import micro_batches, micro_rows, stitch_rows

    batch, lengths = _ragged_batch()
    assert micro_rows(batch, 4) == [[1, 3, 5, 2], [0, 4]]           # longest first, ties in batch order
    mbs = micro_batches(batch, 2, n_micro=4)
    assert [padding for _, padding in mbs] == [False, False, False, True]
    # each micro-batch is as wide as its longest row, every [B, T, ...] tensor alike
    assert [mb.input_ids_BT.shape[1] for mb, _ in mbs] == [30, 20, 9, 9]
    for mb, _ in mbs:
        w = mb.input_ids_BT.shape[1]
        assert mb.loss_mask_BT.shape[1] == mb.advantages_BT.shape[1] == mb.routed_experts_BTLK.shape[1] == w
        assert mb.step_seqs == 6 and mb.step_tokens == sum(lengths)       # the step's totals survive the cut
    # rows come back in batch order, the cut columns filled
    parts = [mb.rewards_B[:, None].expand(-1, mb.input_ids_BT.shape[1]) + 0 for mb, pad in mbs if not pad]
    back = stitch_rows(parts, batch, 2, fill=-7.0)
    for i, n in enumerate(lengths):
        width = {1: 30, 3: 30, 5: 20, 2: 20, 0: 9, 4: 9}[i]
        assert (back[i, :width] == i).all() and (back[i, width:] == -7.0).all()
    with pytest.raises(ValueError, match="3 micro-batches"):
        stitch_rows(parts[:2], batch, 2)


def test_narrowed_micro_batches_give_the_same_logprobs_as_the_full_width():
    """Cutting trailing padding changes no real token's logprob (causal model, right padding)."""
    from rl.trainer.batch import micro_batches, stitch_rows

    _, model = next(iter(_models()))
    batch, lengths = _ragged_batch()
    with torch.no_grad():
        full = token_logprobs(model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits, batch.input_ids_BT)
        parts = [token_logprobs(model(input_ids=mb.input_ids_BT, attention_mask=mb.attention_mask_BT).logits, mb.input_ids_BT)
                 for mb, _ in micro_batches(batch, 2)]
    cut = stitch_rows(parts, batch, 2)
    real = batch.attention_mask_BT > 0
    torch.testing.assert_close(cut[real], full[real], atol=1e-5, rtol=0)


def _grouped_batch(lengths_by_group: list[list[int]]):
    from rl.trainer.batch import TrainBatch

    rows = [(g, n) for g, ns in enumerate(lengths_by_group) for n in ns]
    B, T = len(rows), max(n for _, n in rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    for i, (_, n) in enumerate(rows):
        ids[i, :n] = 5
        attn[i, :n] = 1
    loss = attn.float()
    return TrainBatch(input_ids_BT=ids, attention_mask_BT=attn, loss_mask_BT=loss, rollout_logprobs_BT=-loss,
                      advantages_BT=loss, group_ids_B=torch.as_tensor([g for g, _ in rows]),
                      domain_ids_B=torch.zeros(B, dtype=torch.long), domains=("d",), rewards_B=torch.zeros(B))


def test_token_budget_micro_batches():
    """`trainer.max_tokens_per_micro_batch`: one 32k-token episode alone, short ones many to a micro-batch,
    no micro-batch past the budget unless it is one row, and every rank's shard cut back into the same
    micro-batches (what keeps N ranks equal to one)."""
    from rl.trainer.batch import MicroBatching, micro_rows, split_micro_batches

    batch = _grouped_batch([[300, 200], [32768], [100, 100, 90, 80], [5000, 40]])
    lengths = batch.attention_mask_BT.sum(1).tolist()
    groups = batch.group_ids_B.tolist()
    plan = MicroBatching(rows=2, tokens=4096)
    mbs = micro_rows(batch, plan)
    assert mbs[0] == [2] and mbs[1] == [7]  # the long ones alone
    assert sorted(i for mb in mbs for i in mb) == list(range(batch.num_seqs))
    for mb in mbs:
        assert len(mb) == 1 or len(mb) * max(lengths[i] for i in mb) <= plan.tokens, mb
    assert [groups[i] for i in mbs[2]] == [0, 0, 2, 2, 2, 2, 3]  # longest first; a group's rows stay together here
    assert max(len(mb) for mb in mbs) > plan.rows  # the row count does not cap a token budget
    assert micro_rows(batch, MicroBatching(rows=2)) == micro_rows(batch, 2)  # no budget: rows, as before
    for n in (2, 3):
        parts = split_micro_batches(batch, n, plan)
        for p in parts:
            assert [[p[j] for j in rows] for rows in micro_rows(batch.select(p), plan)] == [mb for mb in mbs if mb[0] in p]
    with pytest.raises(ValueError):
        MicroBatching(rows=0)
    with pytest.raises(ValueError):
        MicroBatching(rows=1, tokens=-1)
