"""The run record: a run's domains, their families and its planned steps, typed, in RUN_DIR/run.json.

The driver writes it once when the run starts (`RunRecord.of` from the runtime's env ids and task pools,
then `write_run_record`); the report and the sampler read it back (`read_run_record`), so neither has to
guess domains from metric names. A domain's family is declared by its tasks (`public["family"]`, as the
reasoning-gym adapter sets it); a domain without one is its own family.

It does not hold metrics (rl/observe/sink.py writes those) or evaluation results (eval_<label>.json).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from jointrl.records import Task

RUN_RECORD = "run.json"


@dataclass(frozen=True)
class DomainInfo:
    name: str    # the run's domain key (config `envs.weights`), the last part of per-domain metric names
    env_id: str
    family: str  # the sampling / dashboard group: a task's `public["family"]`, else the domain's own name


@dataclass(frozen=True)
class RunRecord:
    """The run's domains and their families (see the module docstring)."""

    domains: tuple[DomainInfo, ...]
    steps: int | None = None  # RL steps the run was configured for (trainer.steps); None in version-1 records

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.domains)

    def family_of(self) -> dict[str, str]:
        return {d.name: d.family for d in self.domains}

    def families(self) -> dict[str, tuple[str, ...]]:
        """family -> its domains, both sorted."""
        out: dict[str, list[str]] = {}
        for d in sorted(self.domains, key=lambda d: d.name):
            out.setdefault(d.family, []).append(d.name)
        return {f: tuple(out[f]) for f in sorted(out)}

    @staticmethod
    def of(env_ids: Mapping[str, str], tasks: Mapping[str, Sequence[Task]], *, steps: int) -> "RunRecord":
        """From the run's domain -> env id map, its task pools and its configured RL steps. A domain's family is
        the one its tasks declare when they all declare the same (a reasoning-gym generator's); tasks of several
        families inside one domain (terminal-basics' line_count, word_count, ...) leave the domain its own
        family, labelled by its name, never by whichever task came first."""
        out = []
        for d in sorted(env_ids):
            fams = {t.public.get("family") for t in tasks.get(d, ())}
            fam = next(iter(fams)) if len(fams) == 1 and isinstance(next(iter(fams)), str) else None
            out.append(DomainInfo(d, env_ids[d], fam or d))
        return RunRecord(tuple(out), steps=int(steps))

    def to_json(self) -> str:
        return json.dumps({"version": 2, "steps": self.steps,
                           "domains": [{"name": d.name, "env_id": d.env_id, "family": d.family} for d in self.domains]},
                          indent=1)

    @staticmethod
    def from_json(text: str) -> "RunRecord":
        """Raises ValueError naming what is wrong."""
        data = json.loads(text)
        rows = data.get("domains") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            raise ValueError("run record: 'domains' must be a list")
        out = []
        for i, r in enumerate(rows):
            if not (isinstance(r, dict) and all(isinstance(r.get(k), str) for k in ("name", "env_id", "family"))):
                raise ValueError(f"run record: domains[{i}] needs string 'name', 'env_id' and 'family'")
            out.append(DomainInfo(r["name"], r["env_id"], r["family"]))
        steps = data.get("steps")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ValueError(f"run record: 'steps' must be a non-negative integer or null, got {steps!r}")
        return RunRecord(tuple(out), steps=steps)


def write_run_record(run_dir: str | Path, record: RunRecord) -> Path:
    path = Path(run_dir) / RUN_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(record.to_json(), encoding="utf-8")
    tmp.replace(path)
    return path


def read_run_record(run_dir: str | Path) -> RunRecord | None:
    """The run's record, or None for runs written before it existed. Raises ValueError if it is corrupt."""
    path = Path(run_dir) / RUN_RECORD
    if not path.exists():
        return None
    try:
        return RunRecord.from_json(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg})") from None
