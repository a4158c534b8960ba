"""A trainer's tensors encoded for a sync: the layout (cacheable), the plan (layout + this sync's tensors), buckets.

`plan_sync` turns a trainer (in-memory) state dict into a `SyncPlan` in sync format `fmt`:
"keep" (as the trainer holds them), "fp32", "bf16", or "mxfp4", which follows
`model.mxfp4_export.pack_for_sync`: expert weights go as OCP MXFP4 blocks + E8M0 scales (4.25 bits
per weight), everything else (routers, norms, embeddings, attention) in `mxfp4_rest` precision.
NaN/Inf experts are refused here, before any buffer is touched.

A plan is two things. The `SyncLayout` is everything that depends only on names, shapes and dtypes:
checkpoint names, encodings, wire dtypes, bucket boundaries, every part's offset in a flat bucket
buffer and the ready-built bucket indexes (`TensorEntry`s and their wire blob). It is keyed on the
(name, shape, dtype) signature of the state plus the format arguments (`layout_key`); pass the
previous plan's layout as `reuse` and it is kept when the key matches and rebuilt otherwise. The
parts are this sync's tensors (raw parts still in the trainer's dtype: the cast happens inside the
gather copy; MXFP4 parts encoded now, the codec runs every sync).

Ways to build buckets from a plan (`SyncPlan.to_buckets`):
- `copy=True` (default): one flat buffer per bucket (a snapshot; one gather copy that also casts).
  With a `SyncStaging` the gather goes into buffers reused from the previous sync (warm memory; the
  gather targets are cached with them); the buckets then alias the staging area until the next
  export. Ray copies one large buffer far faster than many (measured: 140 buffers cost ~5x one).
- `copy=False`: buffers alias the source tensors wherever no cast is needed (no copy here; the copy
  happens in `ray.put`). Only valid while the source is unchanged.

What this module does not do: read a trainer module (exporter.py), choose or run a transport
(exporter.py, shm.py), or decode (wire.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import numpy as np
import torch

from rl.weights.errors import WeightSyncError
from rl.weights.names import checkpoint_views, plan_buckets
from rl.weights.wire import (Encoding, Segment, TensorEntry, WeightBucket, aligned, dtype_name, entries_to_wire, intern_entries,
                             wire_dtype)

SyncFormat = Literal["keep", "fp32", "bf16", "mxfp4"]
SYNC_FORMATS: tuple[str, ...] = ("keep", "fp32", "bf16", "mxfp4")


# ----------------------------------------------------------------------------- the layout (depends on names, shapes, dtypes only)
@dataclass(frozen=True)
class SourceLayout:
    """One trainer tensor on the wire: its encoding, its parts' shapes and its checkpoint views into them."""

    name: str
    encoding: Encoding
    dtype: str  # raw: wire dtype; mxfp4: the trainer's dtype
    part_shapes: tuple[tuple[int, ...], ...]  # raw: (shape,); mxfp4: (blocks, scales) shapes
    views: tuple[tuple[str, tuple], ...]  # (checkpoint name, leading-dim index)

    def part_wire(self, k: int) -> torch.dtype:
        return wire_dtype(self.dtype) if self.encoding == "raw" else torch.uint8

    def part_bytes(self, k: int) -> int:
        return math.prod(self.part_shapes[k]) * self.part_wire(k).itemsize

    @property
    def nbytes(self) -> int:
        return sum(self.part_bytes(k) for k in range(len(self.part_shapes)))


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: which sources, where each part starts in the flat buffer, and the built indexes."""

    sources: tuple[int, ...]  # indices into SyncLayout.sources
    bases: tuple[tuple[int, ...], ...]  # per source, per part: byte offset in the flat buffer (64-byte aligned)
    nbytes: int  # flat buffer size
    entries: tuple[TensorEntry, ...]  # index of the one-buffer bucket
    alias_entries: tuple[TensorEntry, ...]  # index of the one-buffer-per-part bucket (copy=False)
    wire: bytes = field(repr=False)  # entries_to_wire(entries)
    alias_wire: bytes = field(repr=False)


@dataclass(frozen=True)
class SyncLayout:
    """Everything about a sync that does not change while names, shapes and dtypes do not (module docstring)."""

    key: tuple
    sources: tuple[SourceLayout, ...]
    buckets: tuple[BucketLayout, ...]

    @property
    def bucket_nbytes(self) -> tuple[int, ...]:
        return tuple(b.nbytes for b in self.buckets)


def layout_key(state_dict: Mapping[str, torch.Tensor], model_type: str, bucket_mb: float, fmt: str, mxfp4_rest: str) -> tuple:
    """What a layout depends on: the (name, shape, dtype) signature of the state and the format arguments."""
    return (model_type, float(bucket_mb), fmt, mxfp4_rest, tuple((n, t.shape, t.dtype) for n, t in state_dict.items()))


def _view_segment(shape: tuple[int, ...], idx: tuple, itemsize: int, buffer: int, base: int) -> tuple[Segment, tuple[int, ...]]:
    """Byte range and shape of part[idx] for a contiguous part of `shape` starting at byte `base`.

    `idx` is what `checkpoint_views` produces: (), (e,) or (e, slice(a, b)) over the leading dims,
    so the view is contiguous and its offset is arithmetic.
    """
    if not idx:
        offset, vshape = 0, tuple(shape)
    elif len(idx) == 1 and isinstance(idx[0], int) and len(shape) >= 1:
        offset, vshape = idx[0] * math.prod(shape[1:]), tuple(shape[1:])
    elif (len(idx) == 2 and isinstance(idx[0], int) and isinstance(idx[1], slice) and idx[1].step in (None, 1)
          and len(shape) >= 2 and 0 <= idx[1].start <= idx[1].stop <= shape[1]):
        a, b = idx[1].start, idx[1].stop
        offset, vshape = idx[0] * math.prod(shape[1:]) + a * math.prod(shape[2:]), (b - a, *shape[2:])
    else:
        raise WeightSyncError(f"internal: view {idx} of a {shape} tensor is not a leading-dim index")
    if idx and not 0 <= idx[0] < shape[0]:
        raise WeightSyncError(f"internal: view {idx} of a {shape} tensor is out of range")
    return Segment(buffer=buffer, offset=base + offset * itemsize, nbytes=math.prod(vshape) * itemsize), vshape


def _entries(srcs: Sequence[SourceLayout], bases: Sequence[Sequence[int]] | None) -> tuple[TensorEntry, ...]:
    """The index of a bucket: flat (`bases` given: buffer 0 at those offsets) or one buffer per part."""
    out: list[TensorEntry] = []
    buf = 0
    for j, src in enumerate(srcs):
        for ckpt_name, idx in src.views:
            segs, shapes = [], []
            for k, shape in enumerate(src.part_shapes):
                b, base = (0, bases[j][k]) if bases is not None else (buf + k, 0)
                seg, vshape = _view_segment(shape, idx, src.part_wire(k).itemsize, b, base)
                segs.append(seg)
                shapes.append(vshape)
            if src.encoding == "raw":
                shape = shapes[0]
            else:  # the scales' shape [.., G] gives the tensor's [.., G * 32]
                from model.mxfp4 import BLOCK_SIZE

                shape = (*shapes[1][:-1], shapes[1][-1] * BLOCK_SIZE)
            out.append(TensorEntry(ckpt_name, src.encoding, src.dtype, shape, tuple(segs)))
        buf += len(src.part_shapes)
    return tuple(out)


def _wire(entries: tuple[TensorEntry, ...]) -> tuple[tuple[TensorEntry, ...], bytes]:
    """The index and its blob, interned: a reader in this process (and a rebuilt equal layout) gets the same objects."""
    blob = entries_to_wire(entries)
    return intern_entries(blob, entries), blob


def build_layout(key: tuple, sources: Sequence[SourceLayout], bucket_mb: float | None) -> SyncLayout:
    """Bucket boundaries (`plan_buckets`; `bucket_mb=None`: everything in one bucket), offsets and indexes."""
    index = {s.name: i for i, s in enumerate(sources)}
    groups = plan_buckets({s.name: s.nbytes for s in sources}, bucket_mb) if bucket_mb is not None else [[s.name for s in sources]]
    buckets = []
    for names in groups:
        srcs = [sources[index[n]] for n in names]
        bases, total = [], 0
        for s in srcs:
            bases.append([])
            for k in range(len(s.part_shapes)):
                bases[-1].append(total)
                total += aligned(s.part_bytes(k))
        (flat, flat_wire), (alias, alias_wire) = _wire(_entries(srcs, bases)), _wire(_entries(srcs, None))
        buckets.append(BucketLayout(sources=tuple(index[n] for n in names), bases=tuple(map(tuple, bases)), nbytes=total,
                                    entries=flat, alias_entries=alias, wire=flat_wire, alias_wire=alias_wire))
    return SyncLayout(key=key, sources=tuple(sources), buckets=tuple(buckets))


# ----------------------------------------------------------------------------- encoding one tensor
def _encode(name: str, t: torch.Tensor, model_type: str, fmt: str, mxfp4_rest: str) -> tuple[SourceLayout, tuple[torch.Tensor, ...]]:
    """First encoding of a tensor: decides its encoding and wire dtype (the layout) and returns its parts."""
    t = t.detach()
    views = tuple(checkpoint_views(name, tuple(t.shape), model_type))  # validates fused shapes first
    if fmt == "mxfp4":
        from model.mxfp4_export import plan_tensor  # lazy: `import model` costs seconds (transformers)

        if plan_tensor(name, t, "experts").quantize:
            parts, dt = _quantize(name, t, mxfp4_rest)
            return SourceLayout(name, "mxfp4", dt, tuple(tuple(p.shape) for p in parts), views), parts
        fmt = mxfp4_rest  # the rest travels like pack_for_sync's fallback
    wire = t.dtype
    if t.is_floating_point() and fmt in ("fp32", "bf16"):
        wire = torch.float32 if fmt == "fp32" else torch.bfloat16
    t = t.cpu()
    return SourceLayout(name, "raw", dtype_name(wire), (tuple(t.shape),), views), (t,)


def _quantize(name: str, t: torch.Tensor, mxfp4_rest: str) -> tuple[tuple[torch.Tensor, torch.Tensor], str]:
    from model.mxfp4 import MXFP4Error
    from model.mxfp4_export import pack_for_sync

    try:
        p = pack_for_sync(name, t, "mxfp4", include="experts", fallback=mxfp4_rest)  # type: ignore[arg-type]
    except MXFP4Error as e:  # NaN/Inf weights: a diverged model must not be shipped silently
        raise WeightSyncError(str(e)) from e
    assert p.fmt == "mxfp4" and p.blocks is not None and p.scales is not None
    return (p.blocks.contiguous(), p.scales.contiguous()), p.dtype


def _encode_again(src: SourceLayout, t: torch.Tensor, mxfp4_rest: str) -> tuple[torch.Tensor, ...]:
    """This sync's parts of a tensor whose layout is known (same name, shape and dtype as when it was built)."""
    if t.requires_grad:
        t = t.detach()
    if src.encoding == "mxfp4":
        return _quantize(src.name, t, mxfp4_rest)[0]
    return (t if t.is_cpu else t.cpu(),)


# ----------------------------------------------------------------------------- the plan and its buckets
def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


Targets = list  # [(source index, part index, destination tensor shaped like the part)]


def gather_targets(layout: SyncLayout, bucket: BucketLayout, buf: np.ndarray) -> Targets:
    """Destination views for gathering `bucket` into the flat buffer `buf` (build once per buffer, reuse every sync)."""
    if buf.size != bucket.nbytes:
        raise WeightSyncError(f"internal: a {buf.size}-byte buffer for a {bucket.nbytes}-byte bucket")
    flat = torch.from_numpy(buf)
    out = []
    for si, bases in zip(bucket.sources, bucket.bases):
        src = layout.sources[si]
        for k, base in enumerate(bases):
            n = src.part_bytes(k)
            if n:
                out.append((si, k, flat[base:base + n].view(src.part_wire(k)).view(src.part_shapes[k])))
    return out


class SyncStaging:
    """Reusable gather buffers for `copy=True` exports, one per bucket position, kept across syncs.

    Why: writing into never-touched memory costs a page fault per 4 KiB page; on this machine (a
    Firecracker VM) that makes a fresh buffer several times slower to fill than a reused one
    (docs/rollout.md). Buckets built with a staging area alias it: they stay valid until the next
    export through the same staging (the trainer actor `ray.put`s them at once, which copies).
    """

    def __init__(self) -> None:
        self._bufs: list[np.ndarray] = []
        self._targets: dict[int, tuple[BucketLayout, np.ndarray, Targets]] = {}

    def get(self, i: int, nbytes: int) -> np.ndarray:
        while len(self._bufs) <= i:
            self._bufs.append(np.empty(0, dtype=np.uint8))
        if self._bufs[i].size < nbytes:
            self._bufs[i] = np.empty(nbytes, dtype=np.uint8)
        return self._bufs[i][:nbytes]

    def targets(self, i: int, layout: SyncLayout) -> tuple[np.ndarray, Targets]:
        """Bucket `i`'s buffer and its gather targets, cached while the layout and the buffer stay the same."""
        bucket = layout.buckets[i]
        buf = self.get(i, bucket.nbytes)
        hit = self._targets.get(i)
        if hit is None or hit[0] is not bucket or hit[1] is not self._bufs[i]:
            hit = (bucket, self._bufs[i], gather_targets(layout, bucket, buf))
            self._targets[i] = hit
        return buf, hit[2]

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self._bufs)


@dataclass(frozen=True)
class SyncPlan:
    """One sync, encoded and bucketed but not yet written anywhere: what both transports start from."""

    layout: SyncLayout
    parts: tuple[tuple[torch.Tensor, ...], ...]  # per layout source

    @property
    def bucket_nbytes(self) -> tuple[int, ...]:
        """Bytes each bucket takes in a flat buffer (parts 64-byte aligned)."""
        return self.layout.bucket_nbytes

    @property
    def nbytes(self) -> int:
        return sum(self.bucket_nbytes)

    def gather(self, targets: Targets) -> None:
        """Copy (and cast) this sync's parts into prepared destination views: the only per-tensor work of a write."""
        parts = self.parts
        for si, k, dst in targets:
            dst.copy_(parts[si][k])

    def to_buckets(self, *, copy: bool = True, staging: SyncStaging | None = None) -> list[WeightBucket]:
        """In-process buckets (module docstring: copy / staging semantics)."""
        if staging is not None and not copy:
            raise WeightSyncError("make_buckets: a staging area is only used with copy=True")
        out = []
        for i, bl in enumerate(self.layout.buckets):
            if copy:
                if staging is None:
                    buf = np.empty(bl.nbytes, dtype=np.uint8)
                    targets = gather_targets(self.layout, bl, buf)
                else:
                    buf, targets = staging.targets(i, self.layout)
                self.gather(targets)
                wb = WeightBucket(entries=bl.entries, buffers=(buf,))
                wb._set_wire_index(bl.wire)
            else:  # one buffer per part, aliasing the part's memory when no cast is needed: ray.put does the only copy
                bufs = []
                for si in bl.sources:
                    src = self.layout.sources[si]
                    for k, p in enumerate(self.parts[si]):
                        bufs.append(_as_bytes(p.to(src.part_wire(k)).contiguous()))
                wb = WeightBucket(entries=bl.alias_entries, buffers=tuple(bufs))
                wb._set_wire_index(bl.alias_wire)
            out.append(wb)
        return out


def plan_sync(
    state_dict: Mapping[str, torch.Tensor],
    model_type: str,
    bucket_mb: float = 64.0,
    *,
    tie_word_embeddings: bool = False,
    fmt: str = "keep",
    mxfp4_rest: str = "fp32",
    reuse: SyncLayout | None = None,
) -> SyncPlan:
    """Encode a trainer (in-memory) state dict in sync format `fmt` and group it into unit-preserving buckets.

    `reuse`: a previous plan's layout, kept if `layout_key` matches (only the tensors are encoded
    then), rebuilt otherwise; the returned plan's `.layout` is what to pass next time.
    """
    if fmt not in SYNC_FORMATS:
        raise WeightSyncError(f"sync format {fmt!r} is not supported; use one of {SYNC_FORMATS}")
    if mxfp4_rest not in ("fp32", "bf16"):
        raise WeightSyncError(f"mxfp4_rest must be 'fp32' or 'bf16', got {mxfp4_rest!r}")
    if tie_word_embeddings and "lm_head.weight" in state_dict:
        state_dict = {n: t for n, t in state_dict.items() if n != "lm_head.weight"}
    key = layout_key(state_dict, model_type, bucket_mb, fmt, mxfp4_rest)
    if reuse is not None and reuse.key == key:
        parts = tuple(_encode_again(src, t, mxfp4_rest) for src, t in zip(reuse.sources, state_dict.values()))
        return SyncPlan(layout=reuse, parts=parts)
    sources, parts = [], []
    for name, t in state_dict.items():
        s, p = _encode(name, t, model_type, fmt, mxfp4_rest)
        sources.append(s)
        parts.append(p)
    return SyncPlan(layout=build_layout(key, sources, bucket_mb), parts=tuple(parts))


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


def pack_bucket(tensors: Mapping[str, torch.Tensor], *, copy: bool = True) -> WeightBucket:
    """Checkpoint-named tensors as one bucket, raw encoding, names and dtypes unchanged."""
    srcs, parts = [], []
    for n, t in tensors.items():
        t = t.detach().cpu()
        srcs.append(SourceLayout(n, "raw", dtype_name(t.dtype), (tuple(t.shape),), ((n, ()),)))
        parts.append((t,))
    (b,) = SyncPlan(layout=build_layout(("pack_bucket",), srcs, None), parts=tuple(parts)).to_buckets(copy=copy)
    return b
