"""vLLM plugin serving the project's `HybridMoeForCausalLM` on vLLM's Qwen3-Next implementation.

`register()` is the `vllm.general_plugins` entry point (pyproject: `jointrl_hybrid_moe`), so every vLLM
process — including the default multi-process engine's workers — sees the architecture. It must be
cheap and must never break vLLM start-up for other models: it imports only the (light) config module,
registers the config with transformers' AutoConfig and the architecture with vLLM's ModelRegistry as a
lazy "module:Class" string, and logs instead of raising if anything is missing.

How the architecture maps onto Qwen3-Next (model/modeling.py was built Qwen3-Next-compatible):
- `linear_attention` layers -> vLLM's gated delta-rule layers (same weight names).
- `indexed_attention` (gated DSA) layers -> vLLM's dense gated attention (`full_attention`). This is
  exact only while every query may read every earlier key, i.e. when max_model_len <= index_topk (DSA
  with top-k >= visible tokens is dense causal attention). On CPU (no sparse-attention kernel in vLLM)
  any other configuration is refused with a clear error; on GPU the same limit applies until a DSA
  path for this architecture is wired (not done here).
- The lightning-indexer weights (`self_attn.indexer.*`) are not loaded (the indexer cannot change the output
  in the dense regime).
- Images: the class is a vLLM multimodal model (model/vllm_vision.py: processor registration, one
  `<|image|>` per image expanded to one per patch, the patch embedding `model.patch_embed.proj`). An engine
  built with `limit_mm_per_prompt={"image": 0}` or `language_model_only=True` is text-only: no patch
  embedding is built and its weights are skipped.
- The aux-loss-free routing bias (`mlp.gate.e_score_correction_bias`) has no counterpart in Qwen3-Next:
  it is accepted only when it is all zeros (otherwise expert choice would differ) and refused otherwise.
- vLLM's CPU gated-delta kernel needs bf16 and linear-attention head dims 64/128 (docs/platform.md); refused
  otherwise, with the reason.

What it does not do: sparse attention on GPUs, or image input for any other architecture.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

log = logging.getLogger(__name__)

ARCH = "HybridMoeForCausalLM"
_VISION_PREFIX = "model.patch_embed."
_SKIP_PARTS = (".self_attn.indexer.",)


class HybridMoeServingError(ValueError):
    """A HybridMoe configuration vLLM cannot serve exactly on this platform."""


def serving_dtype(dtype: str, is_cpu: bool) -> str:
    """The engine dtype of a HybridMoe for `rollout.dtype` ("auto": vLLM's CPU gated-delta kernel needs bf16)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if is_cpu else "float32"


def check_servable(hf_config: Any, max_model_len: int, dtype: Any, is_cpu: bool) -> None:
    """Raise HybridMoeServingError naming what is wrong, if this config cannot be served exactly."""
    import torch

    has_dsa = "indexed_attention" in list(hf_config.layer_types)
    if has_dsa and max_model_len > hf_config.index_topk:
        raise HybridMoeServingError(
            f"HybridMoe DSA layers are served as dense gated attention, which equals DSA only when "
            f"max_model_len ({max_model_len}) <= index_topk ({hf_config.index_topk}); "
            + ("vLLM has no sparse-attention kernel on CPU. " if is_cpu else "no DSA path is wired for this architecture. ")
            + f"Set max_model_len <= {hf_config.index_topk}."
        )
    if is_cpu:
        if dtype != torch.bfloat16:
            raise HybridMoeServingError(f"vLLM's CPU gated-delta-rule kernel requires bfloat16; got dtype {dtype} (set dtype='bfloat16')")
        bad = {k: getattr(hf_config, k) for k in ("linear_key_head_dim", "linear_value_head_dim", "head_dim") if getattr(hf_config, k) not in (64, 128)}
        if bad:
            raise HybridMoeServingError(f"vLLM on CPU needs head dims 64 or 128 for these fields: {bad}")


def _qwen3_next_layer_types(layer_types: Iterable[str]) -> list[str]:
    return ["full_attention" if t == "indexed_attention" else t for t in layer_types]


def _model_class() -> type:
    """Build the vLLM model class (imports vLLM's Qwen3-Next: only when vLLM instantiates the model)."""
    import torch
    from vllm.model_executor.models.interfaces import SupportsMultiModal
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
    from vllm.platforms import current_platform

    from model.vllm_vision import HybridMoeVisionMixin, registered

    @registered
    class HybridMoeVllmForCausalLM(HybridMoeVisionMixin, Qwen3NextForCausalLM, SupportsMultiModal):
        """Qwen3-Next with DSA layers as dense gated attention, indexer weights skipped, image patches
        embedded at their placeholders."""

        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            mc = vllm_config.model_config
            cfg = mc.hf_text_config
            check_servable(cfg, mc.max_model_len, mc.dtype, current_platform.is_cpu())
            for c in {id(x): x for x in (mc.hf_config, cfg)}.values():
                c.layer_types = _qwen3_next_layer_types(c.layer_types)
                if not hasattr(c, "attn_output_gate"):
                    c.attn_output_gate = True  # gated attention, as in Qwen3-Next
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self._init_vision(vllm_config)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            vision: list[tuple[str, torch.Tensor]] = []

            def filtered() -> Iterable[tuple[str, torch.Tensor]]:
                for name, t in weights:
                    if name.startswith(_VISION_PREFIX):
                        if self.patch_embed is not None:  # text-only engine: nothing to load them into
                            vision.append((name, t))
                        continue
                    if any(p in name for p in _SKIP_PARTS):
                        continue
                    if name.endswith("mlp.gate.e_score_correction_bias"):
                        if torch.count_nonzero(t):
                            raise HybridMoeServingError(f"{name} is non-zero: the aux-loss-free routing bias is not served by the Qwen3-Next path")
                        continue
                    yield name, t

            loaded = super().load_weights(filtered())
            return loaded | self.load_vision_weights(vision)

    return HybridMoeVllmForCausalLM


def __getattr__(name: str) -> Any:
    if name == "HybridMoeVllmForCausalLM":  # what ModelRegistry's lazy "module:Class" resolves
        cls = _model_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def register() -> None:
    """vLLM general-plugin entry point: register config + architecture. Never raises."""
    try:
        from transformers import AutoConfig

        from model.configuration import HybridMoeConfig

        AutoConfig.register(HybridMoeConfig.model_type, HybridMoeConfig, exist_ok=True)
    except Exception as e:  # a broken model package must not stop vLLM serving other models
        log.warning("jointrl plugin: HybridMoe config not registered (%r); other models are unaffected", e)
        return
    try:
        from vllm import ModelRegistry

        if ARCH not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(ARCH, "model.vllm_plugin:HybridMoeVllmForCausalLM")
    except Exception as e:
        log.warning("jointrl plugin: %s not registered with vLLM (%r)", ARCH, e)
