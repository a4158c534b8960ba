"""NCCL weight sync, the rollout workers' side and the driver's: joining the group trainer rank 0 opens,
receiving a broadcast into the engine (`receive_nccl_sync`, called by `RolloutWorkerImpl.update_weights`),
and `NcclWeightSync`, the driver's handle that forms the group and runs one sync. GPU only, untested on a
GPU so far. The records, the trainer's side and how it all fits together are in rl/weights/nccl.py.

Importing this module imports neither torch.cuda nor vLLM.
"""
from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from typing import Any, Sequence

from rl.types import SyncStats
from rl.weights.nccl import (SETUP_TIMEOUT_S, SYNC_FORMATS, SYNC_TIMEOUT_S, NcclGroupInfo, NcclSyncError,
                             NcclSyncTicket, require_cuda, trainer_endpoint, trainer_join)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- rollout side
def _worker_check(impl: Any) -> None:
    """This rollout worker can join: a CUDA build of vLLM on a GPU, built with the NCCL weight-transfer engine."""
    engine = impl.engine
    if engine.is_cpu:
        raise NcclSyncError("trainer.sync_transport=nccl: this rollout worker runs vLLM's CPU build; NCCL sync needs a "
                            "CUDA build of vLLM (the `gpu` extra) and rollout.gpus_per_worker >= 1")
    require_cuda("rollout worker")
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
    """The driver's handle on the run's NCCL group (built by `setup`, used by `rl.sync.WeightSync.push`)."""

    def __init__(self, trainer: Any, dispatcher: Any, info: NcclGroupInfo, ticket: NcclSyncTicket, bucket_mb: float) -> None:
        self.trainer, self.dispatcher, self.info, self.ticket, self.bucket_mb = trainer, dispatcher, info, ticket, bucket_mb
        self._restarts = list(dispatcher.restarts)

    @classmethod
    def setup(cls, trainer: Any, dispatcher: Any, *, sync_format: str, bucket_mb: float, tensor_parallel_size: int,
              timeout_s: float = SETUP_TIMEOUT_S) -> "NcclWeightSync":
        """Form the group: trainer rank 0 plus every TP rank of every rollout worker, joined concurrently
        (`trainer.sync_format`, `trainer.sync_bucket_mb`, `rollout.tensor_parallel_size`)."""
        if sync_format not in SYNC_FORMATS:
            raise NcclSyncError(f"trainer.sync_format={sync_format!r} is not supported over NCCL (only {sorted(SYNC_FORMATS)})")
        tp = int(tensor_parallel_size)
        handles = list(dispatcher.handles)
        # Every side checked first: a side refused after the others entered the rendezvous would leave them blocked.
        checks = [trainer.workers[0].__ray_call__.remote(trainer_endpoint)] + [h.__ray_call__.remote(_worker_check) for h in handles]
        addr, port = _wait_all(checks, 120.0, "NCCL sync: checking the trainer and the rollout workers")[0]
        info = NcclGroupInfo(group_id=uuid.uuid4().hex, master_address=addr, master_port=int(port),
                             world_size=1 + len(handles) * tp, buffer_bytes=int(bucket_mb * (1 << 20)), fmt=sync_format)
        t_refs = [w.__ray_call__.remote(trainer_join, info) for w in trainer.workers]
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
        return cls(trainer, dispatcher, info, ticket, float(bucket_mb))

    def sync(self, version: int, timeout_s: float = SYNC_TIMEOUT_S) -> SyncStats:
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
        return SyncStats(seconds=dt, export_s=sent.seconds, load_s=max((s.seconds for s in stats), default=0.0), bytes=nbytes,
                         buckets=float(max(1, math.ceil(nbytes / max(1, self.info.buffer_bytes)))),  # packed chunks, about
                         shm=False, nccl=True)
