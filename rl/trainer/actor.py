"""Ray actor wrapper around `PolicyTrainer`, plus weight export for sync.

The actor adds only what crossing a process boundary needs: weights exported in buckets of
checkpoint-named tensors (so the driver can hand object refs straight to rollout workers, never
copying through itself), and plain-data returns.
"""
from __future__ import annotations

import os
from typing import Any

import ray
import torch

from rl.trainer.batch import TrainBatch
from rl.trainer.policy import Objective, PolicyTrainer, TrainerSpec


class TrainerWorker:
    def __init__(self, model_dir: str, spec: TrainerSpec, objective: Objective | None, cache_env: dict[str, str] | None = None,
                 rank: int = 0, world_size: int = 1, master_port: int | None = None) -> None:
        for k, v in (cache_env or {}).items():
            os.environ.setdefault(k, v)
        torch.set_num_threads(max(1, int(os.environ.get("JOINTRL_TRAINER_THREADS", "1"))))
        self.t = PolicyTrainer(model_dir, spec, objective, rank=rank, world_size=world_size, master_port=master_port)

    def ready(self) -> dict[str, Any]:
        m = self.t.module
        return {"params": sum(p.numel() for p in m.parameters()), "model_type": m.config.model_type,
                "replay_supported": self.t.replay_supported, "version": self.t.version}

    def compute_logprobs(self, batch: TrainBatch):
        return self.t.compute_logprobs(batch)

    def rl_step(self, batch: TrainBatch) -> dict[str, float]:
        """Old-policy logprobs (recording routes for R2 when the engine gave none), then one update."""
        old_lp, routes = self.t.compute_logprobs(batch)
        if routes is not None:
            batch = batch.with_(routed_experts_BTLK=routes, routes_from="trainer")
        return self.t.train_step(batch.with_(old_logprobs_BT=old_lp))

    def sft_step(self, batch: TrainBatch) -> dict[str, float]:
        return self.t.sft_step(batch)

    def set_lr(self, lr: float) -> None:
        self.t.set_lr(lr)

    def export_weights(self, bucket_mb: float = 64.0, fmt: str = "fp32") -> list[Any]:
        """The current weights as object refs to buckets of checkpoint-named tensors (rl/weights.py).

        `fmt` = `trainer.sync_format` ("fp32", "bf16", "mxfp4"). Buckets are put in Ray's object
        store at once, so workers read them from there in place and the driver only ever holds the
        (tiny) refs. fp32 buckets alias the weights (`copy=False`: `ray.put` is the only copy);
        bf16 / MXFP4 buckets are gathered, cast or encoded into a staging area reused across syncs
        (fresh memory is several times slower to fill here). Both are safe because nothing touches
        the weights or the staging area before `ray.put` returns: this actor runs one method at a time.
        """
        from rl.weights import SyncStaging, export_buckets

        if fmt == "fp32":
            buckets = export_buckets(self.t.module, self.t.named_weights(), bucket_mb=bucket_mb, fmt=fmt, copy=False)
        else:
            staging = self.__dict__.setdefault("_sync_staging", SyncStaging())
            buckets = export_buckets(self.t.module, self.t.named_weights(), bucket_mb=bucket_mb, fmt=fmt, staging=staging)
        return [ray.put(b) for b in buckets]

    def version(self) -> int:
        return self.t.version

    def save_hf(self, out_dir: str) -> str:
        return self.t.save_hf(out_dir)

    def save_checkpoint(self, ckpt_dir: str, client_state: dict | None = None) -> None:
        self.t.save_checkpoint(ckpt_dir, client_state)

    def load_checkpoint(self, ckpt_dir: str) -> dict:
        return self.t.load_checkpoint(ckpt_dir)


def trainer_actor(num_cpus: float = 1, num_gpus: float = 0):
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0)(TrainerWorker)
