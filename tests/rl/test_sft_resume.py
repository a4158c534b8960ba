"""The SFT warm start checkpoints and resumes: a run killed after some SFT steps continues from its last SFT
checkpoint, redoes none of the steps, and trains on the batches an uninterrupted run would have drawn.

The trainer here is a recording stand-in (the DeepSpeed trainer's save / load / step need Ray actors and a
model; tests/rl/test_train_e2e.py runs the real one): it keeps its "state" as the list of batches it stepped
on, saves and loads that list as the checkpoint, so the test can compare what each run trained on.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rl.config import load_config
from rl.sft import SFT_META, read_sft_checkpoint, sft_warm_start
from rl.types import Episode, SftStepResult


class Killed(Exception):
    pass


class RecordingTrainer:
    def __init__(self, kill_after: int | None = None) -> None:
        self.seen: list[tuple[str, ...]] = []
        self.kill_after = kill_after
        self.loads = 0

    def set_lr(self, lr: float) -> None:
        pass

    def sft_step(self, batch) -> SftStepResult:
        if self.kill_after is not None and len(self.seen) == self.kill_after:
            raise Killed
        self.seen.append(batch)
        return SftStepResult(nll=1.0 / len(self.seen))

    def save_checkpoint(self, path: str, client_state=None) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "state.json").write_text(json.dumps(self.seen))

    def load_checkpoint(self, path: str) -> dict:
        self.seen = [tuple(b) for b in json.loads((Path(path) / "state.json").read_text())]
        self.loads += 1
        return {}


def _warm_start(tmp_path: Path, trainer: RecordingTrainer, every: int, steps: int, checkpoint_dir: Path):
    """`sft_warm_start` with `trainer` as the policy client (batches: the chosen task ids)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [f"run_dir={tmp_path}", "trainer.micro_batch_size=2", f"trainer.checkpoint_every={every}"])
    eps = [Episode(task_id=f"t{i}", domain="terminal", group_id=f"sft:t{i}", token_ids=(1, 2), loss_mask=(0, 1),
                   rollout_logprobs=(0.0, 0.0), messages=(), reward=1.0) for i in range(7)]
    trainer.batch_of = lambda chosen, adv: tuple(e.task_id for e in chosen)
    trainer.refresh_versions = lambda: 0
    return sft_warm_start(trainer, eps, cfg.trainer, tmp_path, seed=cfg.model.seed, steps=steps, checkpoint_dir=checkpoint_dir)


def test_sft_resumes_from_its_checkpoint_with_the_same_batches(tmp_path, monkeypatch):
    monkeypatch.setenv("JOINTRL_PROGRESS", "0")
    whole = RecordingTrainer()
    _warm_start(tmp_path / "a", whole, 3, 10, tmp_path / "a" / "snap")
    assert len(whole.seen) == 10 and read_sft_checkpoint(tmp_path / "a" / "snap")["done"] is True

    run = tmp_path / "b"
    snap = run / "snap"
    killed = RecordingTrainer(kill_after=7)
    with pytest.raises(Killed):
        _warm_start(run, killed, 3, 10, snap)
    meta = json.loads((snap / SFT_META).read_text())
    assert meta["sft_step"] == 6 and meta["done"] is False  # saved at steps 3 and 6, killed in step 8

    again = RecordingTrainer()
    m = _warm_start(run, again, 3, 10, snap)
    assert again.loads == 1 and m.steps == 10
    assert again.seen == whole.seen  # steps 7-10 drew the batches of an uninterrupted run
    rows = [json.loads(x) for x in (run / "sft_metrics.jsonl").read_text().splitlines()]
    assert [r["sft_step"] for r in rows] == [*range(7), *range(6, 10)]  # step 7 ran once before the kill, then again

    done = RecordingTrainer()
    _warm_start(run, done, 3, 10, snap)  # a finished SFT is not redone
    assert done.loads == 1 and done.seen == whole.seen
