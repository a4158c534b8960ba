"""Image input for HybridMoe in vLLM: the multimodal processor registration and the patch embedding.

vLLM serves images for a model through three pieces registered with `MULTIMODAL_REGISTRY.register_processor`
(vLLM's "multi-modal support" recipe): processing info (limits, tokens per image), a dummy-input builder
(for start-up profiling) and a processor (pixels -> model inputs, and how each image's placeholder grows).
For HybridMoe:
- processor: every image item (a Pillow image, as vLLM's data parser hands them over) becomes
  `image_patches` [patches, C*p*p] through model/vision.py, the same decode / normalise / patch order the HF
  model uses; images the model cannot take (sides not multiples of the patch size, too large) are refused
  there with the reason, which vLLM returns to the caller as a request error;
- placeholder expansion: a prompt carries ONE `<|image|>` per image (model/chat.py renders it so); vLLM
  replaces it by one `<|image|>` per patch, (W/p) * (H/p) of them, so the engine's prompt is exactly the
  HF model's `input_ids`;
- `HybridMoeVisionMixin`: the patch embedding (`patch_embed.proj`, the HF checkpoint's
  `model.patch_embed.proj.*`, loaded and synced like every other weight) and `embed_input_ids`, which writes
  the patch embeddings over the placeholder positions vLLM marks.

What it does not do: decide how many images an engine takes (the engine's `limit_mm_per_prompt`; with
`language_model_only` the patch embedding is not even built), or build prompts (the chat codecs do).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import BatchFeature
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import MultiModalDataItems
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
)

from model.chat import IMAGE_TOKEN
from model.vision import MAX_IMAGES_PER_PROMPT, VisionSpec, from_pil, patch_rows, pixel_tensor


class HybridMoeProcessingInfo(BaseProcessingInfo):
    def spec(self) -> VisionSpec:
        spec = VisionSpec.from_config(self.get_hf_config())
        if spec is None:
            raise ValueError("HybridMoe image processing needs a hybrid_moe config")
        return spec

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": MAX_IMAGES_PER_PROMPT}

    def max_image_grid(self, seq_len: int) -> tuple[int, int]:
        """(columns, rows) of patches of the largest image that fits `seq_len` tokens."""
        spec = self.spec()
        side = spec.max_side // spec.patch_size
        rows = max(1, min(side, seq_len // side))
        return side, rows

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        cols, rows = self.max_image_grid(seq_len)
        return {"image": cols * rows}


class HybridMoeDummyInputsBuilder(BaseDummyInputsBuilder[HybridMoeProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return IMAGE_TOKEN * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Any = None) -> Mapping[str, Any]:
        cols, rows = self.info.max_image_grid(seq_len)
        p = self.info.spec().patch_size
        overrides = mm_options.get("image") if mm_options else None
        return {"image": self._get_dummy_images(width=cols * p, height=rows * p, num_images=mm_counts.get("image", 0),
                                                 overrides=overrides)}


class HybridMoeMultiModalProcessor(BaseMultiModalProcessor[HybridMoeProcessingInfo]):
    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> BatchFeature:
        # No HF processor exists for this model: model/vision.py is the processor.
        spec = self.info.spec()
        images = hf_data.get("images") or []
        rows = [patch_rows(pixel_tensor(from_pil(img, spec)), spec.patch_size) for img in images]
        return BatchFeature({"image_patches": rows})

    def _get_mm_fields_config(self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
                              ) -> Mapping[str, MultiModalFieldConfig]:
        return {"image_patches": MultiModalFieldConfig.batched("image")}

    def _get_prompt_updates(self, mm_items: MultiModalDataItems, hf_processor_mm_kwargs: Mapping[str, object],
                            out_mm_kwargs: MultiModalKwargsItems) -> Sequence[PromptUpdate]:
        image_id = self.info.spec().image_token_id

        def replacement(item_idx: int) -> list[int]:
            # From the processed item (not the raw image), so items served from vLLM's processor cache work too.
            n = int(out_mm_kwargs["image"][item_idx]["image_patches"].data.shape[0])
            return [image_id] * n

        return [PromptReplacement(modality="image", target=[image_id], replacement=replacement)]


class HybridMoeVisionMixin:
    """Patch embedding + multimodal `embed_input_ids` for the vLLM HybridMoe class (mixed in before
    Qwen3NextForCausalLM). `self.patch_embed` is None on an engine built text-only."""

    patch_embed: nn.Module | None

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("image"):
            return IMAGE_TOKEN
        raise ValueError(f"HybridMoe takes images only, not {modality!r}")

    def _init_vision(self, vllm_config: Any) -> None:
        cfg = vllm_config.model_config.hf_text_config
        mm = vllm_config.model_config.multimodal_config
        self.patch_embed = None
        if mm is not None and mm.get_limit_per_prompt("image") > 0:
            p, c = int(cfg.vision_patch_size), int(cfg.vision_num_channels)
            # Same name and shape as the HF model's `model.patch_embed.proj`; plain torch (one small GEMM per image).
            self.patch_embed = nn.Module()
            self.patch_embed.proj = nn.Linear(c * p * p, cfg.hidden_size, bias=True,
                                              dtype=vllm_config.model_config.dtype)
        self._language_model_names = ["model"]

    def embed_multimodal(self, **kwargs: object) -> list[torch.Tensor]:
        patches = kwargs.get("image_patches")
        if patches is None:
            return []
        if self.patch_embed is None:
            raise ValueError("this engine was built without image input (limit_mm_per_prompt image = 0)")
        items = list(patches) if isinstance(patches, (list, tuple)) else list(patches.unbind(0))
        w = self.patch_embed.proj.weight
        return [self.patch_embed.proj(x.to(device=w.device, dtype=w.dtype)) for x in items]

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings: Any = None, *,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        from vllm.model_executor.models.utils import _merge_multimodal_embeddings

        x = self.model.embed_input_ids(input_ids)
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return x
        if is_multimodal is None:
            raise ValueError("embed_input_ids: multimodal embeddings given without the is_multimodal mask")
        return _merge_multimodal_embeddings(inputs_embeds=x, multimodal_embeddings=multimodal_embeddings,
                                            is_multimodal=is_multimodal)

    def load_vision_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load `model.patch_embed.proj.*` (HF names) into the patch embedding through vLLM's weight
        loaders, so in-place reloads (weight sync) see them like any other parameter."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        loaded = set()
        for name, t in weights:
            local = name[len("model."):]  # model.patch_embed.proj.weight -> patch_embed.proj.weight
            param = params.get(local)
            if param is None:
                raise ValueError(f"{name}: no such image parameter in the served model")
            getattr(param, "weight_loader", default_weight_loader)(param, t)
            loaded.add(local)
        return loaded


def registered(cls: type) -> type:
    """`cls` registered with vLLM's multimodal registry as HybridMoe's image processor."""
    from vllm.multimodal import MULTIMODAL_REGISTRY

    return MULTIMODAL_REGISTRY.register_processor(HybridMoeMultiModalProcessor, info=HybridMoeProcessingInfo,
                                                  dummy_inputs=HybridMoeDummyInputsBuilder)(cls)
