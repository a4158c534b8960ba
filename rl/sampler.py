"""Joint multi-domain task sampling: which tasks go into the next RL step.

`DomainSampler` draws `n` tasks per step across domains in proportion to their weights and cycles
through each domain's shuffled train split without replacement (a new shuffle per epoch). Counts per
domain come from systematic sampling (one uniform offset per step), so each domain gets the floor or
the ceiling of its exact share and the shares sum to `n`; with more domains than tasks per step the
domains that get a task change from step to step instead of always being the first names.

With `adaptive=True`, `observe(groups)` moves the weights after each step by one of three rules,
computed from the typed rollout groups (never from metric names):
- `variance`: toward domains whose groups have reward variance (1 - zero-variance fraction), EMA-smoothed;
- `learnability`: the same times 4·p·(1-p), p the mean reward clipped to [0, 1], so domains near 50 %
  success count most and solved or hopeless ones least (the learnability score of curriculum work such
  as Foster & Foerster 2025, "Learning to reason at the frontier of learnability"), EMA-smoothed;
- `dump`: DUMP's rule (Wang et al. 2025, arXiv 2504.09710): a UCB score per unit, the mean |advantage|
  of its last `dump_window` samples plus `dump_c`·sqrt(2 ln N / n_u) (N samples seen, n_u of them from
  the unit), turned into weights by a softmax at `dump_temperature`. Advantages are GRPO's
  (r - mean) / (std + eps) within each group, from rl/algos' GRPO estimator over the rewards.
Every rule keeps a floor `min_weight` per unit (capped at 1/units) so none starves. `level="family"`
makes families the units: a family's statistics pool its domains' groups, and a family's weight is
split among its domains by their base weights.

Its state (rng, cursors, weights, the rules' statistics) goes into checkpoints. It does not run
episodes or know about engines.
"""
from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Literal, Mapping, Sequence, TypeVar

import torch

from rl.algos.advantages import grpo_advantages_B
from rl.algos.dynamic_sampling import group_signal
from rl.config import EnvsSection
from rl.types import RolloutGroup

T = TypeVar("T")
Rule = Literal["variance", "learnability", "dump"]
Level = Literal["domain", "family"]
RULES = ("variance", "learnability", "dump")
LEVELS = ("domain", "family")


def systematic_apportion(weights: Mapping[str, float], n: int, u: float) -> dict[str, int]:
    """Split n slots by weight with one offset u in [0, 1): domain k gets floor(C_k + u) - floor(C_{k-1} + u),
    C the cumulative exact shares in name order. Each count is the floor or ceiling of n·w/Σw; they sum to n."""
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u must be in [0, 1), got {u}")
    pos = sorted(k for k, w in weights.items() if w > 0)
    out = {k: 0 for k in weights}
    if n <= 0 or not pos:
        return out
    total = sum(weights[k] for k in pos)
    cum, prev = 0.0, math.floor(u)
    for k in pos:
        cum += n * weights[k] / total
        cur = math.floor(min(cum, float(n)) + u) if k != pos[-1] else math.floor(n + u)
        out[k] = cur - prev
        prev = cur
    return out


@dataclass(frozen=True)
class UnitStats:
    """One step's learning-signal statistics of a domain (or family), from its rollout groups."""

    groups: int
    zero_var_frac: float  # groups whose rewards are all equal
    success: float        # mean reward, clipped to [0, 1]
    abs_adv: tuple[float, ...]  # |GRPO advantage| of each sample


def unit_stats(groups: Sequence[RolloutGroup], unit_of: Mapping[str, str] | None = None) -> dict[str, UnitStats]:
    """Per-unit statistics of `groups` (unit = domain, or `unit_of[domain]`). The zero-variance rule is
    rl/algos' `group_signal` (the training loop's); advantages are its GRPO estimator's, 0 in a group
    without signal."""
    groups = [g for g in groups if g.rewards]
    if not groups:
        return {}
    units_G = [unit_of.get(g.domain, g.domain) if unit_of else g.domain for g in groups]
    rewards_G = [[float(x) for x in g.rewards] for g in groups]
    signal = group_signal(rewards_G, units_G)
    sizes_G = torch.tensor([len(r) for r in rewards_G])
    rewards_B = torch.tensor([x for r in rewards_G for x in r], dtype=torch.float64)
    adv_B, _ = grpo_advantages_B(rewards_B, torch.repeat_interleave(torch.arange(len(groups)), sizes_G))
    adv_B = adv_B * torch.repeat_interleave(torch.tensor(signal.has_signal_G, dtype=torch.float64), sizes_G)
    abs_adv = adv_B.abs().tolist()
    acc: dict[str, tuple[list[int], list[float], list[float]]] = {}
    start = 0
    for unit, r in zip(units_G, rewards_G):
        n, rew, adv = acc.setdefault(unit, ([0], [], []))
        n[0] += 1
        rew.extend(r)
        adv.extend(abs_adv[start:start + len(r)])
        start += len(r)
    return {u: UnitStats(groups=n[0], zero_var_frac=signal.zero_var_frac[u],
                         success=min(1.0, max(0.0, sum(rew) / len(rew))), abs_adv=tuple(adv))
            for u, (n, rew, adv) in acc.items()}


def learnability(s: UnitStats) -> float:
    return (1.0 - s.zero_var_frac) * 4.0 * s.success * (1.0 - s.success)


@dataclass
class DomainSampler(Generic[T]):
    pools: Mapping[str, Sequence[T]]  # domain -> its train tasks
    weights: dict[str, float]
    seed: int = EnvsSection.seed
    adaptive: bool = EnvsSection.adaptive_weights
    min_weight: float = EnvsSection.min_weight
    ema: float = 0.5  # smoothing of the variance / learnability signal
    rule: Rule = EnvsSection.sampler_rule
    level: Level = EnvsSection.sampler_level
    families: Mapping[str, str] | None = None  # domain -> family (the run record's); needed for level="family"
    dump_c: float = EnvsSection.dump_c
    dump_temperature: float = EnvsSection.dump_temperature
    dump_window: int = 256  # samples per unit in DUMP's sliding window
    _rng: random.Random = field(init=False, repr=False)
    _order: dict[str, list[int]] = field(init=False, repr=False)
    _cursor: dict[str, int] = field(init=False, repr=False)
    _signal: dict[str, float] = field(init=False, repr=False)
    _window: dict[str, deque] = field(init=False, repr=False)
    _seen: dict[str, int] = field(init=False, repr=False)
    _restored: dict | None = field(init=False, repr=False, default=None)
    _unit: dict[str, str] = field(init=False, repr=False)     # domain -> its unit
    _base: dict[str, float] = field(init=False, repr=False)   # unit -> sum of its domains' base weights
    base_weights: dict[str, float] = field(init=False)

    def __post_init__(self) -> None:
        for d, w in self.weights.items():
            if w > 0 and not self.pools.get(d):
                raise ValueError(f"domain '{d}' has weight {w} but no tasks")
        if self.rule not in RULES:
            raise ValueError(f"sampler rule {self.rule!r} is not one of {', '.join(RULES)}")
        if self.level not in LEVELS:
            raise ValueError(f"sampler level {self.level!r} is not one of {', '.join(LEVELS)}")
        if self.level == "family" and not self.families:
            raise ValueError("sampler level 'family' needs the domain -> family map (the run record's families)")
        self.base_weights = dict(self.weights)
        self._unit = {d: self.unit_of(d) for d in self.base_weights}
        self._base = {}
        for d, w in self.base_weights.items():
            if w > 0:
                self._base[self._unit[d]] = self._base.get(self._unit[d], 0.0) + w
        self._rng = random.Random(self.seed)
        self._order, self._cursor = {}, {}
        self._signal = {u: 1.0 for u in self.units()}
        self._window = {u: deque(maxlen=self.dump_window) for u in self.units()}
        self._seen = {u: 0 for u in self.units()}
        for d in self.pools:
            self._reshuffle(d)

    def unit_of(self, domain: str) -> str:
        return (self.families or {}).get(domain, domain) if self.level == "family" else domain

    def units(self) -> list[str]:
        return sorted(self._base)

    def _reshuffle(self, d: str) -> None:
        idx = list(range(len(self.pools[d])))
        self._rng.shuffle(idx)
        self._order[d] = idx
        self._cursor[d] = 0

    def sample(self, n: int) -> list[T]:
        counts = systematic_apportion(self.weights, n, self._rng.random())
        out: list[T] = []
        for d in sorted(counts):
            for _ in range(counts[d]):
                if self._cursor[d] >= len(self._order[d]):
                    self._reshuffle(d)
                out.append(self.pools[d][self._order[d][self._cursor[d]]])
                self._cursor[d] += 1
        return out

    def observe(self, groups: Sequence[RolloutGroup]) -> None:
        """Feed this step's rollout groups; moves the weights when `adaptive` (see the module docstring)."""
        if not self.adaptive:
            return
        stats = {u: s for u, s in unit_stats(groups, self._unit).items() if u in self._signal}
        if self.rule == "dump":
            for u, s in stats.items():
                self._window[u].extend(s.abs_adv)
                self._seen[u] += len(s.abs_adv)
            score = self._ucb()
        else:
            for u, s in stats.items():
                x = 1.0 - s.zero_var_frac if self.rule == "variance" else learnability(s)
                self._signal[u] = self.ema * self._signal[u] + (1 - self.ema) * x
            score = {u: max(v, 0.0) * self._base[u] for u, v in self._signal.items()}
        self._set_unit_weights(score)

    def _ucb(self) -> dict[str, float]:
        """Softmax(UCB / temperature) per unit; units never observed share the mass first (UCB = inf)."""
        total = sum(self._seen.values())
        ucb = {}
        for u in self._signal:
            n_u = self._seen[u]
            if n_u == 0:
                ucb[u] = math.inf
            else:
                w = self._window[u]
                ucb[u] = sum(w) / len(w) + self.dump_c * math.sqrt(2.0 * math.log(max(total, 1)) / n_u)
        unexplored = [u for u, v in ucb.items() if v == math.inf]
        if unexplored:
            return {u: 1.0 if u in unexplored else 0.0 for u in ucb}
        top = max(ucb.values())
        return {u: math.exp((v - top) / self.dump_temperature) for u, v in ucb.items()}

    def _set_unit_weights(self, score: Mapping[str, float]) -> None:
        k = len(score)
        if k == 0:
            return
        tot = sum(score.values())
        floor = min(self.min_weight, 1.0 / k)
        unit_w = {u: 1.0 / k for u in score} if tot <= 0 else {u: floor + (1 - floor * k) * v / tot for u, v in score.items()}
        self.weights = {d: (unit_w[self._unit[d]] * w / self._base[self._unit[d]] if w > 0 else 0.0)
                        for d, w in self.base_weights.items()}

    def state_dict(self) -> dict:
        return {"rng": self._rng.getstate(), "order": {k: list(v) for k, v in self._order.items()},
                "cursor": dict(self._cursor), "signal": dict(self._signal), "weights": dict(self.weights),
                "window": {u: list(w) for u, w in self._window.items()}, "seen": dict(self._seen)}

    def reconfigured(self, **changes) -> "DomainSampler[T]":
        """The same sampler (pools, base weights, and its state: cursors, rng, weights, statistics) under
        other rule settings, e.g. `rule="dump", level="family", families=...`. A state restored from a
        checkpoint is carried over as it was saved, so a resumed run keeps its statistics."""
        kw = {k: getattr(self, k) for k in ("seed", "adaptive", "min_weight", "ema", "rule", "level", "families",
                                            "dump_c", "dump_temperature", "dump_window")}
        new = DomainSampler(self.pools, dict(self.base_weights), **{**kw, **changes})
        new.load_state_dict(self._restored if self._restored is not None else self.state_dict())
        return new

    def load_state_dict(self, s: dict) -> None:
        self._restored = s
        st = s["rng"]
        self._rng.setstate((st[0], tuple(st[1]), st[2]) if isinstance(st, list) else st)
        self._order = {k: list(v) for k, v in s["order"].items()}
        self._cursor = dict(s["cursor"])
        self._signal = {**self._signal, **{k: v for k, v in s["signal"].items() if k in self._signal}}
        self.weights = dict(s["weights"])
        for u, w in s.get("window", {}).items():  # absent in checkpoints written before the dump rule
            if u in self._window:
                self._window[u].extend(w)
        self._seen.update({u: n for u, n in s.get("seen", {}).items() if u in self._seen})
