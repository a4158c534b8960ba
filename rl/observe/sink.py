"""Where step metrics go: JSONL in the run directory (always) and wandb (offline by default).

`MetricsSink.log(StepMetrics)` appends one JSON line per step to RUN_DIR/metrics.jsonl and the
rollout samples to RUN_DIR/samples.jsonl, and mirrors both to wandb (samples as a table) unless
wandb is disabled. What wandb gets is laid out by rl/observe/wandb_layout.py: every name a series for a
few domains; at hundreds of domains the roll-ups as series and every domain's values in one table a
step. All series are plotted against `train/step` (declared with `define_metric`) and every `log` is
a row of its own, so a second row at the same step (the update the driver drains after its loop) is not
merged into the first, as wandb's `step=` would. `progress_text` is the one-line console summary for the
driver's progress bar.

It does not compute metrics: the driver and rl/observe/telemetry.py do. The run's typed record of
domains and families is rl/observe/record.py; the sink reads it from RUN_DIR/run.json (the driver
writes it before the first step) unless it is handed one.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from rl.observe.config import LoggingSection
from rl.log import get_logger
from rl.observe import names
from rl.observe.record import DomainInfo, RunRecord, read_run_record
from rl.observe.wandb_layout import DOMAIN_TABLE, FAMILY_TABLE, DomainTable, WandbLayout, layout_step
from rl.types import StepMetrics

log = get_logger("metrics")

STEP_AXIS = "train/step"  # the x axis of every wandb series (wandb.define_metric)


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def layout_of(section: LoggingSection) -> WandbLayout:
    """The wandb layout the run's `logging.wandb_*` keys ask for (documented on LoggingSection)."""
    return WandbLayout(section.wandb_per_domain, section.wandb_table_above, section.wandb_table_every)


def _layout_from_run_config(config: Mapping[str, Any] | None) -> WandbLayout:
    # The runtime hands the sink the run config as `rl.config.to_dict` writes it (for wandb's config
    # panel); its logging section is rebuilt as the typed LoggingSection, which checks the values again.
    sec = (config or {}).get("logging")
    return layout_of(LoggingSection(**sec)) if isinstance(sec, Mapping) else WandbLayout()


def _wandb_table(t: DomainTable):
    """`t` as a wandb.Table whose columns are declared (step int, name and family text, the stats optional
    floats). wandb checks the first row against them; the others are appended to `Table.data` unchecked,
    because its per-cell type inference cost ~2-4 ms a row (1.2-2 s for a 500-domain table, measured) and
    `DomainTable` rows hold only those types by construction."""
    import wandb

    if not t.rows:
        return wandb.Table(columns=list(t.columns))
    dtype = [int, str, str] + [float] * (len(t.columns) - 3)
    table = wandb.Table(columns=list(t.columns), data=[list(t.rows[0])], dtype=dtype, optional=True)
    table.data.extend(list(r) for r in t.rows[1:])
    return table


class MetricsSink:
    """metrics.jsonl + samples.jsonl in `run_dir`, mirrored to wandb (see the module docstring).

    layout: how per-domain metrics go to wandb; None takes it from `config`'s logging section (the run
    config the runtime hands over for wandb's config panel). record: the run's domains and families; None
    reads RUN_DIR/run.json at the first step that finds it (before that, and for runs without one, the
    domains are those with a `reward/mean/<domain>` value in the step, `names.legacy_domains`)."""

    def __init__(self, run_dir: str | Path, *, wandb_mode: str = "offline", project: str = "jointrl",
                 run_name: str = "run", config: Mapping[str, Any] | None = None,
                 layout: WandbLayout | None = None, record: RunRecord | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.layout = layout if layout is not None else _layout_from_run_config(config)
        self._record = record
        self._splits: dict[str, tuple[str, str] | None] = {}  # layout_step's split cache, for `_splits_for`
        self._splits_for: RunRecord | None = None
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._samples = open(self.run_dir / "samples.jsonl", "a", encoding="utf-8")
        self._wandb = None
        if wandb_mode != "disabled":
            try:
                import wandb

                self._wandb = wandb.init(project=project, name=run_name, mode=wandb_mode, dir=str(self.run_dir),
                                         config=dict(config or {}), reinit="finish_previous")
                self._wandb.define_metric(STEP_AXIS)
                self._wandb.define_metric("*", step_metric=STEP_AXIS)
            except Exception as e:  # noqa: BLE001 - metrics still go to JSONL
                log.warning("wandb unavailable (%s); metrics go to JSONL only", e)

    def record(self, keys: Sequence[str] = ()) -> RunRecord:
        """The run record the wandb layout uses (see the class docstring); `keys`: the step's metric names,
        for the fallback only."""
        if self._record is None:
            try:
                self._record = read_run_record(self.run_dir)
            except ValueError as e:
                log.warning("%s; wandb layout takes domains from reward/mean/<domain>", e)
                self._record = RunRecord(())  # corrupt: do not re-read it every step
        if self._record is not None and self._record.domains:
            return self._record
        return RunRecord(tuple(DomainInfo(d, d, d) for d in names.legacy_domains(keys)))

    def log(self, m: StepMetrics) -> None:
        row = {"step": m.step, "time": time.time(), **{k: _clean(float(v)) for k, v in m.values.items()}}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        for s in m.samples:
            self._samples.write(json.dumps({"step": m.step, **dict(s)}) + "\n")
        self._samples.flush()
        if self._wandb is not None:
            self._wandb.log(self.wandb_payload(m.step, {k: v for k, v in row.items() if k not in ("step", "time")},
                                               m.samples))

    def wandb_payload(self, step: int, values: Mapping[str, float | None],
                      samples: Sequence[Mapping[str, str]] = ()) -> dict[str, Any]:
        """What `log` hands to `wandb.log` for one step: the layout's series, its tables, the samples table."""
        rec = self.record(tuple(values))
        if rec is not self._splits_for:  # the split cache holds answers for one record's domains
            self._splits, self._splits_for = {}, rec
        laid = layout_step(step, values, rec, self.layout, splits=self._splits)
        payload: dict[str, Any] = {**laid.scalars, STEP_AXIS: step}
        if laid.domains is not None:
            payload[DOMAIN_TABLE] = _wandb_table(laid.domains)
        if laid.families is not None:
            payload[FAMILY_TABLE] = _wandb_table(laid.families)
        if samples:
            import wandb

            cols = sorted({k for s in samples for k in s})
            payload["samples"] = wandb.Table(columns=cols, data=[[str(s.get(c, "")) for c in cols] for s in samples])
        return payload

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
                  domains: Sequence[str] | RunRecord | None = None, max_domains: int = 8) -> str:
    """One line for the training progress bar: step, per-domain reward mean, ETA.

    step: the step just finished (0-based, as logged); steps_done: steps finished in *this* process (after a
    resume, earlier steps took no time here), used with elapsed_s for the rate. domains: the run's domains
    (the run record, or its `.names`); each one's `reward/mean/<domain>` is looked up by its full name, so
    a domain called "max" or "web/search" shows as itself. None (a caller without the record) falls back to
    the domains with a reward in `values` (`names.legacy_domains`). Example:
    'step 12/100 | reward cad 0.410 swe 0.125 | eta 3m12s'. Call it on the tqdm bar with
    `bar.set_postfix_str(progress_text(...))`.
    """
    if total_steps <= 0:
        raise ValueError(f"progress_text: total_steps must be > 0, got {total_steps}")
    if isinstance(domains, RunRecord):
        domains = domains.names
    if domains is None:
        domains = names.legacy_domains(values)
    rewards = []
    for d in sorted(domains):
        v = values.get(names.per_domain("reward/mean", d))
        if v is not None and math.isfinite(float(v)):  # a domain not rolled out this step has no reward
            rewards.append((d, float(v)))
    parts = [f"step {step + 1}/{total_steps}"]
    if rewards:
        shown = " ".join(f"{d} {v:.3f}" for d, v in rewards[:max_domains])
        more = f" +{len(rewards) - max_domains}" if len(rewards) > max_domains else ""
        parts.append(f"reward {shown}{more}")
    left = max(total_steps - (step + 1), 0)
    eta = elapsed_s / steps_done * left if steps_done > 0 else float("nan")
    parts.append(f"eta {format_duration(eta) if left else '0s'}")
    return " | ".join(parts)
