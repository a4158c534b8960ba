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
