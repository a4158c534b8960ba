"""Largest-remainder apportioning: split a whole number of slots over weighted keys.

Hamilton's method (the largest-remainder rule of seat apportionment; Balinski & Young, "Fair
Representation", 2nd ed., 2001, ch. 2): each key gets the floor of its exact quota total·w/Σw, and the
slots left over go one each to the keys with the largest fractional remainders. Every count is the
floor or the ceiling of its quota, and the counts sum to `total`. Used wherever the project divides
tasks by weight (evaluation plans, batch shares per domain). Pure Python, no randomness: a caller that
wants a seeded order passes it as `rank`.
"""
from __future__ import annotations

import math
from typing import Mapping


def largest_remainder(total: int, weights: Mapping[str, float], rank: Mapping[str, int] | None = None) -> dict[str, int]:
    """Split `total` slots by weight; keys with weight <= 0 get 0. Ties in remainder go to the lower
    `rank[k]` first, then (or without `rank`) to the smaller name. Keys come back in `weights`' order."""
    out = {k: 0 for k in weights}
    positive = {k: w for k, w in weights.items() if w > 0}
    if total <= 0 or not positive:
        return out
    whole = sum(positive.values())
    quota = {k: total * w / whole for k, w in positive.items()}
    for k, q in quota.items():
        out[k] = int(math.floor(q))
    left = total - sum(out.values())
    order = sorted(positive, key=lambda k: (-(quota[k] - out[k]), rank[k] if rank is not None else 0, k))
    for k in order[:left]:
        out[k] += 1
    return out
