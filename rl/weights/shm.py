"""Same-node transport: a double-buffered, versioned, file-locked weight-sync area in /dev/shm.

Why: through Ray's object store a sync costs one copy into freshly created plasma objects per sync.
A trainer-owned file in /dev/shm that persists across syncs is written warm (one gather copy, the
cast fused in) and mapped once by each worker; Ray then carries only the index (entries + file +
generation + offsets, a few KB).

Consistency (a worker must never read bytes the trainer is rewriting), in three layers:
1. Double buffering: sync g goes to slot g % 2, so the trainer writing sync g+1 never touches the
   slot workers read sync g from.
2. Locks: a writer takes flock(LOCK_EX) on the slot file and waits (up to `busy_timeout_s`, then
   raises) while any reader holds flock(LOCK_SH); a reader takes LOCK_SH without waiting and refuses
   if the writer holds the slot. The kernel drops the locks of a process that dies.
3. A seqlock word in the header: 2g while generation g is complete, 2g+1 while it is being written.
   The reader checks it equals 2g before building tensors and again after the engine has copied
   them; anything else (a stale index replayed after the slot moved on, a writer that bypassed the
   lock) raises `ShmSyncError` naming both generations, never loads silently.

Per-sync work is kept to the copy: the writer keeps, per slot, the destination views of the last
layout (rl/weights/encode.py) and sends that layout's ready-built index; the reader keeps, per
mapped slot, the `WeightBucket` it built over the mapping for each bucket index (offset, size and
interned entries), so a sync with an unchanged layout builds no views on either side. A slot that
grows is mapped again and its cached views go with the old mapping.

File names, the stale sweep and the reaper that removes the files of a killed owner: shm_files.py.

What this module does not do: choose between transports (exporter.py), encode tensors, or reach
workers on another node (the object store is used for those).
"""
from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import subprocess
import sys
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from rl.weights.encode import SyncLayout, SyncPlan, Targets, gather_targets
from rl.weights.errors import ShmSpaceError, ShmSyncError, WeightSyncError
from rl.weights.shm_files import LAUNCHER, REAPER, SHM_DIR, SHM_PREFIX, close_area, proc_start_time, sweep_stale_shm
from rl.weights.wire import TensorEntry, WeightBucket, _EntryTotals, entries_from_wire, segment_ends

_MAGIC = int.from_bytes(b"JRLSYNC1", "little")
_HEADER = 4096  # one page: payloads start page-aligned
_PAGE = 4096
_H_MAGIC, _H_SEQ, _H_PAYLOAD, _H_PID = 0, 1, 2, 3  # uint64 words of the header
SHM_MARGIN = 64 << 20  # leave this much of /dev/shm free (Ray's object store lives there too)
_READER_CACHE_MAX = 4096  # bucket views kept per mapped slot (a sync has one per bucket)


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
    file (buffer 0), exactly as in a one-buffer `WeightBucket`. Pickles its entries as one interned
    blob (rl/weights/wire.py).
    """

    entries: tuple[TensorEntry, ...]
    slot: ShmSlot
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.offset < _HEADER or self.offset % _PAGE or self.nbytes < 0:
            raise WeightSyncError(f"ShmBucket: offset {self.offset} must be page-aligned past the header, nbytes {self.nbytes} >= 0")
        ends = segment_ends(self.entries)
        if ends is not None and set(ends) <= {0} and ends.get(0, 0) <= self.nbytes:
            return
        for e in self.entries:  # something is wrong: find it and name it
            for p in e.parts:
                if p.buffer != 0 or p.offset < 0 or p.offset + p.nbytes > self.nbytes:
                    raise WeightSyncError(f"{e.name}: segment {p} outside the bucket's {self.nbytes} bytes")

    def __reduce__(self):
        return _shm_bucket_from_wire, (self.wire_index(), self.slot, self.offset, self.nbytes)


def _shm_bucket_from_wire(blob: bytes, slot: ShmSlot, offset: int, nbytes: int) -> ShmBucket:
    b = ShmBucket(entries=entries_from_wire(blob), slot=slot, offset=offset, nbytes=nbytes)
    b._set_wire_index(blob)
    return b


def _round_page(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


# ----------------------------------------------------------------------------- the writer
@dataclass
class _WriterSlot:
    path: str
    fd: int
    size: int
    mm: mmap.mmap
    u8: np.ndarray  # [size] writable view of the mapping
    hdr: np.ndarray  # [4] uint64 header words
    targets: tuple[SyncLayout, list[Targets]] | None = field(default=None, repr=False)  # gather views of the last layout


def write_bucket(plan: SyncPlan, targets: Targets) -> None:
    """One bucket's bytes into its place in the slot (the per-sync work of a write)."""
    plan.gather(targets)


class ShmSyncArea:
    """Trainer-side: a double-buffered, versioned staging area in /dev/shm (see the module docstring).

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
        self.prefix = f"{SHM_PREFIX}{pid}-{proc_start_time(pid) or 0}-{secrets.token_hex(4)}-"
        self.generation = 0
        self._slots: list[_WriterSlot | None] = [None] * n_slots
        self._paths: list[str] = []  # shared with the finalizer: the files to unlink
        self._reaper = None
        if reaper:  # the launcher hands the pipe's read end to the reaper and exits; we keep the write end
            self._reaper = subprocess.Popen([sys.executable, "-c", LAUNCHER, REAPER, directory, self.prefix],
                                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True)
            self._reaper.wait(timeout=60)
        self._finalizer = weakref.finalize(self, close_area, self._paths, self._reaper)

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
        if grow == 0:  # every slot already holds this size: nothing to allocate
            return True, ""
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        if grow + SHM_MARGIN > free:
            return False, (f"{self.directory} has {free / 2**20:.0f} MiB free; {len(self._slots)} slots of {need / 2**20:.0f} MiB "
                           f"need {grow / 2**20:.0f} MiB more plus a {SHM_MARGIN >> 20} MiB margin")
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

    @staticmethod
    def _targets(s: _WriterSlot, layout: SyncLayout) -> list[Targets]:
        if s.targets is None or s.targets[0] is not layout:
            per_bucket, off = [], _HEADER
            for b in layout.buckets:
                per_bucket.append(gather_targets(layout, b, s.u8[off:off + b.nbytes]))
                off += _round_page(b.nbytes)
            s.targets = (layout, per_bucket)
        return s.targets[1]

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
        need = self._need(plan)
        s = self._slot(g % len(self._slots), need)
        targets = self._targets(s, plan.layout)
        self._lock(s)
        try:
            s.hdr[_H_SEQ] = 2 * g + 1  # writing g: readers of the slot's previous generation now refuse
            s.hdr[_H_PAYLOAD] = need - _HEADER
            slot = ShmSlot(path=s.path, node_id=self.node_id, generation=g)
            out: list[ShmBucket] = []
            off = _HEADER
            for b, t in zip(plan.layout.buckets, targets):
                write_bucket(plan, t)
                sb = ShmBucket(entries=b.entries, slot=slot, offset=off, nbytes=b.nbytes)
                sb._set_wire_index(b.wire)
                out.append(sb)
                off += _round_page(b.nbytes)
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


# ----------------------------------------------------------------------------- the reader
@dataclass
class _ReaderMap:
    fd: int
    size: int
    mm: mmap.mmap
    hdr: np.ndarray  # [4] uint64, read-only view
    views: dict = field(default_factory=dict, repr=False)  # (offset, nbytes, id(entries)) -> (entries, WeightBucket)


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

    @staticmethod
    def _view(m: _ReaderMap, b: ShmBucket) -> WeightBucket:
        """The bucket over the mapping; the same object for the same index into the same mapping (its views are reused)."""
        key = (b.offset, b.nbytes, id(b.entries))
        hit = m.views.get(key)
        if hit is not None and hit[0] is b.entries:
            return hit[1]
        wb = WeightBucket(entries=b.entries, buffers=(np.frombuffer(m.mm, dtype=np.uint8, count=b.nbytes, offset=b.offset),))
        if len(m.views) >= _READER_CACHE_MAX:
            m.views.clear()
        m.views[key] = (b.entries, wb)
        return wb

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
            yield [self._view(maps[b.slot.path], b) for b in buckets]
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
