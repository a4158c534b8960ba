"""`jointrl report` answers "did it learn": SFT curves (also while only SFT has run), the held-out before/after
table with gains, 95% intervals and paired t checked against a slow reference, domains labelled by their run
keys (not a task's family), y-axis tick labels that never repeat, steps counted from 1."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from rl.cli import main as jointrl


def _write_sft(run_dir: Path, label: str, nll: list[float]) -> None:
    with open(run_dir / f"{label}_metrics.jsonl", "w") as f:
        for i, v in enumerate(nll):
            f.write(json.dumps({"sft_step": i, "sft/nll": v, "sft/tokens": 100.0 + i}) + "\n")


def _eval(run_dir: Path, label: str, domain: str, task_success: list[float]) -> None:
    row = {"domain": domain, "tier": "low", "n": len(task_success), "success": sum(task_success) / len(task_success),
           "reward": 0.0, "tokens": 10.0, "turns": 1.0, "samples": 1, "task_success": task_success}
    path = run_dir / f"eval_{label}.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(rows + [row]))


def _slow_paired(before: list[float], after: list[float]) -> tuple[float, float, float, float]:
    """mean, t, CI of after - before by the textbook formulas (t quantile from scipy)."""
    from scipy import stats

    d = [a - b for a, b in zip(after, before)]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    se = sd / math.sqrt(n)
    q = stats.t.ppf(0.975, n - 1)
    return mean, mean / se, mean - q * se, mean + q * se


def test_report_during_sft_shows_its_curve(tmp_path, capsys):
    _write_sft(tmp_path, "sft", [2.0, 1.5, 1.2, 1.0])  # SFT running, no RL row yet (no metrics.jsonl)
    assert jointrl(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    assert "Supervised fine-tuning" in page and "sft: 4 steps" in page and 'id="plot-sft-sft-nll"' in page
    steps = sorted({int(m) for m in re.findall(r"sft @ step (\d+):", page)})
    assert steps == [1, 2, 3, 4]  # 1-based, as the console's bar counts
    assert "nothing to plot" not in page


def test_heldout_table_has_gains_intervals_and_t(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean/terminal_basics": 0.5}) + "\n")
    (tmp_path / "run.json").write_text(json.dumps({"version": 2, "steps": 1, "domains": [
        {"name": "terminal_basics", "env_id": "terminal-basics-v0", "family": "terminal_basics"},
        {"name": "cad_primitive", "env_id": "cad-primitive-v0", "family": "cad_primitive"}]}))
    tb_b, tb_a = [0, 0, 1, 0, 1, 0, 0, 1.0], [1, 0, 1, 1, 1, 1, 0, 1.0]
    cp_b, cp_a = [0, 1, 0, 0.5, 0], [0.5, 1, 0, 1, 0]
    ctl = [0, 1, 1, 0, 1, 0, 0, 1.0]
    for d, b, a in (("terminal_basics", tb_b, tb_a), ("cad_primitive", cp_b, cp_a)):
        _eval(tmp_path, "before", d, b)
        _eval(tmp_path, "after", d, a)
    _eval(tmp_path, "sft_control", "terminal_basics", ctl)
    _write_sft(tmp_path, "sft", [2.0, 1.0])
    _write_sft(tmp_path, "sft_control", [1.0, 0.9, 0.8])
    assert jointrl(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    table = page.split('id="heldout-table"')[1].split("</table>")[0]
    rows = {m[0]: re.findall(r"<td[^>]*>([^<]*)</td>", m[1]) for m in re.findall(r'data-domain="(\w+)">(.*?)</tr>', table)}
    assert set(rows) == {"terminal_basics", "cad_primitive"}  # the run's domain keys, never a task family
    for d, b, a in (("terminal_basics", tb_b, tb_a), ("cad_primitive", cp_b, cp_a)):
        mean, t, lo, hi = _slow_paired(b, a)
        cells = rows[d]
        assert cells[2] == f"{len(b)} × 1"
        assert float(cells[5]) == pytest.approx(mean, abs=5e-4)
        assert cells[6] == f"[{lo:+.3f}, {hi:+.3f}]"
        assert float(cells[7]) == pytest.approx(t, rel=1e-3)
    mean, t, _, _ = _slow_paired(ctl, tb_a)
    assert float(rows["terminal_basics"][9]) == pytest.approx(mean, abs=5e-4)
    assert float(rows["terminal_basics"][10]) == pytest.approx(t, rel=1e-3)
    assert rows["cad_primitive"][8:] == ["–", "–", "–"]
    assert "sft_control: 3 steps" in page and "sft: 2 steps" in page


def test_domains_take_their_own_name_when_their_tasks_span_families():
    from jointrl.records import Task
    from rl.observe.record import RunRecord

    def task(i: int, fam: str) -> Task:
        return Task(id=f"t{i}", domain="x", prompt=(), public={"family": fam})

    rec = RunRecord.of({"terminal_basics": "terminal-basics-v0", "rg_leg": "rg-leg_counting-v0"},
                       {"terminal_basics": [task(0, "line_count"), task(1, "word_count")],
                        "rg_leg": [task(2, "arithmetic"), task(3, "arithmetic")]}, steps=3)
    assert rec.family_of() == {"terminal_basics": "terminal_basics", "rg_leg": "arithmetic"}


@pytest.mark.parametrize("lo,hi", [(0.2, 0.25), (0.0, 1.0), (100.0, 100.05), (1e6, 1.00001e6), (1e-5, 3e-5), (-0.01, 0.01),
                                   (12340.0, 12346.0)])
def test_tick_labels_never_repeat(lo, hi):
    from rl.observe.svg import nice_ticks, tick_labels

    ticks = nice_ticks(lo, hi)
    labels = tick_labels(ticks)
    assert len(set(labels)) == len(labels), (ticks, labels)
    for t, s in zip(ticks, labels):
        assert float(s) == pytest.approx(t, rel=1e-6, abs=1e-12)
