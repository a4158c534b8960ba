"""Same-node weight sync through /dev/shm (rl/weights/shm.py, exporter.py: ShmSyncArea, ShmReader, WeightExporter).

CPU part (fast, one Ray instance for the module): the shm path delivers exactly what the
object-store path delivers, for every sync format, as zero-copy views of the mapped file; double
buffering keeps the previous sync readable and refuses an overwritten one; a writer waits for (then
refuses to overrun) a reader, a reader refuses a slot being rewritten, and a torn read is refused
after loading; the object store is chosen (and logged) for foreign nodes, a full /dev/shm or when
forced; files go away on close, on garbage collection, on SIGKILL of the owner (reaper) and, for
dead owners, at the next start; the exporter reuses its layout and the reader its views across
syncs until a name, shape or dtype changes.

Engine part (slow): a real rollout worker loads a shm sync and serves the same logprobs as after an
object-store sync of the same weights, and both match HF on those weights.
"""
from __future__ import annotations

import gc
import logging
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rl.weights import (SHM_PREFIX, ShmBucket, ShmReader, ShmSyncArea, ShmSyncError, WeightBucket, WeightExporter, WeightSyncError,
                        export_buckets, plan_sync, requested_transport, sweep_stale_shm, unpack_bucket)

from tests.rl.rollout.rollout_helpers import random_qwen3_moe

from tests import REPO as ROOT
NODE = "node-a"


@pytest.fixture
def shm_dir():
    """A private directory on /dev/shm's tmpfs: the real medium, isolated from other processes' files."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = tempfile.mkdtemp(prefix="jointrl-test-", dir="/dev/shm")
    yield d
    for n in os.listdir(d):
        os.unlink(os.path.join(d, n))
    os.rmdir(d)


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)  # a private instance beside any others
    yield ray
    ray.shutdown()


def _read_all(reader: ShmReader, index: list[ShmBucket], dtype=None) -> dict[str, torch.Tensor]:
    with reader.open(index) as views:
        return {n: t.clone() for v in views for n, t in unpack_bucket(v, dequant_dtype=dtype)}


def _plan(state: dict[str, torch.Tensor]):
    return plan_sync(state, "qwen3_moe", bucket_mb=0.05)


# ----------------------------------------------------------------------------- equality with the object-store path
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "mxfp4"])
def test_shm_sync_delivers_what_the_object_store_delivers_in_place(fmt, shm_dir, ray_local):
    ray = ray_local
    m = random_qwen3_moe()
    exporter = WeightExporter(node_id=NODE, shm_dir=shm_dir)
    try:
        index = exporter.export(m, m.named_parameters(), bucket_mb=0.05, fmt=fmt, transport="auto", reader_nodes=[NODE, NODE])
        assert exporter.last_transport == "shm" and len(index) > 1 and all(isinstance(b, ShmBucket) for b in index)
        index = ray.get(ray.put(index))  # the index crosses Ray, as from the trainer to a worker
        # the object-store path, as the trainer actor runs it
        refs = [ray.put(b) for b in export_buckets(m, m.named_parameters(), bucket_mb=0.05, fmt=fmt, copy=fmt != "fp32")]
        want = {n: t.clone() for r in refs for n, t in unpack_bucket(ray.get(r), dequant_dtype=torch.float32)}
        reader = ShmReader(NODE)
        with reader.open(index) as views:
            got = {}
            for b, v in zip(index, views):
                assert isinstance(v.buffers[0].base.obj, mmap.mmap) and not v.buffers[0].flags.writeable  # the mapped file itself
                base = v.buffers[0].ctypes.data
                for e, (n, t) in zip(b.entries, unpack_bucket(v, dequant_dtype=torch.float32)):
                    if e.encoding == "raw":
                        assert t.data_ptr() == base + e.parts[0].offset, n  # a view, not a copy
                    got[n] = t.clone()
        assert list(got) == list(want)
        for n in want:
            assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), n
        assert sum(b.num_bytes for b in index) == sum(ray.get(r).num_bytes for r in refs)
        if fmt == "fp32":  # and it is the trainer's weights, bit for bit
            from rl.weights import to_checkpoint_format

            ck = to_checkpoint_format(m.state_dict(), "qwen3_moe")
            assert all(torch.equal(got[n], ck[n]) for n in ck)
        reader.close()
    finally:
        exporter.close()


# ----------------------------------------------------------------------------- versioning and locks
def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.mlp.w": torch.randn(128, 128, generator=g) for i in range(3)} | {"model.norm.weight": torch.randn(128, generator=g)}


def test_double_buffer_keeps_the_previous_sync_and_refuses_an_overwritten_one(shm_dir):
    area = ShmSyncArea(NODE, shm_dir, reaper=False)
    reader = ShmReader(NODE)
    try:
        s1, s2, s3 = _state(1), _state(2), _state(3)
        i1 = area.write(_plan(s1))
        i2 = area.write(_plan(s2))
        assert (i1[0].slot.generation, i2[0].slot.generation) == (1, 2) and i1[0].slot.path != i2[0].slot.path
        for idx, s in ((i1, s1), (i2, s2)):  # sync 1 is still intact while sync 2 exists
            got = _read_all(reader, idx)
            assert list(got) == list(s) and all(torch.equal(got[n], s[n]) for n in s)
        i3 = area.write(_plan(s3))
        assert i3[0].slot.path == i1[0].slot.path  # generation 3 reuses generation 1's slot
        with pytest.raises(ShmSyncError, match=r"generation 1, the slot holds generation 3"):
            _read_all(reader, i1)
        got = _read_all(reader, i3)
        assert all(torch.equal(got[n], s3[n]) for n in s3)
        with pytest.raises(ShmSyncError, match="same-node only"):
            ShmReader("node-b").open(i3).__enter__()
    finally:
        reader.close()
        area.close()


def test_writer_waits_for_readers_then_refuses_to_overrun_them(shm_dir):
    area = ShmSyncArea(NODE, shm_dir, busy_timeout_s=0.3, reaper=False)
    reader = ShmReader(NODE)
    try:
        s1 = _state(1)
        i1 = area.write(_plan(s1))
        area.write(_plan(_state(2)))
        with reader.open(i1) as views:  # a worker is loading generation 1 ...
            t0 = time.monotonic()
            with pytest.raises(ShmSyncError, match="still being read"):
                area.write(_plan(_state(3)))  # ... so generation 3 may not take its slot
            assert time.monotonic() - t0 >= 0.3
            got = {n: t.clone() for v in views for n, t in unpack_bucket(v)}
        assert all(torch.equal(got[n], s1[n]) for n in s1)  # what it read was intact
        assert area.generation == 2

        # A reader finishing while the writer waits: the writer goes ahead as soon as it is done.
        area.busy_timeout_s = 30.0
        s3 = _state(3)
        released = threading.Event()
        done: dict = {}

        def read_slowly():
            with reader.open(i1) as views:
                done["sum"] = float(sum(t.sum() for v in views for _, t in unpack_bucket(v)))
                time.sleep(0.3)
                released.set()

        th = threading.Thread(target=read_slowly)
        th.start()
        time.sleep(0.1)
        i3 = area.write(_plan(s3))
        assert released.is_set(), "the writer did not wait for the reader"
        th.join()
        assert done["sum"] == pytest.approx(float(sum(t.sum() for t in s1.values())))
        got = _read_all(reader, i3)
        assert all(torch.equal(got[n], s3[n]) for n in s3)
    finally:
        reader.close()
        area.close()


def test_reader_refuses_a_slot_being_written_and_a_torn_read(shm_dir):
    import fcntl

    area = ShmSyncArea(NODE, shm_dir, reaper=False)
    reader = ShmReader(NODE)
    try:
        i1 = area.write(_plan(_state(1)))
        path = i1[0].slot.path
        # 1) the trainer holds the slot (writing): the reader refuses at once instead of reading
        fd = os.open(path, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(ShmSyncError, match="rewriting this slot"):
            _read_all(reader, i1)
        fcntl.flock(fd, fcntl.LOCK_UN)
        # 2) a writer that bypasses the lock changes the slot mid-read: refused after loading
        hdr = np.frombuffer(mmap.mmap(fd, 4096), dtype=np.uint64, count=4)
        with pytest.raises(ShmSyncError, match=r"torn or stale read after loading: the index is for generation 1, "
                                               r"the slot holds generation 3 \(being written\)"):
            with reader.open(i1) as views:
                unpack_bucket(views[0])
                hdr[1] = 2 * 3 + 1  # generation 3 being written
        hdr[1] = 2 * 1
        assert _read_all(reader, i1)  # readable again once the header says generation 1
        os.close(fd)
    finally:
        reader.close()
        area.close()


def test_a_write_that_fails_halfway_leaves_the_slot_unreadable(shm_dir, monkeypatch):
    import rl.weights.shm as W

    area = ShmSyncArea(NODE, shm_dir, reaper=False)
    reader = ShmReader(NODE)
    try:
        i1 = area.write(_plan(_state(1)))
        area.write(_plan(_state(2)))
        real = W.write_bucket
        calls = {"n": 0}

        def failing(*a, **k):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("simulated failure mid-write")
            return real(*a, **k)

        monkeypatch.setattr(W, "write_bucket", failing)
        with pytest.raises(RuntimeError, match="mid-write"):
            area.write(_plan(_state(3)))  # goes to generation 1's slot, first bucket overwritten
        with pytest.raises(ShmSyncError, match=r"holds generation 3 \(being written\)"):
            _read_all(reader, i1)
        monkeypatch.setattr(W, "write_bucket", real)
        s3 = _state(3)
        i3 = area.write(_plan(s3))  # the retry completes generation 3
        assert i3[0].slot.generation == 3 and all(torch.equal(v, s3[n]) for n, v in _read_all(reader, i3).items())
    finally:
        reader.close()
        area.close()


def test_reader_errors_name_the_problem(shm_dir):
    area = ShmSyncArea(NODE, shm_dir, reaper=False)
    i1 = area.write(_plan(_state(1)))
    bad = os.path.join(shm_dir, "not-a-sync-file")
    with open(bad, "wb") as f:
        f.write(b"\0" * os.path.getsize(i1[0].slot.path))
    from dataclasses import replace

    with pytest.raises(ShmSyncError, match="bad header magic"):
        _read_all(ShmReader(NODE), [replace(i1[0], slot=replace(i1[0].slot, path=bad))])
    area.close()
    with pytest.raises(ShmSyncError, match="gone"):
        _read_all(ShmReader(NODE), i1)
    with pytest.raises(WeightSyncError, match="page-aligned"):
        ShmBucket(entries=(), slot=i1[0].slot, offset=100, nbytes=0)


def test_slots_grow_in_place_and_readers_remap(shm_dir):
    area = ShmSyncArea(NODE, shm_dir, reaper=False)
    reader = ShmReader(NODE)
    try:
        small = _state(1)
        i1 = area.write(_plan(small))
        area.write(_plan(small))
        assert _read_all(reader, i1)  # the reader has slot 1 mapped at its first size
        size0 = os.path.getsize(i1[0].slot.path)
        big = small | {f"model.layers.{i}.mlp.w": torch.randn(256, 256) for i in range(3, 6)}
        i3 = area.write(_plan(big))  # slot 1 again, larger
        assert i3[0].slot.path == i1[0].slot.path and os.path.getsize(i3[0].slot.path) > size0
        got = _read_all(reader, i3)
        assert list(got) == list(big) and all(torch.equal(got[n], big[n]) for n in big)
    finally:
        reader.close()
        area.close()


def test_exporter_reuses_its_layout_and_the_reader_its_views_until_the_weights_change(shm_dir):
    import pickle

    from rl.weights import to_checkpoint_format

    ex = WeightExporter(node_id=NODE, shm_dir=shm_dir)
    reader = ShmReader(NODE)

    def sync(model, named=None):
        index = ex.export(model, named if named is not None else model.named_parameters(), bucket_mb=0.05, fmt="fp32",
                          reader_nodes=[NODE])
        index = pickle.loads(pickle.dumps(index, protocol=5))  # as it crosses Ray
        with reader.open(index) as views:
            got = {n: t.clone() for v in views for n, t in unpack_bucket(v)}
        return index, views, got

    def expect(model, got):
        ck = to_checkpoint_format(model.state_dict(), "qwen3_moe")
        assert list(got) == list(ck) and all(got[n].shape == ck[n].shape and torch.equal(got[n], ck[n]) for n in ck)

    try:
        m = random_qwen3_moe()
        i1, v1, g1 = sync(m)
        layout = ex.layout
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        i2, v2, _ = sync(m)
        i3, v3, g3 = sync(m)  # generation 3 goes to generation 1's slot
        assert ex.layout is layout and i3[0].slot.path == i1[0].slot.path
        assert all(a.entries is b.entries for a, b in zip(i1, i3))  # the index is interned on arrival
        assert all(a is b for a, b in zip(v1, v3))  # same slot, same layout: the reader reuses its bucket views ...
        assert not any(a is b for a, b in zip(v1, v2))  # (the other slot has its own)
        expect(m, g3)  # ... which show the new bytes
        assert not torch.equal(g1["model.norm.weight"], g3["model.norm.weight"])

        m2 = random_qwen3_moe(moe_inter=64, seed=1)  # wider experts under the same names: new layout, the slots grow
        for _ in range(3):
            _, v, g = sync(m2)
            expect(m2, g)
        assert ex.layout is not layout
        assert not any(a is b for a, b in zip(v, v3))  # the reader mapped the grown slot again: new views

        # a dtype change of one tensor (same names and shapes): rebuilt as well; fp32 on the wire, values as given
        wide = ex.layout
        named = [(n, p.detach().to(torch.bfloat16) if n == "model.norm.weight" else p.detach()) for n, p in m2.named_parameters()]
        _, _, g = sync(m2, named)
        assert ex.layout is not wide
        assert g["model.norm.weight"].dtype == torch.float32
        assert torch.equal(g["model.norm.weight"], m2.model.norm.weight.detach().to(torch.bfloat16).float())
        _, _, g = sync(m2)
        expect(m2, g)
    finally:
        reader.close()
        ex.close()


# ----------------------------------------------------------------------------- choosing the transport
def test_transport_choice_and_fallbacks(shm_dir, monkeypatch, caplog):
    m = random_qwen3_moe()
    ex = WeightExporter(node_id=NODE, shm_dir=shm_dir)
    caplog.set_level(logging.INFO, logger="jointrl.weights")
    try:
        def export(**kw):
            return ex.export(m, m.named_parameters(), bucket_mb=0.05, fmt="fp32", **kw)

        assert all(isinstance(b, ShmBucket) for b in export(reader_nodes=[NODE]))
        assert (ex.last_transport, ex.last_reason) == ("shm", "all readers on this node")
        # a reader on another node -> object store, logged as a warning naming it
        out = export(reader_nodes=[NODE, "node-b"])
        assert all(isinstance(b, WeightBucket) for b in out) and ex.last_transport == "object_store"
        assert any(r.levelno == logging.WARNING and "node-b" in r.getMessage() for r in caplog.records)
        with pytest.raises(ShmSyncError, match="forced but readers on other nodes"):
            export(transport="shm", reader_nodes=["node-b"])
        # readers unknown -> object store (auto cannot prove they are local)
        export()
        assert (ex.last_transport, ex.last_reason) == ("object_store", "reader nodes unknown")
        # the env override, without touching the config
        monkeypatch.setenv("JOINTRL_SYNC_TRANSPORT", "object_store")
        assert requested_transport("auto") == "object_store" and requested_transport("shm") == "shm"
        assert all(isinstance(b, WeightBucket) for b in export(reader_nodes=[NODE]))
        assert (ex.last_transport, ex.last_reason) == ("object_store", "requested")
        monkeypatch.setenv("JOINTRL_SYNC_TRANSPORT", "shm")
        assert all(isinstance(b, ShmBucket) for b in export())
        monkeypatch.setenv("JOINTRL_SYNC_TRANSPORT", "carrier-pigeon")
        with pytest.raises(WeightSyncError, match="JOINTRL_SYNC_TRANSPORT"):
            export(reader_nodes=[NODE])
        monkeypatch.delenv("JOINTRL_SYNC_TRANSPORT")
        with pytest.raises(WeightSyncError, match="transport 'udp'"):
            export(transport="udp")
        # /dev/shm without room -> object store; forced shm refuses
        ex.close()
        real = os.statvfs

        def full(path):
            st = real(path)
            return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 0, 16, st.f_files, st.f_ffree, st.f_favail,
                                      st.f_flag, st.f_namemax))

        monkeypatch.setattr(os, "statvfs", full)
        caplog.clear()
        out = export(reader_nodes=[NODE])
        assert all(isinstance(b, WeightBucket) for b in out) and "MiB free" in ex.last_reason
        assert any(r.levelno == logging.WARNING and "MiB free" in r.getMessage() for r in caplog.records)
        with pytest.raises(ShmSyncError, match="forced but .* MiB free"):
            export(transport="shm")
        # room at the check, none at the allocation (another process filled /dev/shm meanwhile)
        monkeypatch.setattr(os, "statvfs", real)
        ex.close()

        def enospc(fd, off, n):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", enospc)
        out = export(reader_nodes=[NODE])
        assert all(isinstance(b, WeightBucket) for b in out) and "No space left" in ex.last_reason
        assert os.listdir(shm_dir) == []  # no half-made slot left behind
        with pytest.raises(ShmSyncError, match="No space left"):
            export(transport="shm")
    finally:
        ex.close()


# ----------------------------------------------------------------------------- cleanup
def test_files_are_removed_on_close_and_on_garbage_collection_and_readers_keep_their_mapping(shm_dir):
    s1 = _state(1)
    area = ShmSyncArea(NODE, shm_dir)
    i1 = area.write(_plan(s1))
    area.write(_plan(_state(2)))
    assert len(area.paths) == 2 and all(os.path.exists(p) for p in area.paths)
    reader = ShmReader(NODE)
    assert _read_all(reader, i1)  # mapped now
    area.close()
    assert os.listdir(shm_dir) == []
    got = _read_all(reader, i1)  # an existing mapping outlives the file name
    assert all(torch.equal(got[n], s1[n]) for n in s1)
    with pytest.raises(ShmSyncError, match="after close"):
        area.write(_plan(s1))
    reader.close()

    area2 = ShmSyncArea(NODE, shm_dir)
    area2.write(_plan(s1))
    assert os.listdir(shm_dir)
    del area2
    gc.collect()
    assert os.listdir(shm_dir) == []


def test_stale_files_of_dead_or_reused_pids_are_swept_at_start(shm_dir):
    from rl.weights import proc_start_time

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me, start = os.getpid(), proc_start_time(os.getpid())
    names = {
        f"{SHM_PREFIX}{dead.pid}-123-aa-0": False,  # owner dead
        f"{SHM_PREFIX}{me}-{start + 1}-bb-0": False,  # pid alive but another process (start time differs): reused pid
        f"{SHM_PREFIX}{me}-{start}-cc-1": True,  # a live owner's file
        "someone-elses-file": True,
        f"{SHM_PREFIX}garbage": True,  # not our naming scheme: not ours to judge
    }
    for n in names:
        Path(shm_dir, n).write_bytes(b"x")
    area = ShmSyncArea(NODE, shm_dir, reaper=False)
    assert sorted(os.listdir(shm_dir)) == sorted(n for n, keep in names.items() if keep)
    assert sweep_stale_shm(shm_dir) == []
    area.close()


def test_reaper_removes_the_files_of_an_owner_killed_without_cleanup(shm_dir):
    """`ray.kill` runs no Python cleanup and Ray kills the worker's direct children; the reaper (a grandchild) still cleans up."""
    code = ("import os, signal, sys, torch\n"
            "from rl.weights import ShmSyncArea, plan_sync\n"
            "a = ShmSyncArea('n', sys.argv[1])\n"
            "a.write(plan_sync({'w': torch.ones(1000)}, 'x'))\n"
            "a.write(plan_sync({'w': torch.ones(1000)}, 'x'))\n"
            "print(len(a.paths), flush=True)\n"
            # what Ray does to an exiting worker (RAY_kill_child_processes_on_worker_exit): SIGKILL its direct children
            "for p in os.listdir('/proc'):\n"
            "    if p.isdigit():\n"
            "        try: st = open(f'/proc/{p}/stat').read()\n"
            "        except OSError: continue\n"
            "        if int(st[st.rindex(')') + 2:].split()[1]) == os.getpid(): os.kill(int(p), signal.SIGKILL)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    p = subprocess.run([sys.executable, "-c", code, shm_dir], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL and p.stdout.strip() == "2", p.stderr
    deadline = time.monotonic() + 10
    while os.listdir(shm_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.listdir(shm_dir) == []


def test_files_of_a_ray_killed_actor_are_removed(shm_dir, ray_local):
    ray = ray_local

    class AreaOwner:  # defined here so Ray ships it by value (the test module is not importable in workers)
        """A Ray actor owning an area, as the trainer actor does."""

        def __init__(self, directory: str) -> None:
            from rl.weights import ShmSyncArea

            self.area = ShmSyncArea("n", directory)

        def write(self) -> tuple[str, ...]:
            import torch

            from rl.weights import plan_sync

            self.area.write(plan_sync({"w": torch.ones(1000)}, "x"))
            self.area.write(plan_sync({"w": torch.ones(1000)}, "x"))
            return self.area.paths

    owner = ray.remote(num_cpus=0)(AreaOwner).remote(shm_dir)
    paths = ray.get(owner.write.remote())
    assert len(paths) == 2 and all(os.path.exists(p) for p in paths)
    ray.kill(owner)  # what RunParts.close does to the trainer: no Python cleanup runs
    deadline = time.monotonic() + 20
    while os.listdir(shm_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.listdir(shm_dir) == []


# ----------------------------------------------------------------------------- a real worker (slow)
@pytest.mark.slow
def test_worker_serves_a_shm_sync_like_an_object_store_sync(tmp_path_factory, ray_local, shm_dir):
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    from rl.rollout.engine import EngineConfig
    from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint
    from tests.helpers.reference import ReferenceJob, run_reference
    from rl.rollout.worker import RolloutWorkerImpl

    from tests.rl.rollout.rollout_helpers import fixed_sequences, max_abs_diff

    ray = ray_local
    seqs = fixed_sequences(4, 32, seed=3)
    ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp("moe"), TinyModelSpec(kind="qwen3_moe"))
    ref = run_reference(ReferenceJob(checkpoint=str(ckpt), out_dir=str(tmp_path_factory.mktemp("ref")), sequences=seqs,
                                     num_steps=2, perturb_scale=0.1))
    trainer = Qwen3MoeForCausalLM(AutoConfig.from_pretrained(ckpt))
    w = RolloutWorkerImpl(EngineConfig(model_path=str(ckpt), dtype="float32", max_model_len=256, kv_cache_gib=0.25, seed=0))
    ex = WeightExporter(node_id=w.node_id, shm_dir=shm_dir)
    try:
        trainer.load_state_dict(torch.load(ref[1]["state_path"]))
        index = ex.export(trainer, trainer.named_parameters(), bucket_mb=0.5, fmt="fp32", reader_nodes=[w.node_id])
        assert ex.last_transport == "shm" and len(index) > 1
        st = w.update_weights([ray.put(b) for b in index], version=1)  # refs, as the dispatcher sends them
        lp_shm = w.score(seqs)
        assert max_abs_diff(lp_shm, ref[1]["logprobs"]) <= 1e-4
        assert st.policy_version == 1 and st.repacked_moe_layers == 2 and st.num_bytes == sum(b.num_bytes for b in index)

        trainer.load_state_dict(torch.load(ref[2]["state_path"]))
        i2 = ex.export(trainer, trainer.named_parameters(), bucket_mb=0.5, fmt="fp32", reader_nodes=[w.node_id])
        w.update_weights(i2, version=2)
        assert max_abs_diff(w.score(seqs), ref[2]["logprobs"]) <= 1e-4
        # the same weights as state 1 through the object store: the engine serves the same numbers
        trainer.load_state_dict(torch.load(ref[1]["state_path"]))
        w.update_weights([ray.put(b) for b in export_buckets(trainer, trainer.named_parameters(), bucket_mb=0.5, copy=False)], 3)
        assert max_abs_diff(w.score(seqs), lp_shm) <= 1e-6
        # a stale index (its slot was rewritten by generation 3) is refused before anything loads
        ex.export(trainer, trainer.named_parameters(), bucket_mb=0.5, fmt="fp32", reader_nodes=[w.node_id])
        with pytest.raises(ShmSyncError, match="generation 1"):
            w.update_weights(index, version=4)
        assert w.health().policy_version == 3
        assert max_abs_diff(w.score(seqs), lp_shm) <= 1e-6
    finally:
        ex.close()
        w.shutdown()
