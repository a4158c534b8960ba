"""`jointrl tinker serve` driven by the official `tinker` SDK (0.38.0) on a tiny Qwen3-MoE (fp32), end to end.

One server process for the module (a DeepSpeed trainer per training client and a vLLM CPU engine, in that
process; torch.distributed is process-wide, so not in pytest's). Checked, in file order:
- supervised: cross_entropy forward_backward + optim_step, four times: the loss goes down;
- sampling: save_weights_and_get_sampling_client, then sample: the sampled tokens' logprobs equal the
  trainer's forward on the same tokens to the fp32 sync bar (1e-4, tests/rl/rollout/test_engine_moe.py),
  and compute_logprobs agrees with the same forward;
- RL: an importance_sampling step on the sampled completion with a positive advantage: at ratio 1 the loss
  is -sum(A), and after the step the completion is more likely under the trainer;
- bad requests (refused loss, wrong shapes, oversized batch, unknown model, another session's checkpoint,
  no API key) get the SDK's error shapes (4xx, RequestFailedError), never a 5xx or a hang.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SYNC_TOL = 1e-4  # fp32 engine vs trainer (the bar for fp32 MoE, as in test_engine_moe.py)
KEY = "tml-jointrl-test-key"
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from rl.tinker.launch import launch

    ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp("tinker_ckpt"), TinyModelSpec(kind="qwen3_moe"))
    service = launch(ckpt, state_dir=tmp_path_factory.mktemp("tinker_state"), log=tmp_path_factory.mktemp("tinker_log") / "server.log",
                     api_key=KEY, args=["--max-model-len", "256", "--max-batch-tokens", "600", "--kv-cache-gib", "0.25"],
                     timeout_s=90)
    try:
        yield service.url, str(ckpt)
    finally:
        service.stop(30)


@pytest.fixture(scope="module")
def client(server):
    os.environ["TINKER_TELEMETRY"] = "0"
    url, ckpt = server
    sc = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model=ckpt, rank=8).result(timeout=120)
    return sc, tc, tc.get_tokenizer()


def _sft_datum(ids: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def _trainer_logprobs(tc, seq: list[int]) -> np.ndarray:
    """The trainer's log p(seq[t] | seq[:t]), t >= 1, through a forward-only request."""
    out = tc.forward([_sft_datum(seq)], "cross_entropy").result(timeout=60)
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


def test_supervised_steps_lower_the_loss(client):
    _, tc, tok = client
    ids = tok.encode(TEXT)
    losses = []
    for _ in range(4):
        fb = tc.forward_backward([_sft_datum(ids), _sft_datum(ids[:12])], "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(fb.result(timeout=60).metrics["loss:sum"])
        assert "grad_norm:mean" in op.result(timeout=60).metrics
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    # The request's Adam parameters are the ones applied: a step at learning rate 0 changes nothing.
    still = tc.forward([_sft_datum(ids)], "cross_entropy").result(timeout=60).metrics["loss:sum"]
    tc.forward_backward([_sft_datum(ids)], "cross_entropy").result(timeout=60)
    tc.optim_step(types.AdamParams(learning_rate=0.0)).result(timeout=60)
    assert tc.forward([_sft_datum(ids)], "cross_entropy").result(timeout=60).metrics["loss:sum"] == pytest.approx(still, abs=1e-5)


def test_clients_are_independent_and_custom_losses_run_client_side(client, server):
    """A second training client starts from the base (its own adapters and optimizer), and the SDK's client-side
    custom loss (forward, local gradient, cross_entropy with weights -dC/dlogp) reaches the trainer."""
    sc, tc, tok = client
    ids = tok.encode(TEXT)
    d = _sft_datum(ids)
    fresh = sc.create_lora_training_client(base_model=server[1], rank=4).result(timeout=120)
    trained = tc.forward([d], "cross_entropy").result(timeout=60).metrics["loss:sum"]
    base = fresh.forward([d], "cross_entropy").result(timeout=60).metrics["loss:sum"]
    assert base > trained + 1.0  # the first client's steps did not touch the second's model

    out = fresh.forward_backward_custom([d], lambda data, lps: (-2.0 * sum(lp.sum() for lp in lps), {})).result(timeout=60)
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(2.0 * base, rel=1e-4)  # the server's sum(-w log p), w = 2
    fresh.optim_step(types.AdamParams(learning_rate=5e-3)).result(timeout=60)
    assert fresh.forward([d], "cross_entropy").result(timeout=60).metrics["loss:sum"] < base


def test_sampled_logprobs_match_the_trainer_then_an_rl_step(client):
    _, tc, tok = client
    prompt = tok.encode(TEXT)[:6]
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=120)
    res = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=8, seed=5)).result(timeout=120)
    assert len(res.sequences) == 2
    seq = prompt + list(res.sequences[0].tokens)
    sampled = np.asarray(res.sequences[0].logprobs)
    assert len(sampled) == len(res.sequences[0].tokens) > 0
    before = _trainer_logprobs(tc, seq)
    diff = float(np.abs(before[len(prompt) - 1:] - sampled).max())
    assert diff <= SYNC_TOL, f"engine vs trainer logprob max diff {diff:.3g} > {SYNC_TOL}"
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(seq)).result(timeout=60)
    assert scored[0] is None
    assert float(np.abs(np.asarray(scored[1:], dtype=np.float64) - before).max()) <= SYNC_TOL

    # RL: importance sampling on the sampled completion, advantage +1 on its tokens only.
    n_prompt = len(prompt) - 1
    adv = [0.0] * n_prompt + [1.0] * len(sampled)
    datum = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                        loss_fn_inputs={"target_tokens": seq[1:], "logprobs": [0.0] * n_prompt + sampled.tolist(), "advantages": adv})
    fb = tc.forward_backward([datum], "importance_sampling").result(timeout=60)
    assert fb.metrics["loss:sum"] == pytest.approx(-sum(adv), abs=1e-3)  # ratio 1 on every token
    tc.optim_step(types.AdamParams(learning_rate=5e-3)).result(timeout=60)
    after = _trainer_logprobs(tc, seq)
    assert after[n_prompt:].sum() > before[n_prompt:].sum()


def test_bad_requests_get_the_sdks_error_shapes(client, server):
    import httpx

    sc, tc, tok = client
    url, _ = server
    ids = tok.encode(TEXT)
    d = _sft_datum(ids)
    t0 = time.time()
    with pytest.raises(tinker.BadRequestError, match="not supported"):
        tc.forward_backward([d], "dro").result(timeout=30)
    short = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0, 1.0]})
    with pytest.raises(tinker.BadRequestError, match="shape"):
        tc.forward_backward([short], "cross_entropy").result(timeout=30)
    with pytest.raises(tinker.BadRequestError, match="lacks"):
        tc.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})],
                            "ppo").result(timeout=30)
    with pytest.raises(tinker.BadRequestError, match="tokens in one request"):  # --max-batch-tokens 600
        tc.forward_backward([d] * 40, "cross_entropy").result(timeout=30)
    with pytest.raises(tinker.BadRequestError, match=r"must be in \[0, 512\)"):
        tc.forward_backward([_sft_datum([0, 1, 10**6])], "cross_entropy").result(timeout=30)

    # unknown model, a foreign session's checkpoint, no key: plain 4xx answers
    h = {"X-API-Key": KEY}
    r = httpx.post(f"{url}/api/v1/get_info", json={"model_id": "session-nope:train:0"}, headers=h)
    assert r.status_code == 404 and "unknown model_id" in r.json()["detail"]
    r = httpx.post(f"{url}/api/v1/optim_step", json={"model_id": tc.model_id, "adam_params": {"learning_rate": "fast"}}, headers=h)
    assert r.status_code == 400
    assert httpx.post(f"{url}/api/v1/create_session", json={}).status_code == 401
    assert httpx.get(f"{url}/api/v1/healthz").status_code == 200
    saved = tc.save_weights_for_sampler(name="mine").result(timeout=60).path
    other = tinker.ServiceClient(base_url=url, api_key=KEY)  # another session
    with pytest.raises(tinker.NotFoundError):
        other.create_sampling_client(model_path=saved).result(timeout=30)
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=url, api_key="tml-wrong").create_lora_training_client(base_model="x", rank=4).result(timeout=30)
    assert time.time() - t0 < 60  # nothing sat in the SDK's retry loop

    # the client still trains after its refused requests
    assert tc.forward_backward([d], "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
