"""Many-domain steps for the wandb layout tests and measurement, and a reader for what wandb wrote offline.

`step_values(record, step, rng)` is one driver step's metrics for every domain of `record`, produced by
the real producers (rollout_metrics, moe_telemetry, logprob_gap_metrics, ratio_metrics, dynamic_sampling)
from synthetic episodes and routes. `read_wandb(run_dir)` reads the offline run's `.wandb` file: a
LevelDB-style log (7-byte file header ":W&B", 0xBEE1, version; 32 KiB blocks of chunks with a 7-byte
header: checksum u32, length u16, type u8 = full / first / middle / last) of wandb's own protobuf
`Record`s (wandb.proto.wandb_internal_pb2), the format of wandb's former Python datastore
(wandb/sdk/internal/datastore.py before 0.19). Checksums are not verified.

Run as `python -m tests.rl.observe.dash_wandb` for the figures in docs/dashboards.md: series count, table
size and time to lay out and log a step at 4 / 100 / 500 domains, wandb offline.
"""
from __future__ import annotations

import json
import os
import statistics
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rl.observe.moe import moe_telemetry, token_domain_ids
from rl.observe.record import DomainInfo, RunRecord
from rl.observe.telemetry import logprob_gap_metrics, ratio_metrics, rollout_metrics
from rl.train import dynamic_sampling
from rl.types import RolloutGroup
from tests.rl.observe.dash_synth import THINK, make_episode

FAMILIES = ("algebra", "algorithmic", "arc", "arithmetic", "code", "cognition", "games", "geometry", "graphs",
            "induction", "logic", "probability")
E, L, K, T, G = 16, 2, 2, 24, 4


def many_record(n: int, *, families: int = len(FAMILIES)) -> RunRecord:
    """n domains spread over `families` families (the first 12 named like reasoning-gym's)."""
    fams = [FAMILIES[i] if i < len(FAMILIES) else f"fam{i:03d}" for i in range(families)]
    return RunRecord(tuple(DomainInfo(f"rg-{fams[i % families]}_{i:03d}-v0", f"rg-{i}", fams[i % families]) for i in range(n)))


def step_values(record: RunRecord, step: int, rng: np.random.Generator, gen: torch.Generator) -> dict[str, float]:
    """One step's metrics over every domain of `record` (one task of G episodes each), plus batch-wide ones."""
    doms = list(record.names)
    groups = [RolloutGroup(task_id=f"{d}-0", domain=d,
                           episodes=tuple(make_episode(rng, d, f"s{step}-{d}", step, 0.2 + 0.6 * (i % 7) / 6,
                                                       policy_version=step) for _ in range(G)))
              for i, d in enumerate(doms)]
    values = rollout_metrics(groups, THINK, policy_version=step)
    values.update(dynamic_sampling(groups, "off")[1])
    B = len(groups) * G
    dom_B = torch.arange(B) // G
    mask_BT = torch.rand(B, T, generator=gen) < 0.6
    roll = -torch.rand(B, T, generator=gen) * 2
    trainer = roll + 0.01 * torch.randn(B, T, generator=gen)
    values.update(logprob_gap_metrics(trainer, roll, mask_BT, dom_B, doms))
    values.update(ratio_metrics(trainer, roll, mask_BT, dom_B, doms, clip_low=0.2, clip_high=0.28))
    logits = torch.randn(L, B * T, E, generator=gen)
    values.update(moe_telemetry(logits.topk(K, dim=-1).indices, token_domain_ids(dom_B, T), doms, E,
                                token_mask_N=mask_BT.reshape(-1), router_logits=logits))
    values.update({f"sampler/weight/{d}": 1.0 / len(doms) for d in doms})
    values.update({"pg/loss": 0.1, "loss/total": 0.1, "train/grad_norm": 1.0, "kl/value": 0.01, "time/step_s": 5.4,
                   "policy/version": float(step)})
    return values


# ------------------------------------------------------------------------------------------ reading .wandb
_BLOCK, _HDR = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path):
    """Every protobuf Record in an offline run's .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:_HDR])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a wandb log ({ident!r}, {magic:#x}, {version})"
    pos, buf = _HDR, b""
    while pos + _HDR <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HDR:  # block trailer: zero padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + _HDR])
        if kind == 0 and n == 0:  # zero-filled tail
            pos += left
            continue
        if pos + _HDR + n > len(data):  # a record wandb is still writing
            return
        chunk = data[pos + _HDR:pos + _HDR + n]
        pos += _HDR + n
        if kind == _FULL:
            buf = chunk
        elif kind == _FIRST:
            buf = chunk
            continue
        elif kind == _MIDDLE:
            buf += chunk
            continue
        elif kind == _LAST:
            buf += chunk
        else:
            raise ValueError(f"{path}: chunk type {kind} at byte {pos}")
        rec = pb.Record()
        rec.ParseFromString(buf)
        yield rec


@dataclass
class WandbRun:
    history: list[dict[str, object]] = field(default_factory=list)  # one dict per logged row, values decoded
    metrics: list[tuple[str, str]] = field(default_factory=list)    # define_metric: (name or glob, step_metric)
    run_dir: Path = Path()

    def scalar_series(self) -> set[str]:
        """Names with a number in some history row, wandb's own `_step`/`_runtime`/`_timestamp` left out:
        the line-chart panels an automatic workspace would draw."""
        return {k for row in self.history for k, v in row.items()
                if not k.startswith("_") and isinstance(v, (int, float)) and not isinstance(v, bool)}

    def table(self, key: str, row: int = -1) -> dict:
        """The JSON of the table logged under `key` in history row `row` (its columns and data)."""
        ref = self.history[row][key]
        assert isinstance(ref, dict) and ref.get("_type") == "table-file", ref
        return json.loads((self.run_dir / "files" / ref["path"]).read_text())


def read_wandb(run_root: Path, *, wait_s: float = 60.0) -> WandbRun:
    """The single offline run under `run_root/wandb/`, once its file ends with the run's `exit` record.

    `run.finish()` can return before wandb's writer has flushed the file's last records (seen under load:
    a run read at once lacked its last history row), so this re-reads until the exit record is there."""
    (rd,) = sorted((run_root / "wandb").glob("offline-run-*"))
    (f,) = sorted(rd.glob("*.wandb"))
    deadline = time.monotonic() + wait_s
    while True:
        recs = list(wandb_records(f))
        if recs and recs[-1].WhichOneof("record_type") == "exit":
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{f}: no exit record after {wait_s:.0f} s ({len(recs)} records)")
        time.sleep(0.2)
    out = WandbRun(run_dir=rd)
    for rec in recs:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row: dict[str, object] = {}
            for it in rec.history.item:
                if it.key:
                    row[it.key] = json.loads(it.value_json)
                else:  # a media value (a table) arrives field by field: nested_key = [name, field]
                    node = row
                    for part in it.nested_key[:-1]:
                        node = node.setdefault(part, {})  # type: ignore[assignment]
                    node[it.nested_key[-1]] = json.loads(it.value_json)  # type: ignore[index]
            out.history.append(row)
        elif kind == "metric":
            out.metrics.append((rec.metric.name or rec.metric.glob_name, rec.metric.step_metric))
    return out


# ------------------------------------------------------------------------------------------ measurement
def measure(n_domains: int, steps: int = 10) -> dict[str, float]:
    """Log `steps` steps of `n_domains` domains through MetricsSink into JSONL only and into JSONL + an
    offline wandb run (the domain table every 2nd step: even steps are timed with it, odd ones without;
    step 0 is warm-up), then read the wandb run back. Times are the median ms of a whole `sink.log`."""
    from rl.observe.sink import MetricsSink
    from rl.observe.wandb_layout import DOMAIN_TABLE, WandbLayout, layout_step
    from rl.types import StepMetrics

    rec = many_record(n_domains, families=min(n_domains, len(FAMILIES)))
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    vals = [step_values(rec, s, rng, gen) for s in range(steps)]

    def timed_run(td: str, mode: str) -> list[float]:
        sink = MetricsSink(td, wandb_mode=mode, run_name=f"d{n_domains}", record=rec, layout=WandbLayout(table_every=2))
        out = []
        for s, v in enumerate(vals):
            t = time.perf_counter()
            sink.log(StepMetrics(step=s, values=v))
            out.append(1000 * (time.perf_counter() - t))
        sink.close()
        return out

    t_layout, splits = [], {}
    for s, v in enumerate(vals):
        t = time.perf_counter()
        layout_step(s, v, rec, WandbLayout(table_every=2), splits=splits)
        t_layout.append(1000 * (time.perf_counter() - t))
    with tempfile.TemporaryDirectory() as td:
        t_jsonl = timed_run(td, "disabled")
    with tempfile.TemporaryDirectory() as td:
        t_wb = timed_run(td, "offline")
        run = read_wandb(Path(td))
        tables = sorted((run.run_dir / "files" / "media" / "table").rglob("*.table.json"))
        tab = run.table(DOMAIN_TABLE, row=2) if DOMAIN_TABLE in run.history[2] else None
        return {"domains": n_domains, "names_per_step": len(vals[0]), "series": len(run.scalar_series()),
                "table_rows": len(tab["data"]) if tab else 0, "table_cols": len(tab["columns"]) if tab else 0,
                "table_kb": (sum(p.stat().st_size for p in tables) / len(tables) / 1024) if tables else 0.0,
                "layout_ms": statistics.median(t_layout[1:]), "jsonl_ms": statistics.median(t_jsonl[1:]),
                "wandb_ms": statistics.median(t_wb[1::2]), "wandb_table_ms": statistics.median(t_wb[2::2])}


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    torch.set_num_threads(1)
    print(f"{'domains':>7} {'names/step':>10} {'series':>6} {'table rows x cols':>17} {'table KB':>8} "
          f"{'layout ms':>9} {'log ms: jsonl':>13} {'+wandb':>7} {'+wandb+table':>12}")
    for n in (4, 100, 500):
        r = measure(n)
        print(f"{r['domains']:>7} {r['names_per_step']:>10} {r['series']:>6} {r['table_rows']:>8} x {r['table_cols']:<6} "
              f"{r['table_kb']:>8.0f} {r['layout_ms']:>9.1f} {r['jsonl_ms']:>13.1f} {r['wandb_ms']:>7.1f} {r['wandb_table_ms']:>12.1f}")
