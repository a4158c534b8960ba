"""`RolloutWorker`: a Ray actor owning one in-process vLLM `RolloutEngine` (same code on CPU and GPU).

The actor is threaded (`max_concurrency`): concurrent `generate` calls from many episodes each
submit their requests to the engine's continuous-batching loop and wait on their own futures, so
vLLM batches them together. `update_weights` takes a weight sync as a list of buckets — `WeightBucket`s,
`ShmBucket`s (same-node shared-memory index), safetensors bytes, or Ray object refs to any of them
(refs inside a list are not resolved by Ray, so the worker resolves them) — and applies them bucket by
bucket, between two engine steps. A bucket from Ray's object store is read in place
(`rl.weights.unpack_bucket` builds tensors over the shared-memory buffers); a `ShmBucket` is read
through a `ShmReader` that maps the trainer's /dev/shm slot once and checks its generation before and
after the engine copies the tensors (a torn or stale read raises, it never loads silently).
MXFP4-encoded experts are dequantized here to the engine's dtype, since vLLM's loaders do not take
MXFP4 for these architectures, and the engine re-applies its CPU MoE repack as for any update.
An `AdapterBucket` (LoRA adapter-only sync) is written into a directory of the worker's own and
served as a new vLLM LoRA adapter on the unchanged base weights.

What it does not do: choose which worker serves a request or restart itself (rl/rollout/dispatcher.py),
or run episodes (rl/rollout/agent_loop.py).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from rl.rollout.engine import EngineConfig, GenerateRequest, GenerateResult, RolloutEngine, WeightUpdateStats
from rl.rollout.nccl_sync import NcclSyncTicket, receive_nccl_sync
from rl.weights import ShmBucket, ShmReader, WeightBucket, engine_dtype, local_node_id, unpack_bucket
from rl.weights.lora import AdapterBucket


@dataclass(frozen=True)
class WorkerHealth:
    pid: int
    policy_version: int
    pending_requests: int
    startup_s: float
    is_cpu: bool
    routed_experts: bool
    generated_tokens: int
    node_id: str = ""  # Ray node id ("" outside Ray): the trainer picks the shm sync for same-node workers


class RolloutWorkerImpl:
    """The actor body (also usable without Ray, e.g. in a benchmark)."""

    def __init__(self, config: EngineConfig, env: Mapping[str, str] | None = None) -> None:
        for k, v in (env or {}).items():  # e.g. cache dirs, CUDA_VISIBLE_DEVICES, VLLM_* knobs: before vLLM starts
            os.environ[k] = v
        self.engine = RolloutEngine(config)
        self._generated_tokens = 0
        self.node_id = local_node_id()
        self._shm = ShmReader(self.node_id)  # keeps the trainer's slot files mapped across syncs

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        results = self.engine.generate(requests)
        self._generated_tokens += sum(len(r.token_ids) for r in results)
        return results

    def score(self, token_ids_list: Sequence[Sequence[int]]) -> list[np.ndarray]:
        return self.engine.score(token_ids_list)

    def update_weights(self, buckets: Sequence[Any], version: int | None = None) -> WeightUpdateStats:
        """Apply a whole sync (list of buckets); policy_version becomes `version` (default: +1) once, at the end.

        Returned `num_bytes` counts the bytes that crossed to this worker (the buckets' wire payload:
        MXFP4 experts count at 4.25 bits per weight), not the dequantized bytes loaded into the engine.
        """
        if not buckets:
            raise ValueError("update_weights: empty bucket list")
        target = self.engine.policy_version + 1 if version is None else int(version)
        dequant = engine_dtype(getattr(self.engine, "dtype", None))
        t0 = time.perf_counter()
        n_tensors = n_bytes = repacked = 0
        items = _resolve_all(buckets)
        if any(isinstance(x, NcclSyncTicket) for x in items):  # GPU only: the trainer broadcasts it (rl/rollout/nccl_sync.py)
            return receive_nccl_sync(self, items, target)
        if len(items) == 1 and isinstance(items[0], AdapterBucket):  # LoRA adapter-only sync
            return self._load_adapter(items[0], target)
        for i, item in enumerate(items):
            if not isinstance(item, (WeightBucket, ShmBucket, bytes, bytearray)):
                raise TypeError(f"update_weights: bucket {i} must be a WeightBucket, ShmBucket, safetensors bytes or an object "
                                f"ref to one; got {type(item).__name__}")
        shm = [b for b in items if isinstance(b, ShmBucket)]
        # A shm sync is read under one shared lock per slot for all its buckets, so the trainer cannot
        # start rewriting between two buckets (the engine would hold half of each generation).
        with self._shm.open(shm) as views:
            by_id = {id(b): v for b, v in zip(shm, views)}
            for item in items:
                src = by_id.get(id(item), item)
                st = self.engine.update_weights(unpack_bucket(src, dequant_dtype=dequant), version=target)
                n_tensors += st.num_tensors
                n_bytes += item.num_bytes if isinstance(item, (WeightBucket, ShmBucket)) else len(item)
                repacked += st.repacked_moe_layers
        return WeightUpdateStats(num_tensors=n_tensors, num_bytes=n_bytes, seconds=time.perf_counter() - t0,
                                 repacked_moe_layers=repacked, policy_version=self.engine.policy_version)

    def _load_adapter(self, bucket: AdapterBucket, version: int) -> WeightUpdateStats:
        """Write the adapter's files into this worker's own directory and serve it (the previous one is removed)."""
        import shutil
        import tempfile

        if self.__dict__.get("_adapter_root") is None:
            self._adapter_root = tempfile.mkdtemp(prefix="jointrl-lora-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            self._adapter_dir = ""
        t0 = time.perf_counter()
        path = bucket.write(self._adapter_root)
        st = self.engine.load_adapter(path, bucket.num_bytes, version=version)
        if self._adapter_dir:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
        self._adapter_dir = path
        return WeightUpdateStats(num_tensors=0, num_bytes=st.num_bytes, seconds=time.perf_counter() - t0,
                                 repacked_moe_layers=0, policy_version=st.policy_version)

    def health(self) -> WorkerHealth:
        e = self.engine
        return WorkerHealth(pid=os.getpid(), policy_version=e.policy_version, pending_requests=e.num_pending(),
                            startup_s=e.startup_s, is_cpu=e.is_cpu, routed_experts=e.routed_experts_enabled,
                            generated_tokens=self._generated_tokens, node_id=self.node_id)

    def shutdown(self) -> None:
        self.engine.shutdown()
        self._shm.close()
        if self.__dict__.get("_adapter_root"):
            import shutil

            shutil.rmtree(self._adapter_root, ignore_errors=True)


def _resolve_all(items: Sequence[Any]) -> list[Any]:
    """Object refs among `items` fetched (one `ray.get`: object-store buckets come back as zero-copy views)."""
    try:
        import ray
    except ImportError:
        return list(items)
    out = list(items)
    refs = [i for i, x in enumerate(out) if isinstance(x, ray.ObjectRef)]
    if not refs:  # ray.get, even of nothing, starts a local Ray instance in a process that has none
        return out
    for i, v in zip(refs, ray.get([out[i] for i in refs])):
        out[i] = v
    return out


def rollout_worker_actor(num_cpus: float = 1, num_gpus: float = 0, max_concurrency: int = 256, max_restarts: int = 0,
                         resources: Mapping[str, float] | None = None) -> Any:
    """The Ray actor class with resources set: `rollout_worker_actor(...).remote(config)`.

    `resources`: custom Ray resources each worker requires, e.g. `{"rollout_node": 0.001}` to keep
    workers (and their replacements after a restart) on the nodes started with that resource.
    max_restarts defaults to 0: restarts are the dispatcher's job, because a restarted engine must
    be given the latest weights before it serves again (Ray's own restart would serve the checkpoint).
    """
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=max_concurrency, max_restarts=max_restarts,
                      resources=dict(resources or {}))(RolloutWorkerImpl)


def __getattr__(name: str) -> Any:
    # `RolloutWorker` (the @ray.remote class with default resources) is built on first use so that
    # importing this module does not import Ray.
    if name == "RolloutWorker":
        cls = rollout_worker_actor()
        globals()["RolloutWorker"] = cls
        return cls
    raise AttributeError(name)
