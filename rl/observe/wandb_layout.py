"""How one step's metrics are laid out for wandb, so its workspace stays readable at hundreds of domains.

wandb draws one panel per scalar series and groups panels into sections by the name's first `/` part
(https://docs.wandb.ai/support/models/articles/how-can-i-organize-my-logged-charts-and-). The
driver's per-domain names (`<group>/<stat>/<domain>`, rl/observe/names.py) are ~80 a domain (16
experts), so 500 domains would be ~40,000 series. `layout_step` splits a step's flat `name -> value`
row into:

- scalar series that do not grow with the domain count: batch-wide names, every `<stat>/all`, and a few
  per-family roll-ups (`FAMILY_ROLLUPS`, named `family/<stat>/<family>`, so they share one section);
- `DomainTable`: every domain's per-domain values as one row per domain (columns: step, domain, family,
  then one per stat), logged as a `wandb.Table` every `table_every` steps and at the last planned step;
  above `table_above` families the roll-ups go to a family table the same way instead of being series.

Which layout a run gets is `WandbLayout` (built from the config's `logging.wandb_*` keys, documented
there): "scalars" (every name a series, the layout for a handful of domains), "table", or "auto" (table
above `table_above` domains of the run record, so the layout does not change as the sampler rotates the
domains a step rolls out). Which names are per-domain comes from the run record's domains
(rl/observe/record.py) through `names.split_domain`; nothing here guesses domains.

It does not write anything (rl/observe/sink.py hands the result to wandb) and does not touch
metrics.jsonl, which always holds every name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Mapping

from rl.observe import names
from rl.observe.record import RunRecord

PerDomain = Literal["auto", "scalars", "table"]
PER_DOMAIN_MODES: tuple[str, ...] = ("auto", "scalars", "table")
FAMILY = "family"  # the section (first name part) of the per-family roll-up series
DOMAIN_TABLE = "domains/table"
FAMILY_TABLE = "families/table"


@dataclass(frozen=True)
class WandbLayout:
    """The sink's wandb layout; the meaning of each field is documented on rl.config.LoggingSection."""

    per_domain: PerDomain = "auto"
    table_above: int = 12
    table_every: int = 10

    def __post_init__(self) -> None:
        if self.per_domain not in PER_DOMAIN_MODES:
            raise ValueError(f"wandb layout: per_domain {self.per_domain!r} is not one of {PER_DOMAIN_MODES}")
        if self.table_above < 0 or self.table_every < 1:
            raise ValueError(f"wandb layout: table_above must be >= 0 and table_every >= 1, got "
                             f"{self.table_above} / {self.table_every}")

    def uses_table(self, n_domains: int) -> bool:
        return self.per_domain == "table" or (self.per_domain == "auto" and n_domains > self.table_above)

    def table_due(self, step: int, planned_steps: int | None = None) -> bool:
        """Every `table_every`-th step, and the run's last planned step (so a run ends with its final table)."""
        return step % self.table_every == 0 or (planned_steps is not None and step == planned_steps - 1)


@dataclass(frozen=True)
class Rollup:
    """One per-domain stat summarised per family: the mean over the family's domains that logged it this
    step (the same mean the report's per-family lines draw, rl/observe/report_domains.py: family_series),
    or the sum where the stat is a share or a count (sampling weights, episodes)."""

    stat: str
    how: Literal["mean", "sum"] = "mean"


# The headline per-domain stats; a few, so series = families x len(this) stays small.
FAMILY_ROLLUPS: tuple[Rollup, ...] = (
    Rollup("reward/mean"), Rollup("success/rate"), Rollup("rollout/zero_var_frac"),
    Rollup("sampler/weight", "sum"), Rollup("episodes/count", "sum"),
    Rollup("tokens/response_mean"), Rollup("moe/max_vio"), Rollup("mismatch/kl_k3"),
)


@dataclass(frozen=True)
class DomainTable:
    """One row per domain (or family): `columns[:3]` are step, name, family; then one column per stat,
    None where that row did not log the stat this step."""

    columns: tuple[str, ...]
    rows: tuple[tuple[object, ...], ...]


@dataclass(frozen=True)
class WandbStep:
    scalars: dict[str, float]
    domains: DomainTable | None = None   # logged as `DOMAIN_TABLE`
    families: DomainTable | None = None  # logged as `FAMILY_TABLE`


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def family_rollups(per_dom: Mapping[str, Mapping[str, float]], family_of: Mapping[str, str],
                   rollups: tuple[Rollup, ...] = FAMILY_ROLLUPS) -> dict[str, dict[str, float]]:
    """stat -> family -> roll-up (see `Rollup`), from stat -> domain -> value; families without a finite
    value for a stat are left out."""
    out: dict[str, dict[str, float]] = {}
    for r in rollups:
        acc: dict[str, list[float]] = {}
        for d, v in per_dom.get(r.stat, {}).items():
            if _finite(v):
                acc.setdefault(family_of.get(d, d), []).append(float(v))
        if acc:
            out[r.stat] = {f: (sum(xs) if r.how == "sum" else sum(xs) / len(xs)) for f, xs in sorted(acc.items())}
    return out


def _table(step: int, per_dom: Mapping[str, Mapping[str, float]], row_family: Mapping[str, str],
           rows_order: list[str]) -> DomainTable:
    stats = sorted(per_dom)
    rows = tuple((step, r, row_family[r], *(per_dom[s].get(r) for s in stats)) for r in rows_order)
    return DomainTable(("step", "name", "family", *stats), rows)


def layout_step(step: int, values: Mapping[str, float | None], record: RunRecord, layout: WandbLayout, *,
                splits: dict[str, tuple[str, str] | None] | None = None) -> WandbStep:
    """The step's wandb payload (see the module docstring). `values` may hold None (a non-finite value
    the sink already turned into JSON null): those are left out of the series and are None in a table.
    splits: a cache of `names.split_domain` answers for this `record`, kept by the caller across steps
    (the names repeat every step; at 500 domains the splitting was most of this function's time)."""
    doms = set(record.names)
    family_of = record.family_of()
    n_fam = len(set(family_of.values()))
    scalars: dict[str, float] = {}
    per_dom: dict[str, dict[str, float]] = {}   # stat -> domain -> value
    cache = splits if splits is not None else {}
    for k, v in values.items():
        if k in cache:
            sd = cache[k]
        else:
            sd = cache[k] = names.split_domain(k, doms) if doms else None
        if sd is None or sd[1] == names.ALL:
            if v is not None:
                scalars[k] = v
            continue
        per_dom.setdefault(sd[0], {})[sd[1]] = None if v is None else float(v)
    table = layout.uses_table(len(doms))
    if not table:  # every per-domain name stays a series of its own
        scalars.update({k: v for k, v in values.items() if v is not None})
    fam = family_rollups(per_dom, family_of)
    grouped = n_fam < len(doms)  # some family holds 2+ domains; otherwise the roll-ups repeat the domains
    fam_table = None
    if grouped and n_fam <= layout.table_above:
        scalars.update({f"{FAMILY}/{s}/{f}": v for s, by_f in fam.items() for f, v in by_f.items()})
    elif grouped and table and layout.table_due(step, record.steps):
        fams = sorted(set(family_of.values()))
        fam_table = _table(step, fam, {f: f for f in fams}, fams)
    dom_table = None
    if table and layout.table_due(step, record.steps):
        logged = sorted({d for by_d in per_dom.values() for d in by_d})  # domains rolled out this step
        dom_table = _table(step, per_dom, family_of, logged)
    return WandbStep(scalars, dom_table, fam_table)
