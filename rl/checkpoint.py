"""The driver's state between RL steps, and the run's checkpoint: save and resume.

`DriverState` is what the loop carries from step to step (the next step, the version the engines serve, the
RL wall time so far). `Checkpoints(ckpt_dir, policy)` saves the trainer (DeepSpeed state with the sampler's
state and the random generators as client state, plus an HF export the engines can start from) and writes
RUN_DIR/checkpoint/meta.json last, atomically; `resume(sampler)` reads them back.

It does not decide when to save (rl/train.py does) nor restart a lost trainer.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rl.log import get_logger

log = get_logger("checkpoint")


@dataclass(frozen=True)
class DriverState:
    step: int = 0  # the next RL step to run
    policy_version: int = 0  # the trainer version the rollout engines serve
    rl_seconds: float = 0.0  # wall time of the RL steps done so far (kept in checkpoints)


class Checkpoints:
    def __init__(self, ckpt_dir: Path, policy: Any) -> None:
        self.dir = Path(ckpt_dir)
        self.policy = policy  # rl.trainer.client.PolicyClient

    def exists(self) -> bool:
        return (self.dir / "meta.json").exists()

    def save(self, state: DriverState, sampler: Any) -> None:
        """Model, optimizer, sampler and random generators at `state` (its step: the next one to run)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        drv = {"sampler": sampler.state_dict(), "step": state.step, "rl_seconds": state.rl_seconds,
               "py_random": random.getstate(), "np_random": np.random.get_state()}
        self.policy.save_checkpoint(str(self.dir / "ds"), {"driver": drv})
        self.policy.trainer.save_hf(str(self.dir / "hf"))
        tmp = self.dir / "meta.json.tmp"
        tmp.write_text(json.dumps({"step": state.step, "policy_version": state.policy_version}))
        tmp.replace(self.dir / "meta.json")  # atomic: a kill mid-save leaves the previous checkpoint valid
        log.info("checkpoint saved at step %d", state.step)

    def resume(self, sampler: Any) -> DriverState:
        """The trainer, `sampler` and the random generators as the last checkpoint saved them; its DriverState."""
        meta = json.loads((self.dir / "meta.json").read_text())
        saved = self.policy.load_checkpoint(str(self.dir / "ds"))
        drv = (saved or {}).get("driver", {})
        if "sampler" in drv:
            sampler.load_state_dict(drv["sampler"])
        if "py_random" in drv:
            random.setstate(drv["py_random"])
        if "np_random" in drv:
            np.random.set_state(drv["np_random"])
        state = DriverState(step=int(meta["step"]), policy_version=int(meta["policy_version"]),
                            rl_seconds=float(drv.get("rl_seconds", 0.0)))
        # Said once, in these words, so a log shows how the run came back: a lost trainer (or a
        # stopped job) ends the run, and this is a new `jointrl train` continuing it.
        log.warning("resumed from the last checkpoint (%s: step %d, policy version %d) because `jointrl train` was "
                    "started again on this run (trainer.resume=true); the driver never restarts a lost trainer by itself",
                    self.dir, state.step, state.policy_version)
        return state
