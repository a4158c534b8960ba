"""`HybridMoeConfig`: the configuration of the hybrid sparse MoE (`model_type = "hybrid_moe"`).

What it does: holds every size and switch of the model described in the seed articles — a stack of
Gated Delta (`linear_attention`) and Gated DSA (`indexed_attention`) token mixers, each followed by
a routed MoE FFN — using transformers' field names wherever one exists (Qwen3-Next for the delta
layers, gated attention and MoE block; DeepSeek-V3/V3.2 for `scoring_func`, `routed_scaling_factor`
and the `index_*` indexer fields). It validates the fields at construction and names the bad one.

What it does not do: build modules (see `model/modeling.py`), count parameters (see
`model/param_count.py`), or know about tokenizers / chat templates (another module).

Field names are the contract for weight sync and vLLM serving: a Qwen3-Next config is obtained by
renaming `indexed_attention` -> `full_attention` and dropping the `index_*` / `vision_*` / router
extras (see docs/model.md).
"""
from __future__ import annotations

from transformers import PreTrainedConfig

LINEAR_ATTENTION = "linear_attention"  # Gated Delta layer (transformers' name, as in Qwen3-Next)
INDEXED_ATTENTION = "indexed_attention"  # Gated DSA layer (transformers' name for indexer-based attention)
_LAYER_TYPES = (LINEAR_ATTENTION, INDEXED_ATTENTION)
# vLLM's CPU attention and CPU gated-delta kernels refuse other sizes (docs/platform.md); we keep every shipped
# config inside this set, but do not forbid other sizes for pure-PyTorch use.
VLLM_CPU_HEAD_DIMS = (64, 128)


def default_layer_types(num_hidden_layers: int, delta_per_dsa: int = 3) -> list[str]:
    """The seed's schedule: groups of `delta_per_dsa` delta layers then one DSA layer; when the layer count is not
    a multiple of the group size, the last layer is also DSA (the stack ends on a global-retrieval layer).
    93 layers with 3:1 -> 23 x (3 + 1) + 1 = 69 delta + 24 DSA."""
    if num_hidden_layers < 1:
        raise ValueError(f"num_hidden_layers must be >= 1, got {num_hidden_layers}")
    if delta_per_dsa < 0:
        raise ValueError(f"delta_per_dsa must be >= 0, got {delta_per_dsa}")
    period = delta_per_dsa + 1
    types = [INDEXED_ATTENTION if (i + 1) % period == 0 else LINEAR_ATTENTION for i in range(num_hidden_layers)]
    types[-1] = INDEXED_ATTENTION
    return types


class HybridMoeConfig(PreTrainedConfig):
    r"""Configuration of `HybridMoeForCausalLM`. Defaults are the `tiny` shipped shape.

    Token mixers (per `layer_types`):
      - `linear_attention`: gated delta rule with `linear_num_key_heads` x `linear_key_head_dim` q/k heads and
        `linear_num_value_heads` x `linear_value_head_dim` v heads, causal depthwise conv of width
        `linear_conv_kernel_dim` (Qwen3-Next `Qwen3NextGatedDeltaNet`).
      - `indexed_attention`: Qwen3-Next gated attention (`num_attention_heads`, `num_key_value_heads`, `head_dim`,
        partial RoPE from `rope_parameters["partial_rotary_factor"]`) whose keys are restricted per query to the
        `index_topk` best by a lightning indexer with `index_n_heads` heads of size `index_head_dim`.
    MoE FFN (every layer unless listed in `mlp_only_layers`): `num_experts` experts of width `moe_intermediate_size`,
    top-`num_experts_per_tok`, scored by `scoring_func`, plus an optional shared expert of width
    `shared_expert_intermediate_size` (0 = none) behind a sigmoid gate.
    """

    model_type = "hybrid_moe"
    keys_to_ignore_at_inference = ["past_key_values"]

    # --- shared transformer shape
    vocab_size: int = 8192
    hidden_size: int = 128
    intermediate_size: int = 256  # dense MLP width, used only by layers in `mlp_only_layers`
    num_hidden_layers: int = 4
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None  # {"rope_type": "default", "rope_theta": ..., "partial_rotary_factor": ...}
    layer_types: list[str] | None = None  # one of _LAYER_TYPES per layer; default 3 delta : 1 DSA
    # --- Gated DSA (indexed_attention) layers
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    attention_bias: bool = False
    attention_dropout: float = 0.0
    index_topk: int = 2048  # k: keys each query may read; >= max_position_embeddings means "dense" in practice
    index_n_heads: int = 2  # lightning-indexer heads (DeepSeek-V3.2 name)
    index_head_dim: int = 64  # lightning-indexer head size (DeepSeek-V3.2 name)
    indexer_loss_coef: float = 0.0  # weight of the indexer KL in `loss` when labels are given (it is always reported)
    indexer_loss_mode: str = "dense"  # "dense": warm-up KL on all visible keys; "sparse": KL on the selected set only
    # --- Gated Delta (linear_attention) layers
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 2
    # --- MoE FFN
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 64  # 0 = no shared expert
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] | None = None
    norm_topk_prob: bool = True
    scoring_func: str = "softmax"  # "softmax" (Qwen/Mixtral) or "sigmoid" (DeepSeek-V3)
    routed_scaling_factor: float = 1.0  # DeepSeek-V3 multiplies the routed output by this
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    expert_bias_update_rate: float = 0.001  # aux-loss-free bias step u (DeepSeek-V3 "bias update speed")
    freeze_expert_bias: bool = False  # True: the selection bias never moves (public RL practice)
    # --- image input
    image_token_id: int = 10
    vision_patch_size: int = 16
    vision_num_channels: int = 3
    # --- special tokens (fixed ids shared with the tokenizer)
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 1

    def __post_init__(self, **kwargs):
        kwargs.setdefault("partial_rotary_factor", 0.25)  # Qwen3-Next's default, kept for BC with its configs
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        self.rope_parameters.setdefault("partial_rotary_factor", kwargs.pop("partial_rotary_factor"))
        self.rope_parameters.setdefault("rope_type", "default")
        self.rope_parameters.setdefault("rope_theta", 10000.0)
        kwargs.pop("partial_rotary_factor", None)
        self.mlp_only_layers = [] if self.mlp_only_layers is None else list(self.mlp_only_layers)
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        super().__post_init__(**kwargs)
        self._check()

    def _check(self) -> None:
        def bad(name: str, value, want: str) -> ValueError:
            return ValueError(f"HybridMoeConfig.{name}={value!r} is invalid: {want}")

        if len(self.layer_types) != self.num_hidden_layers:
            raise bad("layer_types", f"<{len(self.layer_types)} entries>", f"need num_hidden_layers={self.num_hidden_layers} entries")
        for i, t in enumerate(self.layer_types):
            if t not in _LAYER_TYPES:
                raise bad(f"layer_types[{i}]", t, f"must be one of {_LAYER_TYPES}")
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
                     "num_experts_per_tok", "moe_intermediate_size", "index_topk", "index_n_heads", "index_head_dim",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_conv_kernel_dim", "vocab_size", "vision_patch_size", "vision_num_channels"):
            if int(getattr(self, name)) < 1:
                raise bad(name, getattr(self, name), "must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", self.num_key_value_heads, f"must divide num_attention_heads={self.num_attention_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise bad("linear_num_key_heads", self.linear_num_key_heads,
                      f"must divide linear_num_value_heads={self.linear_num_value_heads}")
        if self.num_experts_per_tok > self.num_experts:
            raise bad("num_experts_per_tok", self.num_experts_per_tok, f"must be <= num_experts={self.num_experts}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise bad("scoring_func", self.scoring_func, "must be 'softmax' or 'sigmoid'")
        if self.indexer_loss_mode not in ("dense", "sparse"):
            raise bad("indexer_loss_mode", self.indexer_loss_mode, "must be 'dense' or 'sparse'")
        rot = int(self.head_dim * self.rope_parameters["partial_rotary_factor"])
        if rot % 2 or rot > self.index_head_dim:
            raise bad("rope_parameters.partial_rotary_factor", self.rope_parameters["partial_rotary_factor"],
                      f"rotary dim {rot} must be even and <= index_head_dim={self.index_head_dim} (the indexer shares the RoPE)")
        if self.shared_expert_intermediate_size < 0:
            raise bad("shared_expert_intermediate_size", self.shared_expert_intermediate_size, "must be >= 0")
        if self.expert_bias_update_rate < 0:
            raise bad("expert_bias_update_rate", self.expert_bias_update_rate, "must be >= 0")

    # ---------------------------------------------------------------- derived views
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope_parameters["partial_rotary_factor"])

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layer_indices(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def vllm_cpu_servable_sizes(self) -> bool:
        """True when every head size is one vLLM's CPU kernels accept (docs/platform.md)."""
        return all(d in VLLM_CPU_HEAD_DIMS for d in (self.head_dim, self.linear_key_head_dim, self.linear_value_head_dim))


__all__ = ["HybridMoeConfig", "default_layer_types", "LINEAR_ATTENTION", "INDEXED_ATTENTION"]
