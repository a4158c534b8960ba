"""What `jointrl report` reads from a run directory, as one typed `RunData`.

`load_run(RUN_DIR)` reads `metrics.jsonl` (one row per step; a resumed run's redone steps replace the
earlier rows; a torn last line from a killed run is skipped with a warning), `samples.jsonl`, and when
present `config.json`, `eval_<label>.json` and the run record `run.json` (rl/observe/record.py: the
domains, their families, the planned steps). Series are aligned by step, None where a step did not log
the metric. MoE telemetry is indexed by expert / layer once here (rl/observe/names.py), so the charts
look values up by domain and index.

It does not render anything (rl/observe/report.py does) or compute metrics.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from rl.observe import names
from rl.observe.record import RunRecord, read_run_record

MANY = 12  # above this many domains, per-domain line charts become per-family means


class ReportError(ValueError):
    """The run directory cannot be turned into a report (message names the file and what is wrong)."""


@dataclass(frozen=True)
class RunData:
    """A run directory's logs, aligned by step. `series[key][i]` is the value at `steps[i]` (None = not logged)."""

    run_dir: Path
    name: str
    steps: tuple[int, ...]
    series: Mapping[str, tuple[float | None, ...]]
    times: tuple[float | None, ...]
    samples: tuple[Mapping[str, Any], ...] = ()
    config: Mapping[str, Any] | None = None
    evals: Mapping[str, tuple[Mapping[str, Any], ...]] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    record: RunRecord | None = None  # RUN_DIR/run.json: the run's domains and families (None for older runs)
    # MoE telemetry by index (rl/observe/names.py: moe_index): domain (or `all`) -> expert / layer -> metric name
    moe_load: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    moe_max_vio: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    # supervised phases (RUN_DIR/<label>_metrics.jsonl: the warm start "sft", the control arm "sft_control"):
    # label -> (SFT steps, 0-based as logged; metric name -> values aligned with them)
    sft: Mapping[str, tuple[tuple[int, ...], Mapping[str, tuple[float | None, ...]]]] = field(default_factory=dict)

    @property
    def domains(self) -> tuple[str, ...]:
        """The run record's domains; for runs without one, names.legacy_domains of the logged keys."""
        if self.record is not None:
            return tuple(sorted(self.record.names))
        return names.legacy_domains(self.series)

    @property
    def planned_steps(self) -> int | None:
        """RL steps the run was configured for (the run record's), None when unknown."""
        return self.record.steps if self.record is not None else None

    @property
    def family_of(self) -> dict[str, str]:
        fam = self.record.family_of() if self.record is not None else {}
        return {d: fam.get(d, d) for d in self.domains}

    @property
    def families(self) -> dict[str, tuple[str, ...]]:
        """family -> its domains (each domain its own family when the run has no record)."""
        out: dict[str, list[str]] = {}
        for d, f in sorted(self.family_of.items()):
            out.setdefault(f, []).append(d)
        return {f: tuple(out[f]) for f in sorted(out)}

    @property
    def many(self) -> bool:
        """Too many domains for one line per domain: charts show per-family means instead."""
        return len(self.domains) > MANY

    def last(self, key: str) -> float | None:
        for v in reversed(self.series.get(key, ())):
            if v is not None:
                return v
        return None

    def last_step_with(self, keys: Sequence[str]) -> int | None:
        """Index of the latest step where any of `keys` has a value."""
        for i in range(len(self.steps) - 1, -1, -1):
            if any(self.series.get(k, (None,) * len(self.steps))[i] is not None for k in keys):
                return i
        return None


def _read_jsonl(path: Path, *, tolerate_torn_tail: bool) -> tuple[list[dict], list[str]]:
    rows, warnings = [], []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            # A run killed mid-write leaves a torn last line; anything else is corruption worth stopping for.
            if tolerate_torn_tail and i == len(lines):
                warnings.append(f"{path.name}: ignored an incomplete last line ({e.msg})")
                continue
            raise ReportError(f"{path}: line {i} is not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ReportError(f"{path}: line {i} is a {type(row).__name__}, expected a JSON object")
        rows.append(row)
    return rows, warnings


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None if v is None else float(v)
    if isinstance(v, (int, float)):
        return float(v) if math.isfinite(v) else None
    return None


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory (see the module docstring). Raises ReportError naming what is missing or bad."""
    rd = Path(run_dir)
    if not rd.exists():
        raise ReportError(f"run directory {rd} does not exist")
    if not rd.is_dir():
        raise ReportError(f"{rd} is not a directory")
    mpath = rd / "metrics.jsonl"
    sft, warnings = _read_sft(rd)
    if not mpath.exists() and not sft:
        raise ReportError(f"{mpath} not found: is {rd} a jointrl run directory? (training writes metrics.jsonl there)")
    rows, w = _read_jsonl(mpath, tolerate_torn_tail=True) if mpath.exists() else ([], [])
    warnings += w
    by_step: dict[int, dict] = {}
    for i, row in enumerate(rows, 1):
        s = row.get("step")
        if isinstance(s, bool) or not isinstance(s, (int, float)) or int(s) != s:
            raise ReportError(f"{mpath}: row {i} has no integer 'step' (got {s!r})")
        # A resumed run appends the steps it redid; the later row is the one that counted.
        by_step[int(s)] = row
    steps = tuple(sorted(by_step))
    keys = sorted({k for r in by_step.values() for k in r if k not in ("step", "time")})
    series = {k: tuple(_num(by_step[s].get(k)) for s in steps) for k in keys}
    times = tuple(_num(by_step[s].get("time")) for s in steps)
    samples: list[dict] = []
    spath = rd / "samples.jsonl"
    if spath.exists():
        samples, w = _read_jsonl(spath, tolerate_torn_tail=True)
        warnings += w
    config = None
    cpath = rd / "config.json"
    if cpath.exists():
        try:
            config = json.loads(cpath.read_text())
        except json.JSONDecodeError as e:
            warnings.append(f"config.json is not valid JSON ({e.msg}); run settings not shown")
    evals: dict[str, tuple] = {}
    for p in sorted(rd.glob("eval_*.json")):
        try:
            rows_e = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            warnings.append(f"{p.name} is not valid JSON ({e.msg}); skipped")
            continue
        if isinstance(rows_e, list) and all(isinstance(r, dict) for r in rows_e):
            evals[p.stem[len("eval_"):]] = tuple(rows_e)
    try:
        record = read_run_record(rd)
    except ValueError as e:
        record = None
        warnings.append(f"{e}; domains are taken from the reward/mean/<domain> metrics")
    name = str((config or {}).get("name") or rd.name)
    moe: dict[str, dict[str, dict[int, str]]] = {"load": {}, "max_vio": {}}
    for k in keys:
        if (m := names.moe_index(k)) is not None:
            moe[m.kind].setdefault(m.domain, {})[m.index] = k
    return RunData(run_dir=rd, name=name, steps=steps, series=series, times=times, samples=tuple(samples),
                   config=config, evals=evals, warnings=tuple(warnings), record=record,
                   moe_load=moe["load"], moe_max_vio=moe["max_vio"], sft=sft)


SFT_LABELS = ("sft", "sft_control")


def _read_sft(rd: Path) -> tuple[dict, list[str]]:
    """The supervised phases' per-step rows (rl/sft.py writes `{"sft_step": i, "sft/nll": ...}` per step; a resumed
    warm start appends the steps it redid, and the later row is the one that counted)."""
    out: dict = {}
    warnings: list[str] = []
    for label in SFT_LABELS:
        path = rd / f"{label}_metrics.jsonl"
        if not path.exists():
            continue
        rows, w = _read_jsonl(path, tolerate_torn_tail=True)
        warnings += w
        by_step = {int(r["sft_step"]): r for r in rows if isinstance(r.get("sft_step"), int) and not isinstance(r["sft_step"], bool)}
        if not by_step:
            continue
        steps = tuple(sorted(by_step))
        keys = sorted({k for r in by_step.values() for k in r if k != "sft_step"})
        out[label] = (steps, {k: tuple(_num(by_step[i].get(k)) for i in steps) for k in keys})
    return out, warnings
