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

What this module does not do: send anything (the rollout worker / dispatcher do), load anything into
an engine (rl/rollout/engine.py), or handle tensor-parallel shards.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Literal, Mapping, Sequence

import numpy as np
import torch

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
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


@dataclass(frozen=True)
class WeightBucket:
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

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    @property
    def num_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)


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
    if fmt not in SYNC_FORMATS:
        raise WeightSyncError(f"sync format {fmt!r} is not supported; use one of {SYNC_FORMATS}")
    if mxfp4_rest not in ("fp32", "bf16"):
        raise WeightSyncError(f"mxfp4_rest must be 'fp32' or 'bf16', got {mxfp4_rest!r}")
    if staging is not None and not copy:
        raise WeightSyncError("make_buckets: a staging area is only used with copy=True")
    sources: dict[str, _Source] = {}
    for name, t in state_dict.items():
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        sources[name] = _encode(name, t, model_type, fmt, mxfp4_rest)
    plan = plan_buckets({n: s.nbytes for n, s in sources.items()}, bucket_mb)
    out = []
    for i, names in enumerate(plan):
        srcs = [sources[n] for n in names]
        out.append(_pack_sources(srcs, copy, None if staging is None else staging.get(i, _bucket_nbytes(srcs))))
    return out


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
    if fmt not in _SYNC_FORMATS_TRAINER:
        raise WeightSyncError(f"sync format {fmt!r} is not supported; use one of {_SYNC_FORMATS_TRAINER}")
    cfg = getattr(module, "config", None)
    if cfg is None:
        raise WeightSyncError(f"export_buckets: {type(module).__name__} has no .config (need model_type / tie_word_embeddings)")
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    persistent = set(module.state_dict().keys())
    kept = {n: t for n, t in named_weights if n in persistent}
    return make_buckets(kept, cfg.model_type, bucket_mb, tie_word_embeddings=bool(getattr(text_cfg, "tie_word_embeddings", False)),
                        fmt=fmt, mxfp4_rest=mxfp4_rest, copy=copy, staging=staging)


def engine_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of an engine dtype string ('float32', 'bfloat16', ...; None/'auto' -> None)."""
    if name in (None, "auto"):
        return None
    return _dtype(str(name))

