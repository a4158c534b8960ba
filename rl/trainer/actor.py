"""Ray actor wrapper around one rank's `PolicyTrainer`, plus weight export for sync.

The actor adds only what crossing a process boundary needs: weights exported in buckets of
checkpoint-named tensors (so the driver can hand object refs straight to rollout workers, never
copying through itself), and plain-data returns. With N ranks (`rl/trainer/group.py`) each actor
gets its shard of the step batch; rank 0 alone exports weights and writes HF checkpoints, and under
ZeRO-3 the other ranks take part in the parameter gathers.
"""
from __future__ import annotations

import ctypes
import functools
import os
import time
from typing import Any, Sequence

import ray
import torch

from rl.trainer.batch import TrainBatch
from rl.trainer.critic import CriticSpec, CriticTrainer
from rl.trainer.policy import Objective, PolicyTrainer, TrainerSpec


class TrainerWorker:
    def __init__(self, model_dir: str, spec: TrainerSpec, objective: Objective | None, cache_env: dict[str, str] | None = None,
                 rank: int = 0, world_size: int = 1, master_port: int | None = None, master_addr: str | None = None,
                 critic: CriticSpec | None = None) -> None:
        self._rss_start_mb = _rss_mb()
        for k, v in (cache_env or {}).items():
            os.environ.setdefault(k, v)
        # The run's trainer.threads_per_rank arrives in cache_env and wins over an inherited environment value.
        threads = (cache_env or {}).get("JOINTRL_TRAINER_THREADS") or os.environ.get("JOINTRL_TRAINER_THREADS", "1")
        torch.set_num_threads(max(1, int(threads)))
        self.t = PolicyTrainer(model_dir, spec, objective, rank=rank, world_size=world_size, master_port=master_port,
                               master_addr=master_addr)
        self.critic = CriticTrainer(model_dir, critic, world_size) if critic is not None else None

    def ready(self) -> dict[str, Any]:
        m = self.t.module
        return {"params": sum(p.numel() for p in m.parameters()), "model_type": m.config.model_type,
                "replay_supported": self.t.replay_supported, "version": self.t.version}

    def memory(self) -> dict[str, float]:
        """This rank's resident memory: now, its peak, and both less what the process held before
        the model, optimizer and DeepSpeed engine were built."""
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
        now = _rss_mb()
        return {"rss_mb": now, "peak_rss_mb": peak, "start_rss_mb": self._rss_start_mb,
                "model_rss_mb": now - self._rss_start_mb, "model_peak_rss_mb": peak - self._rss_start_mb}

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def process(self) -> tuple[int, str, str]:
        """(pid, node address, the file this process's stderr goes to): what a report of its death names.
        Ray points a worker's standard streams at files in its session's log folder."""
        try:
            log = os.readlink("/proc/self/fd/2")
        except OSError:
            log = ""
        return os.getpid(), ray.util.get_node_ip_address(), log

    def compute_logprobs(self, batch: TrainBatch, n_micro: int = 0, pad_only: bool = False):
        return self.t.compute_logprobs(batch, n_micro, pad_only)

    def rl_step(self, batch: TrainBatch, n_micro: int = 0, pad_only: bool = False) -> dict[str, float]:
        """Reference logprobs when a reference is loaded (unless the batch brings them), then one update.

        The update is one optimizer step over the whole batch, so the policy that produced pi_old's
        logprobs is the one the update's forward runs: `train_step` takes them from that forward
        (detached) and no pass of their own is made. The exception is R2 routing replay with a
        reference to feed: the reference replays the routes the policy takes, so those routes are
        recorded first in a no-grad pass (`compute_logprobs`), whose logprobs then serve as pi_old."""
        t0 = time.perf_counter()
        m = self._update(batch, n_micro, t0, pad_only)
        trim_heap()  # a padding step allocates activations too
        return {**m, "train/busy_s": time.perf_counter() - t0, "train/rss_gb": _rss_mb() / 1024.0}

    def _update(self, batch: TrainBatch, n_micro: int, t0: float, pad_only: bool = False) -> dict[str, float]:
        """`rl_step`'s passes: the R2 pass and reference logprobs it needs, the update, the critic's.

        Every rank makes the same passes through the (possibly ZeRO-3) engines, a padding-only rank
        (`pad_only`: fewer micro-batches than ranks) included: under ZeRO-3 each forward and backward
        gathers parameters collectively, so a pass that one rank skips leaves the other waiting on a
        collective its peer never joins. Which passes run depends only on what every shard shares: the step's `routes_from`,
        whether the batch brings reference logprobs, whether a reference and a critic are loaded.
        The reference itself is a plain module in each process (no collectives): a padding rank skips it."""
        needs_ref = self.t.reference is not None and batch.ref_logprobs_BT is None
        t_old = 0.0
        if needs_ref and self.t.routing_mode(batch) == "r2" and batch.routed_experts_BTLK is None:
            old_lp, routes = self.t.compute_logprobs(batch, n_micro, pad_only)
            t_old = time.perf_counter() - t0
            if not pad_only:
                batch = batch.with_(old_logprobs_BT=old_lp)
                if routes is not None:
                    batch = batch.with_(routed_experts_BTLK=routes, routes_from="trainer")
        extra: dict[str, float] = {}
        if needs_ref and not pad_only:
            t1 = time.perf_counter()
            batch = batch.with_(ref_logprobs_BT=self.t.reference_logprobs(batch))
            extra["train/ref_logprob_s"] = time.perf_counter() - t1
        m = self.t.train_step(batch, n_micro, pad_only)
        if self.critic is not None and batch.returns_BT is not None:
            extra.update(self.critic.value_step(batch, n_micro, pad_only))
        return {**m, **extra, "train/old_logprob_s": t_old}

    def values(self, batch: TrainBatch, n_micro: int = 0, pad_only: bool = False):
        if self.critic is None:
            raise RuntimeError("values: this trainer has no critic (algorithm.advantage is not 'gae')")
        return self.critic.values(batch, n_micro, pad_only)

    def load_reference(self, model_dir: str) -> None:
        self.t.load_reference(model_dir)

    def use_base_reference(self) -> None:
        self.t.use_base_reference()

    def reference_logprobs(self, batch: TrainBatch):
        return self.t.reference_logprobs(batch)

    def sft_step(self, batch: TrainBatch, n_micro: int = 0, pad_only: bool = False) -> dict[str, float]:
        m = self.t.sft_step(batch, n_micro, pad_only)
        trim_heap()
        return m

    def set_lr(self, lr: float) -> None:
        self.t.set_lr(lr)

    def export_weights(self, bucket_mb: float = 64.0, fmt: str = "fp32", transport: str = "object_store",
                       reader_nodes: Sequence[str] = ()) -> list[Any]:
        """The current weights for a sync, in buckets of checkpoint-named tensors (rl/weights/).

        `fmt` = `trainer.sync_format` ("fp32", "bf16", "mxfp4"). `transport`:
        - "object_store" (default, valid for any reader, refs stay readable as long as they live):
          object refs to `WeightBucket`s, put at once, so workers read them in place and the driver
          only holds refs. fp32 buckets alias the weights (`ray.put` is the only copy); bf16 / MXFP4
          are cast or encoded into a staging area reused across syncs. Safe because this actor runs
          one method at a time: nothing changes the weights before `ray.put` returns.
        - "shm": `ShmBucket` indexes (a few KB) of a double-buffered /dev/shm area this process owns,
          written with one warm copy; valid until the export after next. Same-node readers only.
        - "auto": shm if every node in `reader_nodes` (the rollout workers' Ray node ids) is this
          actor's node and /dev/shm has room, else the object store (logged);
          $JOINTRL_SYNC_TRANSPORT overrides "auto".
        - "nccl" (GPU only, untested on a GPU so far): no buckets; rank 0 broadcasts into the rollout
          workers' GPUs while they receive (rl/weights/nccl.py, driven by `NcclWeightSync.sync`).
        """
        from rl.weights import WeightBucket, WeightExporter

        if transport == "nccl":  # GPU only: rank 0 broadcasts over the group rl/weights/nccl.py joined; [stats] on rank 0
            from rl.weights.nccl import trainer_broadcast

            return trainer_broadcast(self, fmt)
        if self.t.spec.lora.sync == "adapter":  # LoRA: the adapter alone (rl/weights/lora.py), any node can read it
            bucket = self.t.adapter_bucket()
            return [] if bucket is None else [ray.put(bucket)]
        if self.t.rank != 0:  # rank 0 publishes; under ZeRO-3 this rank still joins each gather
            if self.t.spec.zero_stage == 3:
                for _ in self.t.named_weights():
                    pass
            return []
        exporter = self.__dict__.get("_exporter")
        if exporter is None:
            exporter = self._exporter = WeightExporter()
        buckets = exporter.export(self.t.sync_module, self.t.named_weights(), bucket_mb=bucket_mb, fmt=fmt, transport=transport,
                                  reader_nodes=tuple(reader_nodes))
        return [ray.put(b) if isinstance(b, WeightBucket) else b for b in buckets]

    def close_sync(self) -> None:
        """Remove this actor's /dev/shm sync files now (otherwise: at exit, or by its reaper if killed)."""
        exporter = self.__dict__.pop("_exporter", None)
        if exporter is not None:
            exporter.close()

    def version(self) -> int:
        return self.t.version

    def save_hf(self, out_dir: str) -> str:
        return self.t.save_hf(out_dir)

    def save_checkpoint(self, ckpt_dir: str, client_state: dict | None = None) -> None:
        self.t.save_checkpoint(ckpt_dir, client_state)
        if self.critic is not None:
            self.critic.save_checkpoint(ckpt_dir)

    def load_checkpoint(self, ckpt_dir: str) -> dict:
        state = self.t.load_checkpoint(ckpt_dir)
        if self.critic is not None:
            self.critic.load_checkpoint(ckpt_dir)
        return state


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS): nothing to trim
        return None


def trim_heap() -> None:
    """Hand the free pages of the C heap back to the OS after a step (glibc's `malloc_trim`).

    A step's activations are freed when it ends, but glibc keeps freed heap memory for reuse, and its
    mmap threshold rises after large frees, so later large tensors come from the heap too: measured on
    the upcycled SmolLM2-MoE, the trainer stayed at 17.9 GB after its first RL step (10.6 GB before it),
    the rollout engine beside it was OOM-killed, and its replacements had no room to start. Trimming
    costs milliseconds against a step of seconds."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
