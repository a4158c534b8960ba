"""Joint multi-domain task sampling: which tasks go into the next RL step.

`DomainSampler` draws `n` tasks per step across domains in proportion to their weights, using
largest-remainder rounding so small batches still honour the weights, and cycles through each
domain's shuffled train split without replacement (a new shuffle per epoch). With `adaptive=True`,
weights move toward domains that currently give learning signal (non-zero reward variance within
groups), with a floor `min_weight` so no domain starves. Its state (rng, cursors, weights) goes into
checkpoints. It does not run episodes or know about engines.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Generic, Mapping, Sequence, TypeVar

T = TypeVar("T")


def apportion(weights: Mapping[str, float], n: int) -> dict[str, int]:
    """Largest-remainder split of n slots by weight (deterministic tie-break by name)."""
    pos = {k: w for k, w in weights.items() if w > 0}
    if n <= 0 or not pos:
        return {k: 0 for k in weights}
    total = sum(pos.values())
    exact = {k: n * w / total for k, w in pos.items()}
    out = {k: int(math.floor(v)) for k, v in exact.items()}
    rest = n - sum(out.values())
    for k in sorted(pos, key=lambda k: (-(exact[k] - out[k]), k))[:rest]:
        out[k] += 1
    return {k: out.get(k, 0) for k in weights}


@dataclass
class DomainSampler(Generic[T]):
    pools: Mapping[str, Sequence[T]]  # domain -> its train tasks
    weights: dict[str, float]
    seed: int = 0
    adaptive: bool = False
    min_weight: float = 0.05
    ema: float = 0.5  # smoothing of the learning-signal estimate
    _rng: random.Random = field(init=False, repr=False)
    _order: dict[str, list[int]] = field(init=False, repr=False)
    _cursor: dict[str, int] = field(init=False, repr=False)
    _signal: dict[str, float] = field(init=False, repr=False)
    base_weights: dict[str, float] = field(init=False)

    def __post_init__(self) -> None:
        for d, w in self.weights.items():
            if w > 0 and not self.pools.get(d):
                raise ValueError(f"domain '{d}' has weight {w} but no tasks")
        self.base_weights = dict(self.weights)
        self._rng = random.Random(self.seed)
        self._order = {}
        self._cursor = {}
        self._signal = {d: 1.0 for d in self.weights}
        for d in self.pools:
            self._reshuffle(d)

    def _reshuffle(self, d: str) -> None:
        idx = list(range(len(self.pools[d])))
        self._rng.shuffle(idx)
        self._order[d] = idx
        self._cursor[d] = 0

    def sample(self, n: int) -> list[T]:
        counts = apportion(self.weights, n)
        out: list[T] = []
        for d in sorted(counts):
            for _ in range(counts[d]):
                if self._cursor[d] >= len(self._order[d]):
                    self._reshuffle(d)
                out.append(self.pools[d][self._order[d][self._cursor[d]]])
                self._cursor[d] += 1
        return out

    def observe(self, signal_by_domain: Mapping[str, float]) -> None:
        """Feed this step's learning signal per domain (e.g. fraction of groups with reward variance)."""
        if not self.adaptive:
            return
        for d, s in signal_by_domain.items():
            if d in self._signal:
                self._signal[d] = self.ema * self._signal[d] + (1 - self.ema) * float(s)
        raw = {d: self.base_weights[d] * max(self._signal[d], 0.0) for d in self.base_weights if self.base_weights[d] > 0}
        tot = sum(raw.values())
        k = len(raw)
        if k == 0:
            return
        if tot <= 0:
            new = {d: 1.0 / k for d in raw}
        else:
            floor = min(self.min_weight, 1.0 / k)
            new = {d: floor + (1 - floor * k) * v / tot for d, v in raw.items()}
        self.weights = {d: new.get(d, 0.0) for d in self.base_weights}

    def state_dict(self) -> dict:
        return {"rng": self._rng.getstate(), "order": {k: list(v) for k, v in self._order.items()},
                "cursor": dict(self._cursor), "signal": dict(self._signal), "weights": dict(self.weights)}

    def load_state_dict(self, s: dict) -> None:
        st = s["rng"]
        self._rng.setstate((st[0], tuple(st[1]), st[2]) if isinstance(st, list) else st)
        self._order = {k: list(v) for k, v in s["order"].items()}
        self._cursor = dict(s["cursor"])
        self._signal = dict(s["signal"])
        self.weights = dict(s["weights"])
