"""Slow, obvious references for rl/algos, written from the formulas with Python loops and floats.

These are the test oracles: each walks sequences and tokens one at a time, with no vectorisation and
no shared code with rl/algos, so a bug has to be made twice, differently, to go unnoticed.
Also `random_batch`: ragged multi-turn batches (prompt, several turns separated by tool-output
tokens, padding holding NaN garbage), several groups and domains.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


# ----------------------------------------------------------------------------- random batches
@dataclass(frozen=True)
class Batch:
    mask_BT: torch.Tensor  # bool
    group_ids_B: torch.Tensor
    domain_ids_B: torch.Tensor
    rewards_B: torch.Tensor
    logprobs_BT: torch.Tensor  # NaN off the mask (padding garbage)
    old_logprobs_BT: torch.Tensor
    rollout_logprobs_BT: torch.Tensor
    values_BT: torch.Tensor
    adv_BT: torch.Tensor


def random_batch(seed: int, n_groups: int = 5, group_size: int = 4, n_domains: int = 3, T: int = 24, empty_row: bool = True) -> Batch:
    g = torch.Generator().manual_seed(seed)
    B = n_groups * group_size
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        t = int(torch.randint(1, 5, (1,), generator=g))  # prompt
        end = int(torch.randint(t + 1, T + 1, (1,), generator=g))
        while t < end:  # alternate generated turns and tool outputs
            n_gen = int(torch.randint(1, 6, (1,), generator=g))
            mask[b, t : min(end, t + n_gen)] = True
            t += n_gen + int(torch.randint(0, 4, (1,), generator=g))
    if empty_row:
        mask[B - 1] = False  # a sequence that generated nothing (engine error) must not break anything
    group_ids = torch.arange(n_groups).repeat_interleave(group_size) * 7 + 3  # non-contiguous ids
    domain_of_group = torch.randint(0, n_domains, (n_groups,), generator=g)
    domain_of_group[: min(n_domains, n_groups)] = torch.arange(min(n_domains, n_groups))
    domain_ids = domain_of_group.repeat_interleave(group_size) * 10
    rewards = torch.randint(0, 3, (B,), generator=g).double() / 2
    rewards[:group_size] = 1.0  # one zero-variance group
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    roll = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    lp, old, roll = (torch.where(mask, x, nan) for x in (lp, old, roll))
    values = torch.where(mask, torch.randn(B, T, generator=g, dtype=torch.float64), nan)
    adv = torch.where(mask, torch.randn(B, T, generator=g, dtype=torch.float64), torch.zeros((), dtype=torch.float64))
    return Batch(mask, group_ids, domain_ids, rewards, lp, old, roll, values, adv)


def tolist2(x: torch.Tensor) -> list[list[float]]:
    return [[float(v) for v in row] for row in x]


def positions(mask_BT: torch.Tensor, b: int) -> list[int]:
    return [t for t in range(mask_BT.shape[1]) if bool(mask_BT[b, t])]


# ----------------------------------------------------------------------------- advantages
def ref_grpo(rewards: list[float], groups: list[int], norm_std: bool, eps: float = 1e-6) -> list[float]:
    out = []
    for i in range(len(rewards)):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        mean = sum(members) / len(members)
        if len(members) > 1:
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
        else:
            std = 0.0
        a = rewards[i] - mean
        out.append(a / (std + eps) if norm_std else a)
    return out


def ref_rloo(rewards: list[float], groups: list[int]) -> list[float]:
    out = []
    for i in range(len(rewards)):
        others = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i] and j != i]
        out.append(rewards[i] - sum(others) / len(others) if others else 0.0)
    return out


def ref_gae(token_rewards: list[list[float]], values: list[list[float]], mask_BT: torch.Tensor, gamma: float, lam: float) -> list[list[float]]:
    """A_k = sum_l (gamma*lam)^l delta_{k+l} over the generated tokens of each row (the definition, not the recursion)."""
    B, T = mask_BT.shape
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        pos = positions(mask_BT, b)
        n = len(pos)
        r = [token_rewards[b][t] for t in pos]
        v = [values[b][t] for t in pos]
        delta = [r[k] + gamma * (v[k + 1] if k + 1 < n else 0.0) - v[k] for k in range(n)]
        for k in range(n):
            out[b][pos[k]] = sum((gamma * lam) ** l * delta[k + l] for l in range(n - k))
    return out


def ref_outcome_rewards(rewards: list[float], mask_BT: torch.Tensor) -> list[list[float]]:
    B, T = mask_BT.shape
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        pos = positions(mask_BT, b)
        if pos:
            out[b][pos[-1]] = rewards[b]
    return out


def ref_reinforce_pp(token_rewards: list[list[float]], mask_BT: torch.Tensor, gamma: float, normalize: bool, eps: float = 1e-6) -> list[list[float]]:
    B, T = mask_BT.shape
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        pos = positions(mask_BT, b)
        for k in range(len(pos)):
            ret[b][pos[k]] = sum(gamma**l * token_rewards[b][pos[k + l]] for l in range(len(pos) - k))
    if not normalize:
        return ret
    vals = [ret[b][t] for b in range(B) for t in positions(mask_BT, b)]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((x - mean) ** 2 for x in vals) / len(vals))
    return [[(ret[b][t] - mean) / (std + eps) if bool(mask_BT[b, t]) else 0.0 for t in range(T)] for b in range(B)]


# ----------------------------------------------------------------------------- aggregation
def ref_aggregate(loss: list[list[float]], mask_BT: torch.Tensor, mode: str, domains: list[int] | None = None, domain_weights: dict[int, float] | None = None) -> float:
    B, T = mask_BT.shape
    rows = [[loss[b][t] for t in positions(mask_BT, b)] for b in range(B)]
    if mode == "token_mean":
        toks = [x for r in rows for x in r]
        return sum(toks) / len(toks)
    if mode == "seq_mean_token_sum":
        sums = [sum(r) for r in rows if r]
        return sum(sums) / len(sums)
    if mode == "seq_mean_token_mean":
        means = [sum(r) / len(r) for r in rows if r]
        return sum(means) / len(means)
    if mode == "domain_token_mean":
        assert domains is not None
        per_domain: dict[int, list[float]] = {}
        for b in range(B):
            per_domain.setdefault(domains[b], []).extend(rows[b])
        present = {d: toks for d, toks in per_domain.items() if toks}
        w = {d: (domain_weights[d] if domain_weights else 1.0) for d in present}
        total_w = sum(w.values())
        return sum(w[d] / total_w * sum(toks) / len(toks) for d, toks in present.items())
    raise ValueError(mode)


# ----------------------------------------------------------------------------- policy losses (per token)
def clip(x: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, x))


def ref_ppo_token(lp: float, old: float, a: float, cl: float, ch: float) -> float:
    r = math.exp(lp - old)
    return -min(r * a, clip(r, 1 - cl, 1 + ch) * a)


def ref_ppo_token_grad(lp: float, old: float, a: float, cl: float, ch: float) -> float:
    """d loss / d lp: the unclipped branch gives -r*A; a clipped (constant) branch gives 0."""
    r = math.exp(lp - old)
    if r * a <= clip(r, 1 - cl, 1 + ch) * a:
        return -r * a
    return 0.0


def ref_dual_clip_token(lp: float, old: float, a: float, cl: float, ch: float, c: float) -> float:
    r = math.exp(lp - old)
    obj = min(r * a, clip(r, 1 - cl, 1 + ch) * a)
    if a < 0:
        obj = max(obj, c * a)
    return -obj


def ref_dual_clip_token_grad(lp: float, old: float, a: float, cl: float, ch: float, c: float) -> float:
    """The dual bound -c*A is a constant: where it is the active branch the gradient is 0."""
    if a < 0 and ref_ppo_token(lp, old, a, cl, ch) > -c * a:
        return 0.0
    return ref_ppo_token_grad(lp, old, a, cl, ch)


def ref_cispo_token(lp: float, old: float, a: float, cl: float, ch: float) -> tuple[float, float]:
    """(value, d/d lp) of CISPO: the value is -clip(r)*A; the gradient sg(clip(r)) * A * grad log pi, negated."""
    r = math.exp(lp - old)
    w = clip(r, 1 - cl, 1 + ch)
    return -w * a, -w * a


def ref_gspo_tokens(lps: list[float], olds: list[float], advs: list[float], cl: float, ch: float) -> list[float]:
    s = math.exp(sum(l - o for l, o in zip(lps, olds)) / len(lps))
    return [-min(s * a, clip(s, 1 - cl, 1 + ch) * a) for a in advs]


# ----------------------------------------------------------------------------- KL, off-policy, value
def ref_kl(lp: float, ref: float, estimator: str) -> float:
    log_r = ref - lp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    return math.exp(log_r) - 1 - log_r


def ref_value_token(v: float, old: float, ret: float, c: float) -> float:
    v_clip = old + clip(v - old, -c, c)
    return 0.5 * max((v - ret) ** 2, (v_clip - ret) ** 2)


# ----------------------------------------------------------------------------- router
def ref_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [x / s for x in e]


def ref_load_balance(logits_LNE: torch.Tensor, ids_LNK: torch.Tensor, mask_N: list[bool], count_per: str, layer_reduction: str) -> float:
    L, N, E = logits_LNE.shape
    K = ids_LNK.shape[2]
    real = [n for n in range(N) if mask_N[n]]
    per_layer_counts, per_layer_probs = [], []
    for l in range(L):
        counts = [0.0] * E
        probs = [0.0] * E
        for n in real:
            for j in range(K):
                counts[int(ids_LNK[l, n, j])] += 1
            p = ref_softmax([float(x) for x in logits_LNE[l, n]])
            for i in range(E):
                probs[i] += p[i]
        per_layer_counts.append(counts)
        per_layer_probs.append(probs)
    div = K if count_per == "assignment" else 1
    if layer_reduction == "mean":
        total = 0.0
        for l in range(L):
            f = [c / (len(real) * div) for c in per_layer_counts[l]]
            P = [p / len(real) for p in per_layer_probs[l]]
            total += E * sum(f[i] * P[i] for i in range(E))
        return total / L
    f = [sum(per_layer_counts[l][i] for l in range(L)) / (len(real) * L * div) for i in range(E)]
    P = [sum(per_layer_probs[l][i] for l in range(L)) / (len(real) * L) for i in range(E)]
    return E * sum(f[i] * P[i] for i in range(E))


def ref_z_loss(logits_LNE: torch.Tensor, mask_N: list[bool]) -> float:
    L, N, E = logits_LNE.shape
    vals = []
    for l in range(L):
        for n in range(N):
            if mask_N[n]:
                xs = [float(x) for x in logits_LNE[l, n]]
                m = max(xs)
                lse = m + math.log(sum(math.exp(x - m) for x in xs))
                vals.append(lse**2)
    return sum(vals) / len(vals)


def ref_whiten(x_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float = 1e-8) -> list[list[float]]:
    """PPO advantage whitening from the formula: over the generated tokens, (x - mean) / sqrt(var + eps),
    var with Bessel's correction (n - 1); 0 off the mask."""
    vals = [float(x_BT[b, t]) for b in range(x_BT.shape[0]) for t in range(x_BT.shape[1]) if bool(mask_BT[b, t])]
    n = len(vals)
    mean = sum(vals) / n if n else 0.0
    var = sum((v - mean) ** 2 for v in vals) / max(n - 1, 1)
    return [[(float(x_BT[b, t]) - mean) / math.sqrt(var + eps) if bool(mask_BT[b, t]) else 0.0
             for t in range(x_BT.shape[1])] for b in range(x_BT.shape[0])]
