"""Weight sync, trainer -> rollout engines, and the engine-vs-trainer logprob gap after it.

`WeightSync.push()` sends the trainer's weights to every rollout worker and returns `SyncStats`; the
engines then serve the trainer's version (`Rollouts.policy_version`). The transport is chosen from
`trainer.sync_transport`: NCCL (GPU; trainer rank 0 broadcasts into the workers, rl/rollout/nccl_sync.py),
else same-node workers read the trainer's /dev/shm area (only a small index crosses Ray) and others get
the buckets through Ray's object store (rl/weights/, "same-node transport"); $JOINTRL_SYNC_TRANSPORT=shm|
object_store forces one. The payload never passes through the driver's memory.

`gap(groups)` scores a few of the step's episodes on an engine and on the trainer under the same weights
(`GapStats`). It does not decide when to sync (rl/train.py does).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import numpy as np

from rl.types import GapStats, RolloutGroup, SyncStats


class WeightSync:
    def __init__(self, policy: Any, rollouts: Any, *, transport: str, bucket_mb: float, fmt: str,
                 tensor_parallel_size: int = 1, lora_adapter: bool | None = None, max_model_len: int) -> None:
        self.policy = policy  # rl.trainer.client.PolicyClient
        self.rollouts = rollouts  # rl.rollout.rollouts.Rollouts: its engine receives, its policy_version advances
        self.transport = transport  # trainer.sync_transport
        self.bucket_mb = bucket_mb
        self.fmt = fmt  # trainer.sync_format
        self.tensor_parallel_size = tensor_parallel_size
        self.lora_adapter = lora_adapter  # None: no LoRA; else whether the adapter alone is sent
        self.max_model_len = max_model_len
        self._nccl: Any = None

    def push(self) -> SyncStats:
        """Trainer -> rollout engines, never through the driver's memory."""
        from rl.weights import ShmBucket, requested_transport

        trainer, engine = self.policy.trainer, self.rollouts.engine
        t0 = time.perf_counter()
        version = trainer.version()
        if self.transport == "nccl":  # GPU only: rank 0 broadcasts into the workers (rl/rollout/nccl_sync.py)
            from rl.rollout.nccl_sync import NcclWeightSync

            if self._nccl is None:
                self._nccl = NcclWeightSync.setup(trainer, engine, sync_format=self.fmt, bucket_mb=self.bucket_mb,
                                                  tensor_parallel_size=self.tensor_parallel_size)
            stats = self._nccl.sync(version)
            self.rollouts.policy_version = version
            return stats
        transport = requested_transport(self.transport)
        readers = engine.reader_nodes() if transport == "auto" else []
        # Bucket refs (or shm indexes) owned by the trainer: the payload never passes through the driver.
        bucket_refs = trainer.export_weights(self.bucket_mb, self.fmt, transport, readers)
        t_export = time.perf_counter()
        loaded = engine.update_weights(bucket_refs, version)
        self.rollouts.policy_version = version
        return SyncStats(seconds=time.perf_counter() - t0, export_s=t_export - t0,
                         load_s=max((s.seconds for s in loaded), default=0.0),
                         bytes=float(max((s.num_bytes for s in loaded), default=0)), buckets=float(len(bucket_refs)),
                         shm=any(isinstance(b, ShmBucket) for b in bucket_refs), lora_adapter=self.lora_adapter)

    def gap(self, groups: Sequence[RolloutGroup], n: int = 4) -> GapStats | None:
        """Engine vs trainer logprobs of the same generated tokens under the same (new) weights; None when
        no episode has a generated token."""
        eps = [e for g in groups for e in g.episodes if sum(e.loss_mask) > 0][:n]
        if not eps:
            return None
        seqs = [list(e.token_ids[: self.max_model_len - 1]) for e in eps]
        engine_lp = self.rollouts.engine.score(seqs)
        batch = self.policy.batch_of([dataclasses.replace(e, segments=()) for e in eps], [0.0] * len(eps))  # last contexts
        trainer_lp, _ = self.policy.trainer.compute_logprobs(batch)
        diffs = []
        for i, e in enumerate(eps):
            T = len(seqs[i])
            m = np.asarray(e.loss_mask[1:T], dtype=bool)
            diffs.append(np.abs(np.asarray(engine_lp[i])[: T - 1] - trainer_lp[i, 1:T].numpy())[m])
        d = np.concatenate(diffs) if diffs else np.zeros(1)
        return GapStats(abs_mean=float(d.mean()), abs_max=float(d.max()))
