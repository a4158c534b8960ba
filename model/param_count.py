"""Analytic parameter counts from a `HybridMoeConfig`, without instantiating the model.

`count_parameters(config)` returns total and active (per token) counts with a per-component breakdown. It is
checked against `sum(p.numel())` of instantiated tiny / small models in the tests, then used for the full-scale
shape, which is far too large to build here.

Conventions (state them when quoting numbers):
  - active = every parameter a text token touches: embeddings, lm_head, all attention / delta / indexer weights,
    norms, routers, shared experts, and `num_experts_per_tok` routed experts per MoE layer;
  - the image patch embedding is in `total` but not in `active` (text tokens do not touch it);
  - buffers (RoPE frequencies, expert selection bias, load counters) are not parameters and are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .configuration import LINEAR_ATTENTION, HybridMoeConfig


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int
    breakdown_total: dict[str, int] = field(default_factory=dict)


def count_parameters(c: HybridMoeConfig) -> ParamCount:
    D, V = c.hidden_size, c.vocab_size
    parts: dict[str, int] = {}
    parts["embed_tokens"] = V * D
    parts["lm_head"] = 0 if c.tie_word_embeddings else V * D
    parts["final_norm"] = D
    p = c.vision_patch_size
    parts["patch_embed"] = c.vision_num_channels * p * p * D + D

    kd, vd = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    delta = (D * (2 * kd + 2 * vd)  # in_proj_qkvz
             + D * 2 * c.linear_num_value_heads  # in_proj_ba
             + (2 * kd + vd) * c.linear_conv_kernel_dim  # depthwise conv1d
             + 2 * c.linear_num_value_heads  # dt_bias, A_log
             + c.linear_value_head_dim  # gated norm
             + vd * D)  # out_proj
    H, Hkv, Dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    b = 1 if c.attention_bias else 0
    attn = (D * H * Dh * 2 + b * H * Dh * 2 + 2 * (D * Hkv * Dh + b * Hkv * Dh) + H * Dh * D + b * D + 2 * Dh)
    indexer = D * c.index_n_heads * c.index_head_dim + D * c.index_head_dim + 2 * c.index_head_dim + D * c.index_n_heads
    expert = 3 * D * c.moe_intermediate_size
    shared = (3 * D * c.shared_expert_intermediate_size + D) if c.shared_expert_intermediate_size > 0 else 0

    parts.update(delta_layers=0, dsa_attention=0, dsa_indexer=0, layer_norms=0, routers=0, routed_experts=0,
                 shared_experts=0, dense_mlps=0)
    active_experts = 0
    for i, t in enumerate(c.layer_types):
        if t == LINEAR_ATTENTION:
            parts["delta_layers"] += delta
        else:
            parts["dsa_attention"] += attn
            parts["dsa_indexer"] += indexer
        parts["layer_norms"] += 2 * D
        if c.is_moe_layer(i):
            parts["routers"] += c.num_experts * D
            parts["routed_experts"] += c.num_experts * expert
            parts["shared_experts"] += shared
            active_experts += c.num_experts_per_tok * expert
        else:
            parts["dense_mlps"] += 3 * D * c.intermediate_size
    total = sum(parts.values())
    active = total - parts["routed_experts"] + active_experts - parts["patch_embed"]
    return ParamCount(total=total, active=active, breakdown_total=parts)
