"""rl/observe/wandb_layout.py and the sink's wandb side at hundreds of domains, plus the `logging.wandb_*` keys.

The layout is checked on steps from the real producers (tests/rl/observe/dash_wandb.py); the slow test
logs 500 domains to a real offline wandb run and reads back the .wandb file wandb wrote.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from rl.config import ConfigError, LoggingSection, load_config, to_dict
from rl.observe import names
from rl.observe.record import DomainInfo, RunRecord
from rl.observe.sink import STEP_AXIS, MetricsSink, layout_of
from rl.observe.wandb_layout import (DOMAIN_TABLE, FAMILY, FAMILY_ROLLUPS, FAMILY_TABLE, WandbLayout, layout_step)
from rl.types import StepMetrics
from tests.rl.observe.dash_wandb import many_record, read_wandb, step_values


def _step(n: int, step: int = 0, **kw) -> tuple[RunRecord, dict[str, float]]:
    rec = many_record(n, **kw)
    return rec, step_values(rec, step, np.random.default_rng(step), torch.Generator().manual_seed(step))


def _cells(table) -> dict[tuple[str, str], object]:
    """(row name, stat) -> cell, from a DomainTable."""
    return {(r[1], c): r[i] for r in table.rows for i, c in enumerate(table.columns) if i >= 3}


def test_a_few_domains_keep_every_name_as_a_series():
    rec, vals = _step(4, families=4)
    laid = layout_step(0, vals, rec, WandbLayout())
    assert laid.scalars == vals and laid.domains is None and laid.families is None


def test_at_500_domains_series_stay_bounded_and_the_table_holds_every_value():
    rec100, v100 = _step(100)
    rec, vals = _step(500)
    laid = layout_step(0, vals, rec, WandbLayout())
    small = layout_step(0, v100, rec100, WandbLayout())
    assert len(laid.scalars) < 200 and set(laid.scalars) == set(small.scalars)  # does not grow with domains
    doms = set(rec.names)
    per_domain = {k: v for k, v in vals.items() if (sd := names.split_domain(k, doms)) and sd[1] != names.ALL}
    assert len(per_domain) > 40_000 and not set(per_domain) & set(laid.scalars)
    assert all(k in laid.scalars for k in vals if k not in per_domain)  # batch-wide and /all stay series
    t = laid.domains
    assert t is not None and t.columns[:3] == ("step", "name", "family")
    assert sorted(r[1] for r in t.rows) == sorted(rec.names)
    fam = rec.family_of()
    assert all(r[0] == 0 and r[2] == fam[r[1]] for r in t.rows)
    cells = _cells(t)
    for k, v in per_domain.items():
        stat, d = names.split_domain(k, doms)
        assert cells[(d, stat)] == pytest.approx(v)


def test_family_rollups_are_the_mean_or_sum_over_the_family_domains():
    rec, vals = _step(60)
    laid = layout_step(0, vals, rec, WandbLayout())
    for fam, doms in rec.families().items():
        for r in FAMILY_ROLLUPS:
            xs = [vals[names.per_domain(r.stat, d)] for d in doms if names.per_domain(r.stat, d) in vals]
            xs = [x for x in xs if math.isfinite(x)]
            if not xs:
                continue
            want = sum(xs) if r.how == "sum" else sum(xs) / len(xs)
            assert laid.scalars[f"{FAMILY}/{r.stat}/{fam}"] == pytest.approx(want)
    assert laid.scalars[f"{FAMILY}/sampler/weight/algebra"] == pytest.approx(5 / 60)  # 5 of 60 domains, 1/60 each


def test_the_split_cache_gives_the_same_layout():
    rec, v0 = _step(30)
    _, v1 = _step(30, step=1)
    cache: dict = {}
    for s, v in enumerate((v0, v1)):
        assert layout_step(s, v, rec, WandbLayout(), splits=cache) == layout_step(s, v, rec, WandbLayout())
    assert len(cache) == len(set(v0) | set(v1))


def test_many_families_go_to_a_family_table_instead_of_series():
    rec, vals = _step(60, families=30)  # 30 families > table_above
    laid = layout_step(0, vals, rec, WandbLayout(table_above=12))
    assert not any(k.startswith(f"{FAMILY}/") for k in laid.scalars)
    assert laid.families is not None and len(laid.families.rows) == 30
    assert {c for c in laid.families.columns[3:]} == {r.stat for r in FAMILY_ROLLUPS if r.stat in _stats(vals, rec)}


def _stats(vals, rec) -> set[str]:
    doms = set(rec.names)
    return {sd[0] for k in vals if (sd := names.split_domain(k, doms))}


@pytest.mark.parametrize("mode,n,table", [("scalars", 500, False), ("table", 4, True), ("auto", 12, False), ("auto", 13, True)])
def test_per_domain_mode_and_threshold(mode, n, table):
    rec, vals = _step(n, families=min(n, 12))
    laid = layout_step(0, vals, rec, WandbLayout(per_domain=mode, table_above=12, table_every=1))
    assert (laid.domains is not None) is table
    if not table:
        assert set(vals) <= set(laid.scalars)


def test_table_every_k_steps_and_at_the_last_planned_step():
    rec, vals = _step(20)
    rec = RunRecord(rec.domains, steps=8)
    due = [s for s in range(8) if layout_step(s, vals, rec, WandbLayout(table_every=3)).domains is not None]
    assert due == [0, 3, 6, 7]


def test_a_domain_name_with_a_slash_is_split_as_the_record_says():
    rec = RunRecord((DomainInfo("web/search", "e", "web"), DomainInfo("max", "e", "web"), DomainInfo("cad", "e", "cad")))
    vals = {"reward/mean/web/search": 0.5, "reward/mean/max": 0.25, "reward/mean/cad": 1.0, "reward/mean/all": 0.6,
            "episode/wall_s/max": 3.0}
    laid = layout_step(0, vals, rec, WandbLayout(per_domain="table", table_above=2, table_every=1))
    assert set(laid.scalars) >= {"reward/mean/all", "family/reward/mean/web", "family/reward/mean/cad"}
    assert laid.scalars["family/reward/mean/web"] == pytest.approx(0.375)
    assert _cells(laid.domains)[("web/search", "reward/mean")] == 0.5
    assert _cells(laid.domains)[("max", "episode/wall_s")] == 3.0  # `max` is a domain of this run


# ------------------------------------------------------------------------------------------ the config keys
def test_config_keys_are_validated_with_the_key_and_allowed_values():
    with pytest.raises(ConfigError, match=r"'logging\.wandb_per_domain'.*'auto', 'scalars', 'table'"):
        load_config(None, ["logging.wandb_per_domain=tables"])
    with pytest.raises(ConfigError, match=r"'logging\.wandb_table_every'.*>= 1"):
        load_config(None, ["logging.wandb_table_every=0"])
    with pytest.raises(ConfigError, match=r"'logging\.wandb_table_above'.*>= 0"):
        load_config(None, ["logging.wandb_table_above=-1"])


def test_the_sink_reads_its_layout_from_the_run_config(tmp_path):
    cfg = load_config(None, ["logging.wandb_per_domain=table", "logging.wandb_table_above=3", "logging.wandb_table_every=2"])
    assert layout_of(cfg.logging) == WandbLayout("table", 3, 2)
    assert layout_of(LoggingSection()) == WandbLayout()  # the defaults agree with the config's
    assert MetricsSink(tmp_path / "c", wandb_mode="disabled", config=to_dict(cfg)).layout == WandbLayout("table", 3, 2)
    # and the layout has its effect: the same 20-domain step with the two settings
    rec, vals = _step(20)
    sink = MetricsSink(tmp_path, wandb_mode="disabled", config=to_dict(cfg), record=rec)
    assert DOMAIN_TABLE in _payload_keys(sink, vals)
    sink.close()
    cfg2 = load_config(None, ["logging.wandb_per_domain=scalars"])
    sink = MetricsSink(tmp_path / "b", wandb_mode="disabled", config=to_dict(cfg2), record=rec)
    keys = _payload_keys(sink, vals)
    assert DOMAIN_TABLE not in keys and set(vals) <= keys
    sink.close()


def _payload_keys(sink: MetricsSink, vals) -> set[str]:
    return set(sink.wandb_payload(0, vals))


def test_the_sink_takes_the_domains_from_run_json(tmp_path):
    from rl.observe.record import write_run_record

    rec, vals = _step(20)
    write_run_record(tmp_path, rec)
    sink = MetricsSink(tmp_path, wandb_mode="disabled", layout=WandbLayout(table_every=1))
    assert sink.record().names == rec.names
    assert len(sink.wandb_payload(0, vals)) < 200
    sink.close()


# ------------------------------------------------------------------------------------------ real wandb, offline
@pytest.mark.slow
def test_500_domains_offline_wandb_run_has_bounded_series_and_every_domain_in_the_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "data"))  # wandb's artifact staging copies of the tables
    rec = RunRecord(many_record(500).domains, steps=3)
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    steps = [step_values(rec, s, rng, gen) for s in range(3)]
    sink = MetricsSink(tmp_path, wandb_mode="offline", run_name="d500", record=rec)  # default layout: auto
    for s, v in enumerate(steps):
        sink.log(StepMetrics(step=s, values=v))
    sink.close()
    run = read_wandb(Path(tmp_path))
    assert (STEP_AXIS, "") in run.metrics and ("*", STEP_AXIS) in run.metrics
    series = run.scalar_series() - {STEP_AXIS}
    assert len(series) < 200, len(series)
    assert sum(len(v) for v in steps) // 3 > 40_000  # what "every name a series" would have been
    assert [row[STEP_AXIS] for row in run.history] == [0, 1, 2]
    doms = set(rec.names)
    for s in (0, 2):  # table_every=10: step 0, and step 2 as the last planned step
        t = run.table(DOMAIN_TABLE, row=s)
        col = {c: i for i, c in enumerate(t["columns"])}
        rows = {r[col["name"]]: r for r in t["data"]}
        assert set(rows) == doms
        for k, v in steps[s].items():
            sd = names.split_domain(k, doms)
            if sd and sd[1] != names.ALL:
                got = rows[sd[1]][col[sd[0]]]
                assert (got is None and not math.isfinite(v)) or got == pytest.approx(v), (k, got, v)
    assert DOMAIN_TABLE not in run.history[1] and FAMILY_TABLE not in run.history[0]
    assert f"{FAMILY}/reward/mean/algebra" in series and "reward/mean/all" in series
