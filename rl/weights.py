"""Trainer state dict -> the checkpoint names/shapes vLLM's loader expects, bucketed for weight sync.

transformers 5 keeps a MoE layer's experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H]
with the gate rows first, `mlp.experts.down_proj` [E, H, I]) while `save_pretrained` writes one
tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight` [I, H], ...). vLLM's loaders
read the checkpoint layout, so the trainer's names must be converted before a sync. The mapping is
written out here explicitly per naming family (Qwen2-MoE style gate/up/down, Mixtral style w1/w3/w2)
and tested against what `save_pretrained` writes.

Bucketing keeps every "unit" (everything under one decoder layer `...layers.N.`; any other tensor on
its own) inside one bucket: vLLM fuses q/k/v, gate/up and all experts of a layer into single
parameters, so each bucket can be loaded by a separate in-place reload without leaving a fused
parameter half-written. Buckets are serialised with safetensors (bytes that cross Ray's object
store or a socket unchanged).

What this module does not do: send anything (the rollout worker / dispatcher do), quantise
(MXFP4 sync formats live with the trainer), or handle tensor-parallel shards.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

# model_type -> expert naming family. Families: "qwen2_moe" (gate_proj/up_proj/down_proj),
# "mixtral" (w1 = gate, w3 = up, w2 = down). transformers' own conversion_mapping.py groups model
# types the same way; unknown model types default to "qwen2_moe" only if they have fused experts.
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
}
_NAMES = {"qwen2_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
# Module renames between transformers-5 memory and the checkpoint: Mixtral's MoE block is `mlp` in
# memory but `block_sparse_moe` on disk (router `gate` and experts alike).
_RENAMES = {"mixtral": ((re.compile(r"\.mlp\.(gate|experts)(?=\.|$)"), r".block_sparse_moe.\1"),), "qwen2_moe": ()}

_FUSED_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_LAYER_RE = re.compile(r"^(?P<unit>.*?\.layers\.\d+)\.")


class WeightSyncError(ValueError):
    """A state dict that cannot be converted or bucketed; the message names the tensor."""


@dataclass(frozen=True)
class WeightBucket:
    """One serialised shard of a weight sync: safetensors bytes plus accounting."""

    names: tuple[str, ...]
    num_bytes: int  # tensor payload bytes (excludes the safetensors header)
    payload: bytes


def expert_family(model_type: str) -> str:
    return _FAMILY.get(model_type, "qwen2_moe")


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
    Tensors are detached, made contiguous and optionally cast to `dtype`; views are fine (no copy
    unless needed).
    """
    family = expert_family(model_type)
    gate_n, up_n, down_n = _NAMES[family]
    renames = _RENAMES[family]
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor) -> None:
        for pattern, repl in renames:
            name = pattern.sub(repl, name)
        t = t.detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        out[name] = t.contiguous()

    for name, t in state_dict.items():
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        m = _FUSED_RE.match(name)
        if m is None:
            put(name, t)
            continue
        prefix, kind = m.group("prefix"), m.group("kind")
        if t.dim() != 3:
            raise WeightSyncError(f"{name}: expected a fused 3-D expert tensor [E, ., .], got shape {tuple(t.shape)}")
        num_experts = t.shape[0]
        if kind == "gate_up_proj":
            if t.shape[1] % 2:
                raise WeightSyncError(f"{name}: dim 1 ({t.shape[1]}) must be 2 x moe_intermediate_size")
            inter = t.shape[1] // 2
            for e in range(num_experts):
                put(f"{prefix}.{e}.{gate_n}.weight", t[e, :inter])
                put(f"{prefix}.{e}.{up_n}.weight", t[e, inter:])
        else:
            for e in range(num_experts):
                put(f"{prefix}.{e}.{down_n}.weight", t[e])
    return out


def unit_of(name: str) -> str:
    """The indivisible sync unit a tensor belongs to: its decoder layer, or itself."""
    m = _LAYER_RE.match(name)
    return m.group("unit") if m else name


def plan_buckets(named: Mapping[str, torch.Tensor], bucket_mb: float) -> list[list[str]]:
    """Group tensor names into buckets of about `bucket_mb` MB, never splitting a unit.

    A unit bigger than the bucket size gets a bucket of its own (it cannot be split).
    Order follows the state dict's order (layer by layer), which is what vLLM's layerwise reload
    handles with least buffering.
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
        ub = sum(tensor_bytes(named[n]) for n in names)
        if cur and cur_bytes + ub > limit:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur = cur + names
        cur_bytes += ub
    if cur:
        buckets.append(cur)
    return buckets


def tensor_bytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


def pack_bucket(tensors: Mapping[str, torch.Tensor]) -> WeightBucket:
    from safetensors.torch import save

    payload = save({n: t.contiguous() for n, t in tensors.items()})
    return WeightBucket(names=tuple(tensors), num_bytes=sum(tensor_bytes(t) for t in tensors.values()), payload=payload)


def unpack_bucket(bucket: WeightBucket | bytes) -> list[tuple[str, torch.Tensor]]:
    """Deserialise a bucket into (name, tensor) pairs in the bucket's original order."""
    from safetensors.torch import load

    payload = bucket.payload if isinstance(bucket, WeightBucket) else bucket
    if not isinstance(payload, (bytes, bytearray)):
        raise WeightSyncError(f"unpack_bucket: expected safetensors bytes or a WeightBucket, got {type(bucket).__name__}")
    loaded = load(bytes(payload))
    order = bucket.names if isinstance(bucket, WeightBucket) else tuple(loaded)
    return [(n, loaded[n]) for n in order]


def make_buckets(
    state_dict: Mapping[str, torch.Tensor],
    model_type: str,
    bucket_mb: float = 64.0,
    *,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype | None = None,
) -> list[WeightBucket]:
    """Trainer state dict -> checkpoint-format, unit-preserving, serialised buckets."""
    ckpt = to_checkpoint_format(state_dict, model_type, tie_word_embeddings=tie_word_embeddings, dtype=dtype)
    return [pack_bucket({n: ckpt[n] for n in names}) for names in plan_buckets(ckpt, bucket_mb)]


def total_bytes(buckets: Iterable[WeightBucket]) -> int:
    return sum(b.num_bytes for b in buckets)


_SYNC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def export_buckets(
    module: torch.nn.Module,
    named_weights: Iterable[tuple[str, torch.Tensor]],
    bucket_mb: float = 64.0,
    fmt: str = "fp32",
) -> list[WeightBucket]:
    """What a trainer sends to rollout engines: its (gathered, CPU) weights as checkpoint-format buckets.

    `module` supplies the config (model_type, tied embeddings) and the set of persistent names:
    non-persistent buffers (e.g. rotary `inv_freq`) are not part of a checkpoint and are dropped.
    `fmt`: "fp32" or "bf16" (cast before sending). MXFP4 sync is not supported by vLLM's loaders for
    these architectures and is refused.
    """
    if fmt not in _SYNC_DTYPES:
        raise WeightSyncError(f"sync format {fmt!r} is not supported here; use one of {sorted(_SYNC_DTYPES)}")
    cfg = getattr(module, "config", None)
    if cfg is None:
        raise WeightSyncError(f"export_buckets: {type(module).__name__} has no .config (need model_type / tie_word_embeddings)")
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    persistent = set(module.state_dict().keys())
    kept = {n: t for n, t in named_weights if n in persistent}
    return make_buckets(
        kept,
        cfg.model_type,
        bucket_mb,
        tie_word_embeddings=bool(getattr(text_cfg, "tie_word_embeddings", False)),
        dtype=_SYNC_DTYPES[fmt],
    )
