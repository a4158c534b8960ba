"""Trainer parameter names -> the checkpoint names vLLM's loader reads, and the bucketing plan.

transformers 5 keeps a MoE layer's experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H]
with the gate rows first, `mlp.experts.down_proj` [E, H, I]) while `save_pretrained` writes one
tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight` [I, H], ...). vLLM's loaders
read the checkpoint layout, so the trainer's names must be converted before a sync. The mapping is
written out explicitly per naming family (Qwen2-MoE style gate/up/down, Mixtral style w1/w3/w2, and
gpt-oss, whose checkpoints keep the fused tensors under their in-memory names) and tested against what
`save_pretrained` writes; model/families.py names each family's naming (`Family.sync_names`). A split
is an index into the fused tensor's two leading dims, so one expert's checkpoint tensor is a
contiguous byte range of the fused one.

Bucketing keeps every "unit" (everything under one decoder layer `...layers.N.`; any other tensor
on its own) inside one bucket: vLLM fuses q/k/v, gate/up and all experts of a layer into single
parameters, so each bucket can be loaded by a separate in-place reload without leaving a fused
parameter half-written.

What this module does not do: encode bytes (rl/weights/encode.py), move them, or load them.
"""
from __future__ import annotations

import re
from typing import Mapping

import torch

from rl.weights.errors import WeightSyncError

# model_type -> expert naming family. Families: "qwen2_moe" (gate_proj/up_proj/down_proj),
# "mixtral" (w1 = gate, w3 = up, w2 = down), "fused" (gpt-oss: `experts.gate_up_proj` [E, H, 2I] with
# gate/up interleaved, its bias, `experts.down_proj` [E, I, H] and its bias are written and loaded as
# they are in memory). transformers' own conversion_mapping.py groups model types the same way;
# unknown model types default to "qwen2_moe" only if they have fused experts.
_FAMILY = {
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen2_moe",
    "qwen3_next": "qwen2_moe",
    "hybrid_moe": "qwen2_moe",
    "deepseek_v3": "qwen2_moe",
    "deepseek_v32": "qwen2_moe",
    "glm4_moe": "qwen2_moe",
    "olmoe": "qwen2_moe",
    "mixtral": "mixtral",
    "minimax": "mixtral",
    "gpt_oss": "fused",
}
_NAMES = {"qwen2_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2"), "fused": ("", "", "")}
# Module renames between transformers-5 memory and the checkpoint: Mixtral's MoE block is `mlp` in
# memory but `block_sparse_moe` on disk (router `gate` and experts alike).
_RENAMES = {"mixtral": ((re.compile(r"\.mlp\.(gate|experts)(?=\.|$)"), r".block_sparse_moe.\1"),), "qwen2_moe": (), "fused": ()}

_FUSED_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_LAYER_RE = re.compile(r"^(?P<unit>.*?\.layers\.\d+)\.")


def expert_family(model_type: str) -> str:
    return _FAMILY.get(model_type, "qwen2_moe")


def checkpoint_views(name: str, shape: tuple[int, ...], model_type: str) -> list[tuple[str, tuple]]:
    """Checkpoint (name, index into the source's leading dims) for one in-memory tensor.

    Fused experts split per expert: gate_up_proj [E, 2I, H] -> gate = [e, :I], up = [e, I:];
    down_proj [E, H, I] -> down = [e]. Indices only touch the two leading dims, so they apply equally
    to the float tensor and to its MXFP4 blocks [E, R, G, 16] / scales [E, R, G].
    """
    family = expert_family(model_type)
    gate_n, up_n, down_n = _NAMES[family]

    def rename(n: str) -> str:
        for pattern, repl in _RENAMES[family]:
            n = pattern.sub(repl, n)
        return n

    m = None if family == "fused" else _FUSED_RE.match(name)
    if m is None:
        return [(rename(name), ())]
    prefix, kind = m.group("prefix"), m.group("kind")
    if len(shape) != 3:
        raise WeightSyncError(f"{name}: expected a fused 3-D expert tensor [E, ., .], got shape {shape}")
    out: list[tuple[str, tuple]] = []
    if kind == "gate_up_proj":
        if shape[1] % 2:
            raise WeightSyncError(f"{name}: dim 1 ({shape[1]}) must be 2 x moe_intermediate_size")
        inter = shape[1] // 2
        for e in range(shape[0]):
            out.append((rename(f"{prefix}.{e}.{gate_n}.weight"), (e, slice(0, inter))))
            out.append((rename(f"{prefix}.{e}.{up_n}.weight"), (e, slice(inter, 2 * inter))))
    else:
        out = [(rename(f"{prefix}.{e}.{down_n}.weight"), (e,)) for e in range(shape[0])]
    return out


def to_checkpoint_format(
    state_dict: Mapping[str, torch.Tensor],
    model_type: str,
    *,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Rename/split a transformers-5 in-memory state dict into checkpoint (save_pretrained) names.

    Fused experts are split per expert: gate_up_proj [E, 2I, H] -> gate [I, H] = rows [:I],
    up [I, H] = rows [I:]; down_proj [E, H, I] -> down [H, I]. Other tensors keep their names.
    With tied embeddings `lm_head.weight` is dropped (save_pretrained does not write it).
    Floating tensors are optionally cast to `dtype` (once per source tensor, before splitting);
    outputs are detached views wherever possible (no copy unless needed).
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        t = t.detach()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        t = t.contiguous()
        for ckpt_name, idx in checkpoint_views(name, tuple(t.shape), model_type):
            out[ckpt_name] = t[idx] if idx else t
    return out


def unit_of(name: str) -> str:
    """The indivisible sync unit a tensor belongs to: its decoder layer, or itself."""
    m = _LAYER_RE.match(name)
    return m.group("unit") if m else name


def tensor_bytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


def plan_buckets(named: Mapping[str, torch.Tensor | int], bucket_mb: float) -> list[list[str]]:
    """Group names into buckets of about `bucket_mb` MB, never splitting a unit.

    Values are tensors or byte counts. A unit bigger than the bucket size gets a bucket of its own
    (it cannot be split). Order follows the mapping's order (layer by layer), which is what vLLM's
    layerwise reload handles with least buffering.
    """
    if bucket_mb <= 0:
        raise WeightSyncError(f"bucket_mb must be > 0, got {bucket_mb}")
    limit = int(bucket_mb * 1024 * 1024)
    units: dict[str, list[str]] = {}
    for n in named:
        units.setdefault(unit_of(n), []).append(n)
    buckets: list[list[str]] = []
    cur: list[str] = []
    cur_bytes = 0
    for names in units.values():
        ub = sum(v if isinstance(v, int) else tensor_bytes(v) for v in (named[n] for n in names))
        if cur and cur_bytes + ub > limit:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur = cur + names
        cur_bytes += ub
    if cur:
        buckets.append(cur)
    return buckets
