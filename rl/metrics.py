"""Where step metrics go: JSONL in the run directory (always) and wandb (offline by default).

`MetricsSink.log(StepMetrics)` appends one JSON line per step to RUN_DIR/metrics.jsonl and the
rollout samples to RUN_DIR/samples.jsonl, and mirrors both to wandb (samples as a table) unless
wandb is disabled. It does not compute metrics: the driver and rl/telemetry.py do.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Mapping

from rl.log import get_logger
from rl.types import StepMetrics

log = get_logger("metrics")


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsSink:
    def __init__(self, run_dir: str | Path, *, wandb_mode: str = "offline", project: str = "jointrl",
                 run_name: str = "run", config: Mapping[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._samples = open(self.run_dir / "samples.jsonl", "a", encoding="utf-8")
        self._wandb = None
        if wandb_mode != "disabled":
            try:
                import wandb

                self._wandb = wandb.init(project=project, name=run_name, mode=wandb_mode, dir=str(self.run_dir),
                                         config=dict(config or {}), reinit="finish_previous")
            except Exception as e:  # noqa: BLE001 - metrics still go to JSONL
                log.warning("wandb unavailable (%s); metrics go to JSONL only", e)

    def log(self, m: StepMetrics) -> None:
        row = {"step": m.step, "time": time.time(), **{k: _clean(float(v)) for k, v in m.values.items()}}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        for s in m.samples:
            self._samples.write(json.dumps({"step": m.step, **dict(s)}) + "\n")
        self._samples.flush()
        if self._wandb is not None:
            payload: dict[str, Any] = {k: v for k, v in row.items() if k not in ("step", "time") and v is not None}
            if m.samples:
                import wandb

                cols = sorted({k for s in m.samples for k in s})
                payload["samples"] = wandb.Table(columns=cols, data=[[str(s.get(c, "")) for c in cols] for s in m.samples])
            self._wandb.log(payload, step=m.step)

    def close(self) -> None:
        for f in (self._metrics, self._samples):
            if not f.closed:
                f.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    p = Path(run_dir) / "metrics.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
