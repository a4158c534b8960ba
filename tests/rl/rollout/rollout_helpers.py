"""Shared helpers for the rollout tests: special token ids, fixed token sequences, comparisons."""
from __future__ import annotations

import numpy as np

from tests.helpers.checkpoints import SPECIAL_TOKENS

# Token ids of the trained tiny tokenizer: special tokens come first, in SPECIAL_TOKENS order.
EOS_ID = SPECIAL_TOKENS.index("<|endoftext|>")
THINK_ID = SPECIAL_TOKENS.index("<think>")
END_THINK_ID = SPECIAL_TOKENS.index("</think>")


def fixed_sequences(n: int, length: int, seed: int = 0, low: int = 10, high: int = 500) -> tuple[tuple[int, ...], ...]:
    """Random ordinary (non-special) token sequences, fixed by `seed`."""
    rs = np.random.RandomState(seed)
    return tuple(tuple(int(x) for x in rs.randint(low, high, size=length)) for _ in range(n))


def cut_at_eos(ids) -> tuple[int, ...]:
    ids = tuple(ids)
    return ids[: ids.index(EOS_ID) + 1] if EOS_ID in ids else ids


def max_abs_diff(a_list, b_list) -> float:
    assert len(a_list) == len(b_list)
    return max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(a_list, b_list))


def random_qwen3_moe(hidden: int = 64, moe_inter: int = 32, seed: int = 0):
    """A tiny Qwen3-MoE (4 experts, top-2, vocab 96) with N(0, 1) weights: large, distinct values make
    any sync or cast error visible."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, intermediate_size=48, moe_intermediate_size=moe_inter, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(seed)
    m = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    return m
