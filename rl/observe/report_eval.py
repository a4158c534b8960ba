"""The report's answers to "did it learn": the supervised phases' curves and the held-out before / after table.

`sft_section(run)`: one chart per supervised metric (the warm start's NLL and whatever else `sft_step` logs), the
warm start and the SFT control arm as separate lines, x = SFT step counted from 1 like the console.
`heldout_section(run)`: per domain (and tier), held-out success before RL, after RL and, when the run has it,
after the SFT control arm; the paired gain after - before with its 95% interval and paired t (rl/evaluate.py:
`paired_diff`, Student's t over the same tasks and seeds), and RL against the control arm the same way. Domains
are the run's own keys, as the run record and eval_<label>.json name them.

It reads RunData only (rl/observe/report_data.py); it computes no metric of its own beyond the paired
comparison, which is rl/evaluate.py's.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from rl.observe.report_data import RunData
from rl.observe.svg import ALL_COLOR, PALETTE, Series, esc, fmt, line_chart, missing

_ARM_COLORS = {"sft": PALETTE[0], "sft_control": PALETTE[1]}


def sft_section(run: RunData) -> str:
    if not run.sft:
        return '<p class="note" id="sft-missing">No supervised phase in this run (no sft_metrics.jsonl).</p>'
    keys = sorted({k for _, series in run.sft.values() for k in series})
    keys = [k for k in keys if k.endswith("nll")] + [k for k in keys if not k.endswith("nll")]
    # one x axis for all arms: the union of their steps, 1-based
    xs_all = sorted({s for steps, _ in run.sft.values() for s in steps})
    xs = [float(s) + 1 for s in xs_all]
    charts = []
    for k in keys:
        series = []
        for label, (steps, values) in run.sft.items():
            if k not in values:
                continue
            at = dict(zip(steps, values[k]))
            series.append(Series(label, [at.get(s) for s in xs_all], _ARM_COLORS.get(label, ALL_COLOR)))
        if any(v is not None for s in series for v in s.ys):
            charts.append(line_chart(f"sft-{k.replace('/', '-')}", f"{k} per SFT step", xs, series, ylabel=k.split("/")[-1],
                                     xlabel="SFT step"))
    n = {label: len(steps) for label, (steps, _) in run.sft.items()}
    head = "; ".join(f"{label}: {k} steps" for label, k in n.items())
    return f'<p>{esc(head)} (RUN_DIR/&lt;label&gt;_metrics.jsonl).</p><div class="grid2">{"".join(charts)}</div>'


def _rows(run: RunData, label: str) -> list[Any] | None:
    from rl.evaluate import EvalRow

    rows = run.evals.get(label)
    if not rows:
        return None
    out = []
    for r in rows:
        try:
            out.append(EvalRow(**{**r, "task_success": tuple(r.get("task_success", ()))}))
        except TypeError:
            return None  # an older or foreign file: the raw table below still shows it
    return out


def _ci(ci: Sequence[float]) -> str:
    return f"[{ci[0]:+.3f}, {ci[1]:+.3f}]" if all(x == x for x in ci) else "–"


def heldout_section(run: RunData) -> str:
    """The before / after (/ control) table with gains, 95% intervals and paired t; '' when there is nothing to pair."""
    from rl.evaluate import compare

    before, after = _rows(run, "before"), _rows(run, "after")
    if before is None or after is None:
        have = ", ".join(sorted(run.evals)) or "none"
        return (f'<p class="note" id="heldout-missing">No before/after pair to compare yet (arms logged: {esc(have)}); '
                "the table appears once the evaluation after RL is written.</p>")
    control = _rows(run, "sft_control")
    ctl: Mapping[tuple[str, str], Any] = {(r.domain, r.tier): (r, res) for r, res in compare(control, after)} if control else {}
    head = ["domain", "tier", "tasks × samples", "success before", "success after", "gain", "95% CI", "t"]
    if ctl:
        head += ["SFT control", "RL − control", "t (RL vs control)"]
    body = []
    for b, r in compare(before, after):
        cells = [esc(b.domain), esc(b.tier), f"{r.n} × {r.samples}", fmt(r.success_before), fmt(r.success_after),
                 f"{r.gain:+.3f}", _ci(r.gain_ci95), fmt(r.paired_t)]
        if ctl:
            c = ctl.get((b.domain, b.tier))
            cells += [fmt(c[0].success), f"{c[1].gain:+.3f}", fmt(c[1].paired_t)] if c else ["–", "–", "–"]
        cls = ' class="up"' if r.gain > 0 and r.gain_ci95[0] > 0 else ' class="down"' if r.gain < 0 and r.gain_ci95[1] < 0 else ""
        body.append(f'<tr{cls} data-domain="{esc(b.domain)}">' + "".join(
            f'<td class="num">{c}</td>' if i >= 2 else f"<td>{c}</td>" for i, c in enumerate(cells)) + "</tr>")
    return ('<p>Held-out success on the same tasks and seeds before and after RL: the gain is after − before, its 95% '
            "interval and t are paired over tasks (Student's t, n − 1 degrees of freedom; rl/evaluate.py)."
            + (" The SFT control arm continued SFT for RL's wall time from the same start." if ctl else "") + "</p>"
            '<table class="data" id="heldout-table"><thead><tr>' + "".join(f"<th>{esc(h)}</th>" for h in head)
            + f'</tr></thead><tbody>{"".join(body)}</tbody></table>')


__all__ = ["heldout_section", "sft_section", "missing"]
