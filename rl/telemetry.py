"""Per-domain rollout metrics: what each step's episodes looked like, broken down by domain.

Pure functions over `RolloutGroup`s; names follow `<family>/<stat>/<domain>` so dashboards can
group them (`reward/mean/swe`). Trainer-side metrics (losses, KL, router load) come from the
trainer; this module only looks at episodes.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import numpy as np

from rl.types import Episode, RolloutGroup


def _think_tokens(e: Episode, think_start: int, think_end: int) -> int:
    """Generated tokens inside <think>...</think> (the header's <think> is not generated)."""
    n, inside = 0, False
    for t, m in zip(e.token_ids, e.loss_mask):
        if t == think_start:
            inside = True
            continue
        if t == think_end:
            inside = False
            continue
        if inside and m:
            n += 1
    return n


def rollout_metrics(groups: Sequence[RolloutGroup], tok: Any = None, think_ids: tuple[int, int] = (4, 5)) -> dict[str, float]:
    by_dom: dict[str, list[Episode]] = defaultdict(list)
    for g in groups:
        by_dom[g.domain].extend(g.episodes)
    out: dict[str, float] = {}
    for d, eps in sorted(by_dom.items()):
        r = np.array([e.reward for e in eps], dtype=np.float64)
        gen = np.array([sum(e.loss_mask) for e in eps], dtype=np.float64)
        out[f"reward/mean/{d}"] = float(r.mean())
        out[f"reward/std/{d}"] = float(r.std())
        out[f"success/rate/{d}"] = float((r >= 1.0).mean())
        out[f"episodes/count/{d}"] = float(len(eps))
        out[f"tokens/response_mean/{d}"] = float(gen.mean())
        out[f"tokens/thinking_mean/{d}"] = float(np.mean([_think_tokens(e, *think_ids) for e in eps]))
        out[f"tokens/total_mean/{d}"] = float(np.mean([len(e.token_ids) for e in eps]))
        out[f"turns/mean/{d}"] = float(np.mean([e.num_turns for e in eps]))
        out[f"episode/truncated_rate/{d}"] = float(np.mean([e.truncated for e in eps]))
        out[f"episode/wall_s_mean/{d}"] = float(np.mean([e.wall_s for e in eps]))
        out[f"episode/grade_error_rate/{d}"] = float(np.mean([e.grade_error is not None for e in eps]))
        for key in ("parse_errors", "tool_errors", "tool_timeouts", "sandbox_kills", "format_ok"):
            vals = [float(e.metrics[key]) for e in eps if key in e.metrics]
            if vals:
                out[f"episode/{key}_mean/{d}"] = float(np.mean(vals))
    all_r = np.array([e.reward for g in groups for e in g.episodes]) if groups else np.zeros(1)
    out["reward/mean/all"] = float(all_r.mean())
    return out
