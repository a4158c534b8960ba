"""Where step metrics go: JSONL in the run directory (always) and wandb (offline by default).

`MetricsSink.log(StepMetrics)` appends one JSON line per step to RUN_DIR/metrics.jsonl and the
rollout samples to RUN_DIR/samples.jsonl, and mirrors both to wandb (samples as a table) unless
wandb is disabled. It does not compute metrics: the driver and rl/observe/telemetry.py do.

The run's typed record of domains and families is rl/observe/record.py.
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


def format_duration(seconds: float) -> str:
    """Compact h/m/s text for an ETA ('1h02m', '3m12s', '45s'); '?' when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{sec:02d}s"
    return f"{sec}s"


def progress_text(step: int, total_steps: int, values: Mapping[str, float], *, elapsed_s: float, steps_done: int,
                  max_domains: int = 8) -> str:
    """One line for the training progress bar: step, per-domain reward mean, ETA.

    step: the step just finished (0-based, as logged); steps_done: steps finished in *this* process (after a
    resume, earlier steps took no time here), used with elapsed_s for the rate. Example:
    'step 12/100 | reward cad 0.410 swe 0.125 | eta 3m12s'. Call it on the tqdm bar with
    `bar.set_postfix_str(progress_text(...))`.
    """
    if total_steps <= 0:
        raise ValueError(f"progress_text: total_steps must be > 0, got {total_steps}")
    rewards = sorted((k.rsplit("/", 1)[1], v) for k, v in values.items()
                     if k.startswith("reward/mean/") and k != "reward/mean/all" and v is not None and math.isfinite(float(v)))
    parts = [f"step {step + 1}/{total_steps}"]
    if rewards:
        shown = " ".join(f"{d} {float(v):.3f}" for d, v in rewards[:max_domains])
        more = f" +{len(rewards) - max_domains}" if len(rewards) > max_domains else ""
        parts.append(f"reward {shown}{more}")
    left = max(total_steps - (step + 1), 0)
    eta = elapsed_s / steps_done * left if steps_done > 0 else float("nan")
    parts.append(f"eta {format_duration(eta) if left else '0s'}")
    return " | ".join(parts)
