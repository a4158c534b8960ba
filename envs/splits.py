"""Held-out splits by parameter variant, shared by the procedurally generated domains.

A family's variants (tuples of structural parameters) are ranked by a hash of
`"<family>:<json(variant)>"`, and the first `heldout_fraction` go to the held-out split, so the
split is deterministic, independent of generation order and seed, and held-out parameters never
appear in train.
"""
from __future__ import annotations

import hashlib
import json
from typing import Callable, Mapping, Sequence, TypeVar

T = TypeVar("T")


def variant_key(family_name: str, variant: tuple) -> str:
    return f"{family_name}:{json.dumps(list(variant))}"


def split_by_hash(family_name: str, variants: Sequence[tuple], heldout_fraction: float, min_variants: int = 2) -> dict[str, list[tuple]]:
    """{"heldout": [...], "train": [...]}; raises if the family has duplicates or too few variants."""
    if len(set(variants)) != len(variants) or len(variants) < min_variants:
        raise ValueError(f"family {family_name}: needs at least {min_variants} distinct variants, got {len(set(variants))}")
    ranked = sorted(variants, key=lambda v: hashlib.sha256(variant_key(family_name, v).encode()).hexdigest())
    n_held = max(1, round(heldout_fraction * len(variants)))
    return {"heldout": list(ranked[:n_held]), "train": list(ranked[n_held:])}


def tasks_of_split(make_task: Callable[[str, int, int], T], default_n: Mapping[str, int], split: str, seed: int = 0,
                   n: int | None = None) -> list[T]:
    """`make_task(split, seed, i)` for i < n (default: the split's size in `default_n`); an unknown split is an error."""
    if split not in default_n:
        raise ValueError(f"unknown split {split!r}; splits are: {', '.join(default_n)}")
    return [make_task(split, seed, i) for i in range(default_n[split] if n is None else n)]
