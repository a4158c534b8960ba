"""The wire format of a weight sync: flat zero-copy buckets, their index, and decoding them.

A `WeightBucket` is a few flat uint8 numpy buffers plus a small index (`TensorEntry`: checkpoint
name, encoding, dtype, shape, byte ranges). Ray serialises numpy buffers out of band (pickle
protocol 5): `ray.put` copies each buffer once into the object store and `ray.get` returns
read-only views of shared memory, so `unpack_bucket` builds the tensors with `torch.frombuffer`,
without a copy. Encodings: "raw" (the tensor's bytes in its wire dtype: fp32, bf16, ...) and
"mxfp4" (OCP MXFP4 blocks + E8M0 scales, dequantized here because vLLM's loaders do not take MXFP4
for these architectures).

The index pickles as one bytes blob (`entries_to_wire`) and is interned on arrival
(`entries_from_wire`): the same layout arriving again (shapes do not change between syncs) comes
back as the same tuple of entries, without rebuilding hundreds of records. A bucket remembers how
it decodes, so unpacking the same bucket object again (a shared-memory reader keeps its buckets
across syncs) rebuilds no views; MXFP4 entries are dequantized on every call.

What this module does not do: decide names or buckets (names.py), encode a trainer's tensors
(encode.py), or move bytes between processes (Ray, shm.py).
"""
from __future__ import annotations

import math
import pickle
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Literal

import numpy as np
import torch

from rl.weights.errors import WeightSyncError

if TYPE_CHECKING:
    from model.mxfp4_export import SyncBytes

Encoding = Literal["raw", "mxfp4"]
ALIGN = 64  # byte alignment of each part inside a flat buffer: any dtype view is aligned, SIMD-friendly
_DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


def wire_dtype(name: str) -> torch.dtype:
    if name not in _DTYPE_NAMES:
        raise WeightSyncError(f"unsupported wire dtype {name!r}; known: {_DTYPE_NAMES}")
    return getattr(torch, name)


def dtype_name(dt: torch.dtype) -> str:
    name = str(dt).removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise WeightSyncError(f"cannot send a tensor of dtype {name}; supported: {_DTYPE_NAMES}")
    return name


def engine_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of an engine dtype string ('float32', 'bfloat16', ...; None/'auto' -> None)."""
    if name in (None, "auto"):
        return None
    return wire_dtype(str(name))


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


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


# ----------------------------------------------------------------------------- the index on the wire
_INTERN_MAX = 1024  # distinct bucket indexes remembered per process (a run repeats the same few every sync)
_interned: dict[bytes, tuple[TensorEntry, ...]] = {}
_intern_lock = threading.Lock()


def entries_to_wire(entries: tuple[TensorEntry, ...]) -> bytes:
    """A bucket's index as one bytes blob (plain tuples, pickled): cheap to send, cheap to compare."""
    return pickle.dumps(tuple((e.name, e.encoding, e.dtype, e.shape, tuple((p.buffer, p.offset, p.nbytes) for p in e.parts))
                              for e in entries), protocol=5)


def entries_from_wire(blob: bytes) -> tuple[TensorEntry, ...]:
    """The entries of a blob, interned: the same blob yields the same tuple object (while it is among
    the last `_INTERN_MAX` distinct indexes seen; older ones are decoded again)."""
    with _intern_lock:
        hit = _interned.pop(blob, None)
        if hit is not None:
            _interned[blob] = hit  # most recently used last
            return hit
    entries = tuple(TensorEntry(n, enc, dt, tuple(shape), tuple(Segment(*p) for p in parts))
                    for n, enc, dt, shape, parts in pickle.loads(blob))
    return intern_entries(blob, entries)


def intern_entries(blob: bytes, entries: tuple[TensorEntry, ...]) -> tuple[TensorEntry, ...]:
    """Register `entries` as what `blob` decodes to (the writer does this for the indexes it builds)."""
    with _intern_lock:
        entries = _interned.setdefault(blob, entries)
        while len(_interned) > _INTERN_MAX:
            _interned.pop(next(iter(_interned)))
    return entries


_ends_memo: dict[int, tuple[tuple[TensorEntry, ...], dict[int, int] | None]] = {}


def _check_parts(e: TensorEntry) -> None:
    want = 1 if e.encoding == "raw" else 2
    if e.encoding not in ("raw", "mxfp4") or len(e.parts) != want:
        raise WeightSyncError(f"{e.name}: encoding {e.encoding!r} with {len(e.parts)} parts (raw needs 1, mxfp4 2)")


def segment_ends(entries: tuple[TensorEntry, ...]) -> dict[int, int] | None:
    """Per buffer index, where its furthest segment ends; None if an entry is malformed (bad encoding or
    part count, negative buffer or offset). Remembered per entries tuple: a cached layout is checked once."""
    hit = _ends_memo.get(id(entries))
    if hit is not None and hit[0] is entries:
        return hit[1]
    ends: dict[int, int] | None = {}
    for e in entries:
        want = 1 if e.encoding == "raw" else 2
        if e.encoding not in ("raw", "mxfp4") or len(e.parts) != want:
            ends = None
            break
        for p in e.parts:
            if p.buffer < 0 or p.offset < 0:
                ends = None
                break
            ends[p.buffer] = max(ends.get(p.buffer, 0), p.offset + p.nbytes)
        if ends is None:
            break
    with _intern_lock:
        _ends_memo[id(entries)] = (entries, ends)
        while len(_ends_memo) > _INTERN_MAX:
            _ends_memo.pop(next(iter(_ends_memo)))
    return ends


class _EntryTotals:
    """Totals over a bucket's index, shared by `WeightBucket` (buffers in hand) and `ShmBucket` (an
    index into the shared-memory area); and the index's wire blob, computed once per object."""

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

    def wire_index(self) -> bytes:
        blob = self.__dict__.get("_wire")
        if blob is None:
            blob = entries_to_wire(self.entries)
            object.__setattr__(self, "_wire", blob)
        return blob

    def _set_wire_index(self, blob: bytes) -> None:
        object.__setattr__(self, "_wire", blob)


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
        ends = segment_ends(self.entries)
        if ends is not None and all(0 <= i < len(self.buffers) and end <= self.buffers[i].size for i, end in ends.items()):
            return
        sizes = [b.size for b in self.buffers]
        for e in self.entries:  # something is wrong: find it and name it
            _check_parts(e)
            for p in e.parts:
                if not 0 <= p.buffer < len(sizes) or p.offset < 0 or p.offset + p.nbytes > sizes[p.buffer]:
                    raise WeightSyncError(f"{e.name}: segment {p} outside the bucket's buffers")

    def __reduce__(self):
        return _weight_bucket_from_wire, (self.wire_index(), self.buffers)


def _weight_bucket_from_wire(blob: bytes, buffers: tuple[np.ndarray, ...]) -> WeightBucket:
    b = WeightBucket(entries=entries_from_wire(blob), buffers=tuple(buffers))
    b._set_wire_index(blob)
    return b


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


@dataclass(frozen=True)
class _Decoder:
    """How one bucket decodes: the raw tensors (views, built once) and the runs of MXFP4 entries to dequantize."""

    u8: list[torch.Tensor]
    pairs: list  # (name, tensor) for raw entries, None where an MXFP4 run fills in
    runs: list[list[int]]


def _decoder(bucket: WeightBucket) -> _Decoder:
    u8 = [_u8_view(b) for b in bucket.buffers]
    pairs: list = [None] * len(bucket.entries)
    runs: list[list[int]] = []
    run: list[int] = []  # indices of consecutive mxfp4 entries with adjacent blocks and scales
    for i, e in enumerate(bucket.entries):
        if e.encoding == "raw":
            if run:
                runs.append(run)
                run = []
            pairs[i] = (e.name, _raw_view(u8, e.parts[0], wire_dtype(e.dtype), e.shape))
            continue
        if run:
            p = bucket.entries[run[-1]]
            adjacent = all(a.buffer == b.buffer and a.offset + a.nbytes == b.offset for a, b in zip(p.parts, e.parts))
            if not (adjacent and p.shape[-1] == e.shape[-1] and p.dtype == e.dtype):
                runs.append(run)
                run = []
        run.append(i)
    if run:
        runs.append(run)
    return _Decoder(u8=u8, pairs=pairs, runs=runs)


def unpack_bucket(bucket: WeightBucket | bytes, dequant_dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
    """A bucket as (checkpoint name, tensor) pairs, in order.

    Raw tensors are zero-copy views of the bucket's buffers in their wire dtype (read-only when the
    buffers came from Ray: do not write into them); the same bucket object yields the same views
    on every call. MXFP4 tensors are dequantized to `dequant_dtype` (default: the trainer's dtype),
    consecutive entries of one fused source in a single call, fresh on every call.
    `bytes` are read as a safetensors blob (e.g. a bucket saved to disk).
    """
    if isinstance(bucket, (bytes, bytearray, memoryview)):
        from safetensors.torch import load

        loaded = load(bytes(bucket))
        return list(loaded.items())
    if not isinstance(bucket, WeightBucket):
        raise WeightSyncError(f"unpack_bucket: expected a WeightBucket or safetensors bytes, got {type(bucket).__name__}")
    dec = bucket.__dict__.get("_decoder")
    if dec is None:
        dec = _decoder(bucket)
        object.__setattr__(bucket, "_decoder", dec)
    out = list(dec.pairs)
    for run in dec.runs:
        _dequantize_run(bucket, dec.u8, run, dequant_dtype, out)
    return out


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
    want = dtype or wire_dtype(first.dtype)
    try:
        dense = dequantize_mxfp4(blocks, scales, dtype=want)  # [n_rows, K], freshly allocated
    except MXFP4Error as err:
        raise WeightSyncError(f"{first.name}: {err}") from err
    r0 = 0
    for i, r in zip(run, rows):
        e = bucket.entries[i]
        out[i] = (e.name, dense[r0:r0 + r].view(e.shape))
        r0 += r
