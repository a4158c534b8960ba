"""On-disk layout of checkpoints: experts are saved one tensor per expert, loaded fused.

In memory the experts are fused 3-D parameters (transformers-5 style): `mlp.experts.gate_up_proj` [E, 2M, D] and
`mlp.experts.down_proj` [E, D, M]. `save_pretrained` writes them per expert, in the layout every Qwen-MoE /
Qwen3-Next checkpoint (and vLLM's loaders) use:
    mlp.experts.{e}.gate_proj.weight [M, D] = gate_up_proj[e, :M]
    mlp.experts.{e}.up_proj.weight   [M, D] = gate_up_proj[e, M:]
    mlp.experts.{e}.down_proj.weight [D, M] = down_proj[e]
and `from_pretrained` fuses them back. This reuses transformers' own converters (the ones registered for
`qwen2_moe`, which Qwen3-Next uses), registered for `model_type = "hybrid_moe"`. `fused_to_per_expert` gives the
same mapping as a plain function for weight sync code that does not go through save_pretrained.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch


def register_checkpoint_layout() -> None:
    from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                 register_checkpoint_conversion_mapping)
    mapping = get_checkpoint_conversion_mapping("qwen2_moe")
    if mapping is None:
        raise RuntimeError("transformers has no 'qwen2_moe' conversion mapping: the per-expert checkpoint layout "
                           "cannot be registered with this transformers version")
    register_checkpoint_conversion_mapping("hybrid_moe", mapping, overwrite=True)


def fused_to_per_expert(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Map one in-memory state-dict entry to checkpoint-layout entries (identity for non-expert tensors)."""
    if name.endswith("mlp.experts.gate_up_proj"):
        prefix = name[: -len("gate_up_proj")]
        m = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            yield f"{prefix}{e}.gate_proj.weight", tensor[e, :m]
            yield f"{prefix}{e}.up_proj.weight", tensor[e, m:]
    elif name.endswith("mlp.experts.down_proj"):
        prefix = name[: -len("down_proj")]
        for e in range(tensor.shape[0]):
            yield f"{prefix}{e}.down_proj.weight", tensor[e]
    else:
        yield name, tensor
