"""Activation checkpointing with an HF family's router hooks (rl/trainer/checkpointing.py, model/families.py).

The hooks record each router's logits (with their graph) for the router terms. A checkpointed layer runs its
forward again in the backward; if the hooks recorded that recompute too, the reference kept to the recomputed
logits would hold the layer's whole recomputed graph until `clear()`, and checkpointing would save nothing
(measured on the upcycled SmolLM2-MoE at 2,048 tokens: 4.24 GB vs 5.19 GB without checkpointing, 2.72 GB with
the recompute unrecorded). Checked here: the recompute records nothing, replayed routes still apply in it, and
gradients equal the unchecked ones.
"""
from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from rl.trainer import checkpointing as C
from rl.trainer.policy import router_hooks


def _model() -> MixtralForCausalLM:
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    m = MixtralForCausalLM(cfg)
    m.train()
    return m


def _step(checkpoint: bool, replay: torch.Tensor | None):
    m = _model()
    hooks = router_hooks(m)
    if checkpoint:
        assert C.prepare(m, "on", "policy", hooks.recomputing)
        C.set_active(m, True)
    calls = {"n": 0}
    for layer in C.checkpoint_layers(m):
        f = layer._gradient_checkpointing_func if checkpoint else None
        if f is not None:
            def counted(*a, _f=f, **k):
                calls["n"] += 1
                return _f(*a, **k)
            layer._gradient_checkpointing_func = counted
    hooks.set_replay(replay)
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    out = m(input_ids=ids)
    recorded = hooks.router_logits()
    used = hooks.used_LNK().clone()
    loss = torch.log_softmax(out.logits, -1).mean() + sum((x.float() ** 2).mean() for x in recorded)
    loss.backward()
    after = hooks.router_logits()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return recorded, after, used, grads, calls["n"]


@pytest.mark.parametrize("replayed", [False, True])
def test_recompute_records_nothing_and_the_update_is_the_unchecked_one(replayed):
    replay = None
    if replayed:  # routes other than the router's own choice: the recompute must use them too
        replay = torch.randint(0, 4, (3, 48, 2), generator=torch.Generator().manual_seed(2))
        replay[..., 1] = (replay[..., 0] + 1) % 4
    ref_rec, _, ref_used, ref_grads, n0 = _step(False, replay)
    rec, after, used, grads, n = _step(True, replay)
    assert n0 == 0 and n == 3  # each layer checkpointed once in the forward
    assert all(a is b for a, b in zip(rec, after))  # what the forward recorded is still what the hooks hold
    assert torch.equal(used, ref_used)
    for r, x in zip(ref_rec, rec):
        torch.testing.assert_close(x, r, rtol=0, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)
