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
parameter half-written.

Wire format (why it looks like this): a `WeightBucket` is a few flat uint8 numpy buffers plus a small
index (`TensorEntry`: name, encoding, dtype, shape, byte ranges). Ray serialises numpy buffers out of
band (pickle protocol 5): `ray.put` copies each buffer once into the object store and `ray.get`
returns read-only views of shared memory, so the receiving side builds its tensors with
`torch.frombuffer`, without a copy. The earlier safetensors encoding copied the weights four times
(serialise to bytes, object store, `bytes(...)`, deserialise) into freshly allocated memory, and on
this machine (a Firecracker VM) first-touch page faults make fresh memory ~7x slower to write than
warm memory (docs/rollout.md, "Weight sync formats and speed"). Per-expert checkpoint tensors are
byte ranges of their fused source tensor (one expert's rows of a contiguous [E, R, C] tensor are
contiguous), so splitting experts costs nothing.

Ways to build a bucket:
- `copy=True` (default): one flat buffer per bucket (a snapshot; one gather copy that also casts).
  With a `SyncStaging` the gather goes into buffers reused from the previous sync (warm memory);
  the buckets then alias the staging area until the next export. This is what the trainer actor
  uses: Ray copies one large buffer far faster than many (measured: 140 buffers cost ~5x one).
- `copy=False`: buffers alias the source tensors wherever no cast is needed (no copy here; the copy
  happens in `ray.put`). Only valid while the source is unchanged.

Sync formats (`fmt`): "keep" (as the trainer holds them), "fp32", "bf16", and "mxfp4", which follows
`model.mxfp4_export.pack_for_sync`: expert weights go as OCP MXFP4 blocks + E8M0 scales (4.25 bits
per weight), everything else (routers, norms, embeddings, attention) in `mxfp4_rest` precision. The
receiver dequantizes (`unpack_bucket(..., dequant_dtype=...)`), because vLLM's loaders do not take
MXFP4 for these architectures.

Transports (section "same-node transport" below): `WeightExporter` (trainer side) writes a sync
either as buckets for Ray's object store (the above) or, when every reader is on the trainer's node,
into a double-buffered, versioned /dev/shm area it owns (`ShmSyncArea`), sending only the index
(`ShmBucket`); the worker reads it in place through `ShmReader`. `plan_sync` encodes once, before the
transport is chosen.

What this module does not do: send anything through Ray (the trainer actor, dispatcher and rollout
worker do), load anything into an engine (rl/rollout/engine.py), or handle tensor-parallel shards.
"""
from __future__ import annotations

import fcntl
import math
import mmap
import os
import re
import secrets
import subprocess
import sys
import time
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Literal, Mapping, Sequence

import numpy as np
import torch

from rl.log import get_logger

if TYPE_CHECKING:
    from model.mxfp4_export import SyncBytes

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

SyncFormat = Literal["keep", "fp32", "bf16", "mxfp4"]
SYNC_FORMATS: tuple[str, ...] = ("keep", "fp32", "bf16", "mxfp4")
Encoding = Literal["raw", "mxfp4"]
_ALIGN = 64  # byte alignment of each part inside a flat buffer: any dtype view is aligned, SIMD-friendly
_DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


class WeightSyncError(ValueError):
    """A state dict that cannot be converted, bucketed or decoded; the message names the tensor."""


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPE_NAMES:
        raise WeightSyncError(f"unsupported wire dtype {name!r}; known: {_DTYPE_NAMES}")
    return getattr(torch, name)


def _dtype_name(dt: torch.dtype) -> str:
    name = str(dt).removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise WeightSyncError(f"cannot send a tensor of dtype {name}; supported: {_DTYPE_NAMES}")
    return name


# ----------------------------------------------------------------------------- typed wire records
@dataclass(frozen=True)
class Segment:
    """A byte range of one of a bucket's buffers."""

    buffer: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class TensorEntry:
    """One checkpoint tensor in a bucket.

    encoding "raw": parts = (data,), the tensor's bytes in `dtype`, C order, `shape`.
    encoding "mxfp4": parts = (blocks uint8 [*shape[:-1], G, 16], scales uint8 [*shape[:-1], G]),
    G = shape[-1] / 32 (model/mxfp4.py layout); `dtype` is the dtype the trainer quantized from,
    the default dtype to dequantize to.
    """

    name: str
    encoding: Encoding
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[Segment, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class _EntryTotals:
    """Totals over a bucket's index, shared by `WeightBucket` (buffers in hand) and `ShmBucket` (an
    index into the shared-memory area)."""

    entries: tuple[TensorEntry, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    @property
    def num_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)


@dataclass(frozen=True)
class WeightBucket(_EntryTotals):
    """One shard of a weight sync: flat uint8 buffers plus the index of the tensors they hold.

    Crosses Ray's object store as numpy buffers (zero-copy on the receiving side). `num_bytes` is
    the tensor payload moved (the wire bytes); the index itself is a few hundred bytes per tensor.
    """

    entries: tuple[TensorEntry, ...]
    buffers: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        for i, b in enumerate(self.buffers):
            if not isinstance(b, np.ndarray) or b.dtype != np.uint8 or b.ndim != 1 or not b.flags.c_contiguous:
                raise WeightSyncError(f"WeightBucket buffer {i}: expected a 1-D contiguous uint8 numpy array, got "
                                      f"{type(b).__name__} {getattr(b, 'dtype', '')} {getattr(b, 'shape', '')}")
        for e in self.entries:
            want = 1 if e.encoding == "raw" else 2
            if e.encoding not in ("raw", "mxfp4") or len(e.parts) != want:
                raise WeightSyncError(f"{e.name}: encoding {e.encoding!r} with {len(e.parts)} parts (raw needs 1, mxfp4 2)")
            for p in e.parts:
                if not 0 <= p.buffer < len(self.buffers) or p.offset < 0 or p.offset + p.nbytes > self.buffers[p.buffer].size:
                    raise WeightSyncError(f"{e.name}: segment {p} outside the bucket's buffers")



# ----------------------------------------------------------------------------- naming
def expert_family(model_type: str) -> str:
    return _FAMILY.get(model_type, "qwen2_moe")


def _checkpoint_views(name: str, shape: tuple[int, ...], model_type: str) -> list[tuple[str, tuple]]:
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

    m = _FUSED_RE.match(name)
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
        for ckpt_name, idx in _checkpoint_views(name, tuple(t.shape), model_type):
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


# ----------------------------------------------------------------------------- encoding
@dataclass(frozen=True)
class _Source:
    """One trainer tensor, encoded for the wire: its parts (contiguous) and checkpoint views into them.

    A raw part may still be in the trainer's dtype: the cast to the wire dtype `dtype` happens inside
    the gather copy (no intermediate tensor) or, without a gather, in `_materialise`.
    """

    name: str
    encoding: Encoding
    dtype: str  # raw: wire dtype; mxfp4: the trainer's dtype
    parts: tuple[torch.Tensor, ...]  # raw: (data,); mxfp4: (blocks, scales)
    views: tuple[tuple[str, tuple], ...]  # (checkpoint name, leading-dim index)

    def wire_itemsize(self, k: int) -> int:
        return _dtype(self.dtype).itemsize if self.encoding == "raw" else 1

    def part_bytes(self, k: int) -> int:
        return int(self.parts[k].numel()) * self.wire_itemsize(k)

    @property
    def nbytes(self) -> int:
        return sum(self.part_bytes(k) for k in range(len(self.parts)))


def _encode(name: str, t: torch.Tensor, model_type: str, fmt: str, mxfp4_rest: str) -> _Source:
    t = t.detach()
    views = tuple(_checkpoint_views(name, tuple(t.shape), model_type))  # validates fused shapes first
    if fmt == "mxfp4":
        from model.mxfp4_export import plan_tensor  # lazy: `import model` costs seconds (transformers)

        if plan_tensor(name, t, "experts").quantize:
            from model.mxfp4 import MXFP4Error
            from model.mxfp4_export import pack_for_sync

            try:
                p = pack_for_sync(name, t, "mxfp4", include="experts", fallback=mxfp4_rest)  # type: ignore[arg-type]
            except MXFP4Error as e:  # NaN/Inf weights: a diverged model must not be shipped silently
                raise WeightSyncError(str(e)) from e
            assert p.fmt == "mxfp4" and p.blocks is not None and p.scales is not None
            return _Source(name, "mxfp4", p.dtype, (p.blocks.contiguous(), p.scales.contiguous()), views)
        fmt = mxfp4_rest  # the rest travels like pack_for_sync's fallback
    wire = t.dtype
    if t.is_floating_point() and fmt in ("fp32", "bf16"):
        wire = torch.float32 if fmt == "fp32" else torch.bfloat16
    return _Source(name, "raw", _dtype_name(wire), (t.cpu().contiguous(),), views)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def _segment(part: torch.Tensor, idx: tuple, itemsize: int, buffer: int, base: int) -> Segment:
    """Byte range of part[idx] (in the wire dtype, `itemsize` bytes per element) where `part` starts at byte `base`."""
    v = part[idx] if idx else part
    if not v.is_contiguous():  # cannot happen for leading-dim indices of a contiguous tensor
        raise WeightSyncError(f"internal: view {idx} of a {tuple(part.shape)} tensor is not contiguous")
    return Segment(buffer=buffer, offset=base + (v.storage_offset() - part.storage_offset()) * itemsize, nbytes=int(v.numel()) * itemsize)


def _entry_shape(src: _Source, idx: tuple) -> tuple[int, ...]:
    if src.encoding == "raw":
        p = src.parts[0]
        return tuple((p[idx] if idx else p).shape)
    s = src.parts[1]
    lead_g = tuple((s[idx] if idx else s).shape)
    from model.mxfp4 import BLOCK_SIZE

    return (*lead_g[:-1], lead_g[-1] * BLOCK_SIZE)


class SyncStaging:
    """Reusable gather buffers for `copy=True` exports, one per bucket position, kept across syncs.

    Why: writing into never-touched memory costs a page fault per 4 KiB page; on this machine (a
    Firecracker VM) that makes a fresh buffer several times slower to fill than a reused one
    (docs/rollout.md). Buckets built with a staging area alias it: they stay valid until the next
    export through the same staging (the trainer actor `ray.put`s them at once, which copies).
    """

    def __init__(self) -> None:
        self._bufs: list[np.ndarray] = []

    def get(self, i: int, nbytes: int) -> np.ndarray:
        while len(self._bufs) <= i:
            self._bufs.append(np.empty(0, dtype=np.uint8))
        if self._bufs[i].size < nbytes:
            self._bufs[i] = np.empty(nbytes, dtype=np.uint8)
        return self._bufs[i][:nbytes]

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self._bufs)


def _pack_sources(sources: Sequence[_Source], copy: bool, staging: np.ndarray | None = None) -> WeightBucket:
    entries: list[TensorEntry] = []
    if copy:
        # One flat buffer: every part gathered (and cast to its wire dtype) by one copy.
        bases: list[list[int]] = []
        total = 0
        for src in sources:
            bases.append([])
            for k in range(len(src.parts)):
                bases[-1].append(total)
                total += -(-src.part_bytes(k) // _ALIGN) * _ALIGN
        buf = np.empty(total, dtype=np.uint8) if staging is None else staging[:total]
        if buf.size != total:
            raise WeightSyncError(f"internal: staging buffer of {buf.size} bytes for a {total}-byte bucket")
        flat_u8 = torch.from_numpy(buf)
        for src, bs in zip(sources, bases):
            for k, (p, base) in enumerate(zip(src.parts, bs)):
                if p.numel():
                    wire = _dtype(src.dtype) if src.encoding == "raw" else torch.uint8
                    flat_u8[base:base + src.part_bytes(k)].view(wire).copy_(p.reshape(-1))
        buffers: tuple[np.ndarray, ...] = (buf,)
        for src, bs in zip(sources, bases):
            for ckpt_name, idx in src.views:
                segs = tuple(_segment(p, idx, src.wire_itemsize(k), 0, b) for k, (p, b) in enumerate(zip(src.parts, bs)))
                entries.append(TensorEntry(ckpt_name, src.encoding, src.dtype, _entry_shape(src, idx), segs))
    else:
        # One buffer per part, aliasing the part's memory when no cast is needed: ray.put does the only copy.
        bufs: list[np.ndarray] = []
        for src in sources:
            first = len(bufs)
            for p in src.parts:
                if src.encoding == "raw" and p.dtype != _dtype(src.dtype):
                    p = p.to(_dtype(src.dtype))
                bufs.append(_as_bytes(p))
            for ckpt_name, idx in src.views:
                segs = tuple(_segment(p, idx, src.wire_itemsize(k), first + k, 0) for k, p in enumerate(src.parts))
                entries.append(TensorEntry(ckpt_name, src.encoding, src.dtype, _entry_shape(src, idx), segs))
        buffers = tuple(bufs)
    return WeightBucket(entries=tuple(entries), buffers=buffers)


def _bucket_nbytes(sources: Sequence[_Source]) -> int:
    return sum(-(-s.part_bytes(k) // _ALIGN) * _ALIGN for s in sources for k in range(len(s.parts)))


def pack_bucket(tensors: Mapping[str, torch.Tensor], *, copy: bool = True) -> WeightBucket:
    """Checkpoint-named tensors as one bucket, raw encoding, names and dtypes unchanged."""
    return _pack_sources([_Source(n, "raw", _dtype_name(t.dtype), (t.detach().cpu().contiguous(),), ((n, ()),))
                          for n, t in tensors.items()], copy)


@dataclass(frozen=True)
class SyncPlan:
    """One sync, encoded and bucketed but not yet written anywhere: what both transports start from.

    Encoding (cast decisions, MXFP4 quantisation, checkpoint names) happens once here, so choosing a
    transport after seeing the size costs nothing and a NaN is refused before any buffer is touched.
    """

    buckets: tuple[tuple[_Source, ...], ...]

    @property
    def bucket_nbytes(self) -> tuple[int, ...]:
        """Bytes each bucket takes in a flat buffer (parts 64-byte aligned)."""
        return tuple(_bucket_nbytes(b) for b in self.buckets)

    @property
    def nbytes(self) -> int:
        return sum(self.bucket_nbytes)

    def to_buckets(self, *, copy: bool = True, staging: SyncStaging | None = None) -> list[WeightBucket]:
        """In-process buckets (module docstring: copy / staging semantics)."""
        if staging is not None and not copy:
            raise WeightSyncError("make_buckets: a staging area is only used with copy=True")
        return [_pack_sources(srcs, copy, None if staging is None else staging.get(i, _bucket_nbytes(srcs)))
                for i, srcs in enumerate(self.buckets)]


def plan_sync(
    state_dict: Mapping[str, torch.Tensor],
    model_type: str,
    bucket_mb: float = 64.0,
    *,
    tie_word_embeddings: bool = False,
    fmt: str = "keep",
    mxfp4_rest: str = "fp32",
) -> SyncPlan:
    """Encode a trainer (in-memory) state dict in sync format `fmt` and group it into unit-preserving buckets."""
    if fmt not in SYNC_FORMATS:
        raise WeightSyncError(f"sync format {fmt!r} is not supported; use one of {SYNC_FORMATS}")
    if mxfp4_rest not in ("fp32", "bf16"):
        raise WeightSyncError(f"mxfp4_rest must be 'fp32' or 'bf16', got {mxfp4_rest!r}")
    sources: dict[str, _Source] = {}
    for name, t in state_dict.items():
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        sources[name] = _encode(name, t, model_type, fmt, mxfp4_rest)
    plan = plan_buckets({n: s.nbytes for n, s in sources.items()}, bucket_mb)
    return SyncPlan(buckets=tuple(tuple(sources[n] for n in names) for names in plan))


def make_buckets(
    state_dict: Mapping[str, torch.Tensor],
    model_type: str,
    bucket_mb: float = 64.0,
    *,
    tie_word_embeddings: bool = False,
    fmt: str = "keep",
    mxfp4_rest: str = "fp32",
    copy: bool = True,
    staging: SyncStaging | None = None,
) -> list[WeightBucket]:
    """Trainer (in-memory) state dict -> checkpoint-format, unit-preserving buckets in sync format `fmt`.

    `fmt`: "keep" | "fp32" | "bf16" | "mxfp4" (experts as MXFP4, the rest in `mxfp4_rest`, "fp32" or
    "bf16"). `copy=True`: each bucket is one flat buffer (gathered into `staging` if given, which the
    buckets then alias); `copy=False`: buffers alias `state_dict`'s memory (module docstring).
    """
    plan = plan_sync(state_dict, model_type, bucket_mb, tie_word_embeddings=tie_word_embeddings, fmt=fmt, mxfp4_rest=mxfp4_rest)
    return plan.to_buckets(copy=copy, staging=staging)


def total_bytes(buckets: Iterable[WeightBucket]) -> int:
    return sum(b.num_bytes for b in buckets)


def sync_bytes(buckets: Iterable[WeightBucket]) -> "SyncBytes":
    """Bytes moved by a sync and what the same tensors would cost as bf16 / fp32 (model.mxfp4_export.SyncBytes)."""
    from model.mxfp4_export import SyncBytes

    sent = numel = n = nq = 0
    for b in buckets:
        for e in b.entries:
            sent += e.nbytes
            numel += e.numel
            n += 1
            nq += e.encoding == "mxfp4"
    return SyncBytes(sent=sent, bf16=2 * numel, fp32=4 * numel, n_tensors=n, n_mxfp4=nq)


# ----------------------------------------------------------------------------- decoding
def _u8_view(buf: np.ndarray) -> torch.Tensor:
    # Buffers from ray.get are read-only views of shared memory; torch warns that it cannot mark a
    # tensor read-only. The tensors are only read (vLLM's loader copies them into its parameters).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8) if buf.size else torch.empty(0, dtype=torch.uint8)


def _raw_view(u8: list[torch.Tensor], seg: Segment, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if seg.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return u8[seg.buffer][seg.offset:seg.offset + seg.nbytes].view(dtype).view(shape)


def unpack_bucket(bucket: WeightBucket | bytes, dequant_dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
    """A bucket as (checkpoint name, tensor) pairs, in order.

    Raw tensors are zero-copy views of the bucket's buffers in their wire dtype (read-only when the
    buffers came from Ray: do not write into them). MXFP4 tensors are dequantized to `dequant_dtype`
    (default: the trainer's dtype), consecutive entries of one fused source in a single call.
    `bytes` are read as a safetensors blob (e.g. a bucket saved to disk).
    """
    if isinstance(bucket, (bytes, bytearray, memoryview)):
        from safetensors.torch import load

        loaded = load(bytes(bucket))
        return list(loaded.items())
    if not isinstance(bucket, WeightBucket):
        raise WeightSyncError(f"unpack_bucket: expected a WeightBucket or safetensors bytes, got {type(bucket).__name__}")
    u8 = [_u8_view(b) for b in bucket.buffers]
    out: list[tuple[str, torch.Tensor] | None] = [None] * len(bucket.entries)
    run: list[int] = []  # indices of consecutive mxfp4 entries with adjacent blocks and scales

    def flush() -> None:
        if run:
            _dequantize_run(bucket, u8, run, dequant_dtype, out)
            run.clear()

    for i, e in enumerate(bucket.entries):
        if e.encoding == "raw":
            flush()
            out[i] = (e.name, _raw_view(u8, e.parts[0], _dtype(e.dtype), e.shape))
            continue
        if run:
            p = bucket.entries[run[-1]]
            adjacent = all(a.buffer == b.buffer and a.offset + a.nbytes == b.offset for a, b in zip(p.parts, e.parts))
            if not (adjacent and p.shape[-1] == e.shape[-1] and p.dtype == e.dtype):
                flush()
        run.append(i)
    flush()
    return out  # type: ignore[return-value]


def _dequantize_run(bucket: WeightBucket, u8: list[torch.Tensor], run: list[int], dtype: torch.dtype | None,
                    out: list) -> None:
    """Dequantize entries whose blocks (and scales) are back to back as one [rows, K] matrix, then split rows."""
    from model.mxfp4 import BLOCK_SIZE, MXFP4Error, dequantize_mxfp4

    first = bucket.entries[run[0]]
    k = first.shape[-1]
    if k % BLOCK_SIZE:
        raise WeightSyncError(f"{first.name}: mxfp4 entry with last dim {k}, not a multiple of {BLOCK_SIZE}")
    g = k // BLOCK_SIZE
    rows = [bucket.entries[i].numel // k for i in run]
    bseg, sseg = first.parts
    n_rows = sum(rows)
    if sum(bucket.entries[i].parts[0].nbytes for i in run) != n_rows * g * (BLOCK_SIZE // 2) or \
            sum(bucket.entries[i].parts[1].nbytes for i in run) != n_rows * g:
        raise WeightSyncError(f"{first.name}: mxfp4 blocks/scales sizes do not match shape {first.shape}")
    blocks = u8[bseg.buffer][bseg.offset:bseg.offset + n_rows * g * (BLOCK_SIZE // 2)].view(n_rows, g, BLOCK_SIZE // 2)
    scales = u8[sseg.buffer][sseg.offset:sseg.offset + n_rows * g].view(n_rows, g)
    want = dtype or _dtype(first.dtype)
    try:
        dense = dequantize_mxfp4(blocks, scales, dtype=want)  # [n_rows, K], freshly allocated
    except MXFP4Error as err:
        raise WeightSyncError(f"{first.name}: {err}") from err
    r0 = 0
    for i, r in zip(run, rows):
        e = bucket.entries[i]
        out[i] = (e.name, dense[r0:r0 + r].view(e.shape))
        r0 += r


# ----------------------------------------------------------------------------- trainer entry point
_SYNC_FORMATS_TRAINER = ("fp32", "bf16", "mxfp4")


def _trainer_plan(module: torch.nn.Module, named_weights: Iterable[tuple[str, torch.Tensor]], bucket_mb: float, fmt: str,
                  mxfp4_rest: str) -> SyncPlan:
    if fmt not in _SYNC_FORMATS_TRAINER:
        raise WeightSyncError(f"sync format {fmt!r} is not supported; use one of {_SYNC_FORMATS_TRAINER}")
    cfg = getattr(module, "config", None)
    if cfg is None:
        raise WeightSyncError(f"export_buckets: {type(module).__name__} has no .config (need model_type / tie_word_embeddings)")
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    persistent = set(module.state_dict().keys())
    kept = {n: t for n, t in named_weights if n in persistent}
    return plan_sync(kept, cfg.model_type, bucket_mb, tie_word_embeddings=bool(getattr(text_cfg, "tie_word_embeddings", False)),
                     fmt=fmt, mxfp4_rest=mxfp4_rest)


def export_buckets(
    module: torch.nn.Module,
    named_weights: Iterable[tuple[str, torch.Tensor]],
    bucket_mb: float = 64.0,
    fmt: str = "fp32",
    *,
    copy: bool = True,
    mxfp4_rest: str = "fp32",
    staging: SyncStaging | None = None,
) -> list[WeightBucket]:
    """What a trainer sends to rollout engines: its (gathered, CPU) weights as checkpoint-format buckets.

    `module` supplies the config (model_type, tied embeddings) and the set of persistent names:
    non-persistent buffers (e.g. rotary `inv_freq`) are not part of a checkpoint and are dropped.
    `fmt` = `trainer.sync_format`: "fp32", "bf16" (cast before sending) or "mxfp4" (experts as
    MXFP4, the rest in `mxfp4_rest`; the worker dequantizes to the engine's dtype).
    `copy=False`: buckets alias the weights; `staging`: buckets alias that reused gather area. Either
    way the caller must serialise them (`ray.put`) before the weights change / the next export.
    """
    return _trainer_plan(module, named_weights, bucket_mb, fmt, mxfp4_rest).to_buckets(copy=copy, staging=staging)


def engine_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of an engine dtype string ('float32', 'bfloat16', ...; None/'auto' -> None)."""
    if name in (None, "auto"):
        return None
    return _dtype(str(name))



# ----------------------------------------------------------------------------- same-node transport: shared memory
# Why: through Ray's object store a sync costs one copy into freshly created plasma objects per sync
# (0.36x memcpy for fp32 on `small`, docs/rollout.md). A trainer-owned file in /dev/shm that persists
# across syncs is written warm (one gather copy, the cast fused in) and mapped once by each worker;
# Ray then carries only the index (entries + file + generation + offsets, a few KB).
#
# Consistency (a worker must never read bytes the trainer is rewriting), in three layers:
# 1. Double buffering: sync g goes to slot g % 2, so the trainer writing sync g+1 never touches the
#    slot workers read sync g from.
# 2. Locks: a writer takes flock(LOCK_EX) on the slot file and waits (up to `busy_timeout_s`, then
#    raises) while any reader holds flock(LOCK_SH); a reader takes LOCK_SH without waiting and refuses
#    if the writer holds the slot. The kernel drops the locks of a process that dies.
# 3. A seqlock word in the header: 2g while generation g is complete, 2g+1 while it is being written.
#    The reader checks it equals 2g before building tensors and again after the engine has copied
#    them; anything else (a stale index replayed after the slot moved on, a writer that bypassed the
#    lock) raises `ShmSyncError` naming both generations, never loads silently.
#
# Files are named `jointrl-sync-<pid>-<process start time>-<token>-<slot>`: a file whose owner pid is
# dead, or alive with another start time (pid reuse), is stale and removed when the next area starts.
# Against an owner killed without running Python cleanup (`ray.kill` exits at once, no atexit), each
# area starts a tiny reaper process that blocks on a pipe only the owner holds; when the owner dies,
# the pipe closes and the reaper unlinks the files (mappings already held by workers stay valid).
#
# Not covered: workers on another node (the object-store path is chosen instead), and a dispatcher
# restarting a worker on another node while the last sync went through shm (the replay refuses loudly).
log = get_logger("weights")

SHM_DIR = "/dev/shm"
SHM_PREFIX = "jointrl-sync-"
TRANSPORT_ENV = "JOINTRL_SYNC_TRANSPORT"  # auto | shm | object_store: overrides transport="auto" without a config key
Transport = Literal["auto", "shm", "object_store"]
TRANSPORTS: tuple[str, ...] = ("auto", "shm", "object_store")
_MAGIC = int.from_bytes(b"JRLSYNC1", "little")
_HEADER = 4096  # one page: payloads start page-aligned
_PAGE = 4096
_H_MAGIC, _H_SEQ, _H_PAYLOAD, _H_PID = 0, 1, 2, 3  # uint64 words of the header
_SHM_MARGIN = 64 << 20  # leave this much of /dev/shm free (Ray's object store lives there too)


class ShmSyncError(WeightSyncError):
    """A shared-memory sync that cannot be read or written safely (torn, stale, busy, missing, foreign node)."""


class ShmSpaceError(ShmSyncError):
    """/dev/shm has no room for a slot (the automatic choice then falls back to the object store)."""


@dataclass(frozen=True)
class ShmSlot:
    """Where one sync's bytes live: a slot file on `node_id`, holding generation `generation`."""

    path: str
    node_id: str
    generation: int


@dataclass(frozen=True)
class ShmBucket(_EntryTotals):
    """The index of one bucket in a slot file: what crosses Ray for a shared-memory sync.

    Segments of `entries` are relative to the bucket's own bytes [offset, offset + nbytes) of the
    file (buffer 0), exactly as in a one-buffer `WeightBucket`.
    """

    entries: tuple[TensorEntry, ...]
    slot: ShmSlot
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.offset < _HEADER or self.offset % _PAGE or self.nbytes < 0:
            raise WeightSyncError(f"ShmBucket: offset {self.offset} must be page-aligned past the header, nbytes {self.nbytes} >= 0")
        for e in self.entries:
            for p in e.parts:
                if p.buffer != 0 or p.offset < 0 or p.offset + p.nbytes > self.nbytes:
                    raise WeightSyncError(f"{e.name}: segment {p} outside the bucket's {self.nbytes} bytes")



def _round_page(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def _proc_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22), None if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may contain spaces and ')': fields after the last ')' start at field 3
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def _parse_shm_name(name: str) -> tuple[int, int] | None:
    """(pid, start time) of an area file name `jointrl-sync-<pid>-<start>-<token>-<slot>`, None if not ours."""
    if not name.startswith(SHM_PREFIX):
        return None
    parts = name[len(SHM_PREFIX):].split("-")
    if len(parts) != 4 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def sweep_stale_shm(directory: str = SHM_DIR) -> list[str]:
    """Remove area files whose owner process is gone (dead pid, or a reused pid with another start time)."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        owner = _parse_shm_name(name)
        if owner is None or _proc_start_time(owner[0]) == owner[1]:
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except FileNotFoundError:  # another sweeper got it
            pass
    if removed:
        log.info("removed %d stale weight-sync files in %s: %s", len(removed), directory, removed)
    return removed


# The reaper: blocks on its stdin (a pipe only the owner holds) and, at EOF (owner exited or died),
# removes the owner's files. It is a grandchild in its own session: Ray kills an exiting worker's
# direct children (RAY_kill_child_processes_on_worker_exit, on by default; seen killing a direct-child
# reaper under `ray.kill` in the e2e test), not its grandchildren, and a signal to the owner's
# process group does not reach another session. A launcher (the direct child) starts it and exits.
_REAPER = ("import os,sys\n"
           "sys.stdin.buffer.read()\n"
           "d,p=sys.argv[1],sys.argv[2]\n"
           "for n in os.listdir(d):\n"
           "    if n.startswith(p):\n"
           "        try: os.unlink(os.path.join(d,n))\n"
           "        except FileNotFoundError: pass\n")
_LAUNCHER = ("import subprocess,sys\n"
             "subprocess.Popen([sys.executable,'-c',sys.argv[1]]+sys.argv[2:],stdin=0,stdout=subprocess.DEVNULL,"
             "start_new_session=True,close_fds=True)\n")


def _close_area(paths: list[str], reaper: "subprocess.Popen | None") -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
    if reaper is not None and reaper.stdin is not None:
        try:
            reaper.stdin.close()
            reaper.wait(timeout=10)
        except Exception:  # noqa: BLE001 - interpreter shutdown; the reaper exits at EOF anyway
            pass


@dataclass
class _WriterSlot:
    path: str
    fd: int
    size: int
    mm: mmap.mmap
    u8: np.ndarray  # [size] writable view of the mapping
    hdr: np.ndarray  # [4] uint64 header words


class ShmSyncArea:
    """Trainer-side: a double-buffered, versioned staging area in /dev/shm (see the section comment).

    `write(plan)` gathers (and casts) every bucket of a sync into the next slot and returns the
    `ShmBucket` index; the bytes stay valid until the export after next. `fits(plan)` says whether
    /dev/shm has room. `close()` unlinks the files (also run by a finalizer, and by the reaper if the
    process dies without Python cleanup).
    """

    def __init__(self, node_id: str = "", directory: str = SHM_DIR, *, n_slots: int = 2, busy_timeout_s: float = 60.0,
                 reaper: bool = True) -> None:
        if n_slots < 2:
            raise WeightSyncError(f"ShmSyncArea: n_slots must be >= 2 (double buffering), got {n_slots}")
        if not os.path.isdir(directory):
            raise ShmSyncError(f"ShmSyncArea: {directory} is not a directory")
        sweep_stale_shm(directory)
        pid = os.getpid()
        self.node_id = node_id
        self.directory = directory
        self.busy_timeout_s = busy_timeout_s
        self.prefix = f"{SHM_PREFIX}{pid}-{_proc_start_time(pid) or 0}-{secrets.token_hex(4)}-"
        self.generation = 0
        self._slots: list[_WriterSlot | None] = [None] * n_slots
        self._paths: list[str] = []  # shared with the finalizer: the files to unlink
        self._reaper = None
        if reaper:  # the launcher hands the pipe's read end to the reaper and exits; we keep the write end
            self._reaper = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _REAPER, directory, self.prefix],
                                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True)
            self._reaper.wait(timeout=60)
        self._finalizer = weakref.finalize(self, _close_area, self._paths, self._reaper)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(self._paths)

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self._slots if s is not None)

    def _need(self, plan: SyncPlan) -> int:
        return _HEADER + sum(_round_page(n) for n in plan.bucket_nbytes)

    def fits(self, plan: SyncPlan) -> tuple[bool, str]:
        """Room in /dev/shm for every slot at this plan's size (plus a margin): (ok, why not)."""
        need = self._need(plan)
        grow = sum(max(0, need - (s.size if s is not None else 0)) for s in self._slots)
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        if grow + _SHM_MARGIN > free:
            return False, (f"{self.directory} has {free / 2**20:.0f} MiB free; {len(self._slots)} slots of {need / 2**20:.0f} MiB "
                           f"need {grow / 2**20:.0f} MiB more plus a {_SHM_MARGIN >> 20} MiB margin")
        return True, ""

    def _slot(self, i: int, need: int) -> _WriterSlot:
        s = self._slots[i]
        if s is not None and s.size >= need:
            return s
        new = s is None
        if new:
            path = os.path.join(self.directory, f"{self.prefix}{i}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self._paths.append(path)
        else:  # grow in place (never shrink: a reader's mapping past a shrunk end would SIGBUS)
            path, fd = s.path, s.fd
        try:
            # Allocate now: writing through a mapping into a sparse tmpfs file that runs out of room is a SIGBUS.
            os.posix_fallocate(fd, 0, need)
        except OSError as e:
            if new:  # leave no half-made slot behind; a grown one keeps its old size and content
                os.close(fd)
                os.unlink(path)
                self._paths.remove(path)
            raise ShmSpaceError(f"cannot allocate {need} bytes for {path}: {e}") from e
        mm = mmap.mmap(fd, need, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ | mmap.PROT_WRITE)
        u8 = np.frombuffer(mm, dtype=np.uint8)
        hdr = u8[:32].view(np.uint64)
        if new:
            hdr[_H_PID] = os.getpid()  # for inspection only
            hdr[_H_SEQ] = 1  # "generation 0 being written": nothing readable yet
            hdr[_H_MAGIC] = _MAGIC
        s = _WriterSlot(path=path, fd=fd, size=need, mm=mm, u8=u8, hdr=hdr)  # the old mapping goes with its last view
        self._slots[i] = s
        return s

    def _lock(self, s: _WriterSlot) -> None:
        deadline = time.monotonic() + self.busy_timeout_s
        wait = 1e-4
        while True:
            try:
                fcntl.flock(s.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ShmSyncError(f"{s.path}: still being read after {self.busy_timeout_s:.1f}s (a worker holds generation "
                                       f"{int(s.hdr[_H_SEQ]) // 2}); refusing to overwrite it") from None
                time.sleep(wait)
                wait = min(wait * 2, 0.01)

    def write(self, plan: SyncPlan) -> list[ShmBucket]:
        """Gather one sync into the next slot (one copy, casts fused in); returns the index to send."""
        if self._finalizer is None or not self._finalizer.alive:
            raise ShmSyncError("ShmSyncArea.write after close()")
        g = self.generation + 1
        s = self._slot(g % len(self._slots), self._need(plan))
        self._lock(s)
        try:
            s.hdr[_H_SEQ] = 2 * g + 1  # writing g: readers of the slot's previous generation now refuse
            s.hdr[_H_PAYLOAD] = self._need(plan) - _HEADER
            slot = ShmSlot(path=s.path, node_id=self.node_id, generation=g)
            out: list[ShmBucket] = []
            off = _HEADER
            for srcs, n in zip(plan.buckets, plan.bucket_nbytes):
                wb = _pack_sources(srcs, True, s.u8[off:off + n])
                out.append(ShmBucket(entries=wb.entries, slot=slot, offset=off, nbytes=n))
                off += _round_page(n)
            s.hdr[_H_SEQ] = 2 * g  # complete
            self.generation = g
        finally:
            fcntl.flock(s.fd, fcntl.LOCK_UN)
        return out

    def close(self) -> None:
        """Unlink the slot files and stop the reaper. Workers' existing mappings stay readable."""
        slots, self._slots = self._slots, [None] * len(self._slots)
        for s in slots:
            if s is not None:
                os.close(s.fd)
        del slots
        self._finalizer()


@dataclass
class _ReaderMap:
    fd: int
    size: int
    mm: mmap.mmap
    hdr: np.ndarray  # [4] uint64, read-only view


class ShmReader:
    """Worker-side: maps slot files read-only once (kept across syncs) and reads buckets under the checks."""

    def __init__(self, node_id: str = "") -> None:
        self.node_id = node_id
        self._maps: dict[str, _ReaderMap] = {}

    def _map(self, path: str, need: int) -> _ReaderMap:
        m = self._maps.get(path)
        if m is not None and m.size >= need:
            return m
        if m is not None:  # the trainer grew the file: map it again (the old mapping goes when unused)
            self._maps.pop(path)
            os.close(m.fd)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ShmSyncError(f"{path}: weight-sync file is gone (the trainer closed it or died)") from None
        size = os.fstat(fd).st_size
        if size < need:
            os.close(fd)
            raise ShmSyncError(f"{path}: {size} bytes, the index needs {need}")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
        hdr = np.frombuffer(mm, dtype=np.uint64, count=4)
        if int(hdr[_H_MAGIC]) != _MAGIC:
            os.close(fd)
            raise ShmSyncError(f"{path}: not a weight-sync file (bad header magic)")
        m = _ReaderMap(fd=fd, size=size, mm=mm, hdr=hdr)
        self._maps[path] = m
        return m

    @staticmethod
    def _check(m: _ReaderMap, slot: ShmSlot, when: str) -> None:
        seq = int(m.hdr[_H_SEQ])
        if seq != 2 * slot.generation:
            state = "being written" if seq % 2 else "complete"
            raise ShmSyncError(f"{slot.path}: torn or stale read {when} loading: the index is for generation "
                               f"{slot.generation}, the slot holds generation {seq // 2} ({state})")

    @contextmanager
    def open(self, buckets: Sequence[ShmBucket]) -> Iterator[list[WeightBucket]]:
        """`WeightBucket`s over the mapped bytes (zero copy), valid inside the `with` block only.

        Every slot the buckets live in is locked (shared) for the whole block, so a whole sync is
        read against one generation: the trainer cannot start rewriting between two buckets. Raises
        `ShmSyncError` before yielding if a slot is being rewritten or holds another generation, and
        on exit if one changed meanwhile (the loaded weights must then be discarded).
        """
        slots: dict[str, tuple[ShmSlot, int]] = {}
        for b in buckets:
            if not isinstance(b, ShmBucket):
                raise WeightSyncError(f"ShmReader.open: expected ShmBuckets, got {type(b).__name__}")
            if b.slot.node_id and self.node_id and b.slot.node_id != self.node_id:
                raise ShmSyncError(f"{b.slot.path} lives on node {b.slot.node_id}, this worker is on node {self.node_id}: "
                                   "shared-memory syncs are same-node only (the trainer should have chosen the object store)")
            prev = slots.get(b.slot.path)
            if prev is not None and prev[0] != b.slot:
                raise ShmSyncError(f"{b.slot.path}: one sync's buckets name generations {prev[0].generation} and {b.slot.generation}")
            slots[b.slot.path] = (b.slot, max(prev[1] if prev else 0, b.offset + b.nbytes))
        maps = {path: self._map(path, need) for path, (_, need) in sorted(slots.items())}
        locked: list[_ReaderMap] = []
        try:
            for path, m in maps.items():
                try:
                    fcntl.flock(m.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise ShmSyncError(f"{path}: the trainer is rewriting this slot; generation "
                                       f"{slots[path][0].generation} is gone") from None
                locked.append(m)
                self._check(m, slots[path][0], "before")
            yield [WeightBucket(entries=b.entries, buffers=(np.frombuffer(maps[b.slot.path].mm, dtype=np.uint8, count=b.nbytes,
                                                                            offset=b.offset),)) for b in buckets]
            for path, m in maps.items():
                self._check(m, slots[path][0], "after")
        finally:
            for m in locked:
                fcntl.flock(m.fd, fcntl.LOCK_UN)

    @contextmanager
    def read(self, bucket: ShmBucket) -> Iterator[WeightBucket]:
        """One bucket: `open([bucket])`."""
        with self.open([bucket]) as (wb,):
            yield wb

    def close(self) -> None:
        maps, self._maps = self._maps, {}
        for m in maps.values():
            os.close(m.fd)


# ----------------------------------------------------------------------------- choosing the transport
def requested_transport(transport: str = "auto") -> str:
    """The transport asked for: an explicit "shm" / "object_store" wins; "auto" yields to $JOINTRL_SYNC_TRANSPORT."""
    if transport not in TRANSPORTS:
        raise WeightSyncError(f"sync transport {transport!r} is not supported; use one of {TRANSPORTS}")
    if transport == "auto":
        env = os.environ.get(TRANSPORT_ENV, "").strip() or "auto"
        if env not in TRANSPORTS:
            raise WeightSyncError(f"${TRANSPORT_ENV}={env!r} is not a sync transport; use one of {TRANSPORTS}")
        return env
    return transport


def local_node_id() -> str:
    """This process's Ray node id, or "" outside Ray (then every reader counts as local)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - no Ray, or no runtime context: not a cluster process
        return ""


class WeightExporter:
    """Trainer-side: one object per trainer process, exporting each sync over shm or the object store.

    `export(...)` returns `ShmBucket`s (index only; the bytes are in this process's `ShmSyncArea`)
    or `WeightBucket`s that alias the weights / a reused staging area (the caller must `ray.put`
    them before the next export or weight change). With transport "auto" shm is chosen when every
    reader is on this node and /dev/shm has room; otherwise the object store, and the reason is
    logged when the choice changes. `last_transport` / `last_reason` say what the last export did.
    """

    def __init__(self, node_id: str | None = None, shm_dir: str = SHM_DIR, busy_timeout_s: float = 60.0) -> None:
        self.node_id = local_node_id() if node_id is None else node_id
        self.shm_dir = shm_dir
        self.busy_timeout_s = busy_timeout_s
        self.area: ShmSyncArea | None = None
        self.staging = SyncStaging()
        self.last_transport = ""
        self.last_reason = ""

    def _choose(self, requested: str, plan: SyncPlan, reader_nodes: Sequence[str]) -> tuple[str, str]:
        if requested == "object_store":
            return "object_store", "requested"
        foreign = sorted({n for n in reader_nodes if n and self.node_id and n != self.node_id})
        if requested == "auto" and not reader_nodes:
            return "object_store", "reader nodes unknown"
        if foreign:
            why = f"readers on other nodes {foreign} (trainer on {self.node_id})"
            if requested == "shm":
                raise ShmSyncError(f"shared-memory sync forced but {why}")
            return "object_store", why
        if not os.path.isdir(self.shm_dir):
            if requested == "shm":
                raise ShmSyncError(f"shared-memory sync forced but {self.shm_dir} does not exist")
            return "object_store", f"{self.shm_dir} does not exist"
        if self.area is None:
            self.area = ShmSyncArea(self.node_id, self.shm_dir, busy_timeout_s=self.busy_timeout_s)
        ok, why = self.area.fits(plan)
        if not ok:
            if requested == "shm":
                raise ShmSyncError(f"shared-memory sync forced but {why}")
            return "object_store", why
        return "shm", "all readers on this node" if requested == "auto" else "requested"

    def _log_choice(self, how: str, why: str, nbytes: int) -> None:
        if (how, why) != (self.last_transport, self.last_reason):
            fallback = how == "object_store" and why != "requested"
            (log.warning if fallback else log.info)("weight sync transport: %s (%s), %.1f MB per sync", how, why, nbytes / 1e6)
        self.last_transport, self.last_reason = how, why

    def export(self, module: torch.nn.Module, named_weights: Iterable[tuple[str, torch.Tensor]], bucket_mb: float = 64.0,
               fmt: str = "fp32", *, transport: str = "auto", reader_nodes: Sequence[str] = (),
               mxfp4_rest: str = "fp32") -> list[ShmBucket] | list[WeightBucket]:
        plan = _trainer_plan(module, named_weights, bucket_mb, fmt, mxfp4_rest)
        requested = requested_transport(transport)
        how, why = self._choose(requested, plan, reader_nodes)
        if how == "shm":
            assert self.area is not None
            try:
                out = self.area.write(plan)
            except ShmSpaceError as e:  # /dev/shm filled up between the check and the allocation
                if requested == "shm":
                    raise
                how, why = "object_store", str(e)
        self._log_choice(how, why, plan.nbytes)
        if how == "shm":
            return out
        if fmt == "fp32":  # buckets alias the weights: ray.put is the only copy
            return plan.to_buckets(copy=False)
        return plan.to_buckets(copy=True, staging=self.staging)  # cast / encode into warm, reused memory

    def close(self) -> None:
        if self.area is not None:
            self.area.close()
            self.area = None
