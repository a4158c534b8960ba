"""Per-domain Mixture-of-Experts telemetry: which experts each domain's tokens use, and how the router behaves.

What it computes, from one (micro-)batch's routes and router logits plus each token's domain id:
  * expert load per (domain, layer, expert), normalised so 1.0 = the expert's uniform share
        load[d, l, e] = E * count[d, l, e] / (K * n_d)
    (count = how many of the K slots of domain d's real tokens went to expert e in MoE layer l);
  * maximal violation per layer (MaxVio, Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy
    for Mixture-of-Experts", arXiv:2408.15664, sec. 4.1):  MaxVio = (max_e Load_e - mean_e Load_e) / mean_e Load_e,
    which with the normalisation above is max_e load[d, l, e] - 1;
  * router entropy: mean over real tokens of H(p) = -sum_e p_e log p_e, p = softmax(logits) (sigmoid scoring:
    p = sigmoid(logits) / sum sigmoid(logits), the distribution DeepSeek-V3's gates normalise over);
  * the router loss values restricted to each domain's tokens: Switch load-balance aux
    (Fedus et al. 2021, arXiv:2101.03961, eq. 4: E * sum_e f_e * P_e per layer, averaged over layers, f counted
    per assignment — the same normalisation as rl/algos/router.py's default) and ST-MoE z-loss
    (Zoph et al. 2022, arXiv:2202.08906, eq. 5: mean logsumexp(logits)^2);
  * routing-replay mismatch: how often the routes replayed from the inference engine (R3) differ from the
    routes the trainer's own router would pick — per (token, layer) the fraction of the K expert slots not
    shared (`replay_mismatch`) and whether the sets differ at all (`replay_token_mismatch`);
  * expert-domain mutual information I(expert; domain) per layer (nats, averaged over layers): 0 when every
    domain uses experts in the same proportions, up to log(D) when each domain has its own experts.

Exact inputs (the trainer's forward gives all of them; see `stats_from_forward`):
  routes_LNK        long [L, N, K]  expert ids the forward used (the replayed ones under R2/R3); N = B*T row-major;
                                    entries at masked-out positions are ignored (may be -1)
  domain_ids_N      long [N]        index into `domains` of each token's episode (`token_domain_ids(domain_ids_B, T)`)
  token_mask_N      bool [N]        1 on real tokens (attention mask), 0 on padding; None = all real
  router_logits_LNE float [L, N, E] optional (or a per-layer sequence of [N, E], as HF models return); without it
                                    entropy, aux and z are not reported
  fresh_routes_LNK  long [L, N, K]  optional: the trainer router's own choice on the same tokens (`fresh_routes`);
                                    with it, the replay mismatch against `routes_LNK` is reported

Design: `moe_batch_stats` reduces a micro-batch to additive sufficient statistics (`MoeBatchStats`, numpy
float64 sums); micro-batches and ranks combine with `+` / `all_reduce_stats`, so the step's metrics are exact,
not averages of averages. `moe_metrics` turns the sums into `<family>/<stat>/<domain>` floats (plus `/all`).
What it does not do: change routing, compute gradients, or know which model produced the tensors — pure
torch/numpy, no config, no Ray/DeepSpeed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Literal, Sequence

import numpy as np
import torch
from torch import Tensor

from rl.observe import names

Scoring = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class MoeBatchStats:
    """Additive sums over real tokens, split by domain (D), MoE layer (L) and expert (E). Shapes in names."""

    domains: tuple[str, ...]
    num_experts: int
    top_k: int
    tokens_D: np.ndarray  # real tokens per domain (each token is routed once per layer)
    counts_DLE: np.ndarray  # expert assignments (K per token per layer)
    has_logits: bool = False
    prob_sum_DLE: np.ndarray | None = None  # sum of router probabilities (P of the aux loss, times n)
    entropy_sum_DL: np.ndarray | None = None  # sum of per-token router entropies (nats)
    z_sum_DL: np.ndarray | None = None  # sum of logsumexp(logits)^2
    has_replay: bool = False
    mismatch_slots_DL: np.ndarray | None = None  # sum over tokens of (K - |replayed ∩ fresh|)
    mismatch_tokens_DL: np.ndarray | None = None  # tokens whose replayed set != fresh set

    @property
    def num_layers(self) -> int:
        return int(self.counts_DLE.shape[1])

    def __add__(self, other: "MoeBatchStats") -> "MoeBatchStats":
        if not isinstance(other, MoeBatchStats):
            return NotImplemented
        if (self.domains, self.num_experts, self.top_k, self.num_layers) != (other.domains, other.num_experts, other.top_k, other.num_layers):
            raise ValueError(
                "MoeBatchStats.__add__: incompatible stats "
                f"(domains {self.domains} vs {other.domains}, E {self.num_experts} vs {other.num_experts}, "
                f"K {self.top_k} vs {other.top_k}, L {self.num_layers} vs {other.num_layers})")
        if self.has_logits != other.has_logits or self.has_replay != other.has_replay:
            raise ValueError("MoeBatchStats.__add__: one side has router logits / replay routes and the other does not; "
                             "pass the same optional inputs for every micro-batch")
        kw = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray):
                kw[f.name] = a + b
        return replace(self, **kw)


def token_domain_ids(domain_ids_B: Tensor, T: int) -> Tensor:
    """Per-sequence domain ids [B] -> per-token ids [B*T] (row-major, matching the model's N = B*T)."""
    if domain_ids_B.ndim != 1:
        raise ValueError(f"domain_ids_B must be 1-D [B], got shape {tuple(domain_ids_B.shape)}")
    return domain_ids_B.long().repeat_interleave(int(T))


def _as_LNX(name: str, x: Tensor | Sequence[Tensor]) -> Tensor:
    if isinstance(x, Tensor):
        if x.ndim != 3:
            raise ValueError(f"{name} must be [L, N, X], got shape {tuple(x.shape)}")
        return x
    if not isinstance(x, (list, tuple)) or not x:
        raise TypeError(f"{name}: expected a tensor [L, N, X] or a non-empty sequence of [N, X] tensors, got {type(x).__name__}")
    for i, t in enumerate(x):
        if not isinstance(t, Tensor) or t.ndim != 2 or t.shape != x[0].shape:
            raise ValueError(f"{name}[{i}] must be a [N, X] tensor shaped like {name}[0] {tuple(x[0].shape)}")
    return torch.stack(list(x))


def router_probs(logits_LNE: Tensor, scoring: Scoring = "softmax") -> Tensor:
    """The router's distribution over experts [L, N, E] in float32/64 (see module docstring for sigmoid)."""
    x = logits_LNE.to(torch.float64 if logits_LNE.dtype == torch.float64 else torch.float32)
    if scoring == "softmax":
        return torch.softmax(x, dim=-1)
    if scoring == "sigmoid":
        s = torch.sigmoid(x)
        return s / s.sum(-1, keepdim=True).clamp_min(1e-30)
    raise ValueError(f"scoring={scoring!r}; allowed: 'softmax', 'sigmoid'")


def fresh_routes(router_logits: Tensor | Sequence[Tensor], top_k: int, *, scoring: Scoring = "softmax",
                 bias_LE: Tensor | None = None) -> Tensor:
    """What the trainer's router picks on its own [L, N, K]: top-k of the scores (+ the aux-free bias, which
    shifts the selection only, as in model/moe.py `route`). For softmax routers this is top-k of the logits."""
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring={scoring!r}; allowed: 'softmax', 'sigmoid'")
    logits_LNE = _as_LNX("router_logits", router_logits)
    x = logits_LNE.float()
    scores = torch.softmax(x, -1) if scoring == "softmax" else torch.sigmoid(x)
    if bias_LE is not None:
        if bias_LE.shape != (logits_LNE.shape[0], logits_LNE.shape[2]):
            raise ValueError(f"bias_LE must be [L, E] = {[logits_LNE.shape[0], logits_LNE.shape[2]]}, got {list(bias_LE.shape)}")
        scores = scores + bias_LE.float()[:, None, :]
    return scores.topk(top_k, dim=-1).indices


@torch.no_grad()
def moe_batch_stats(
    routes_LNK: Tensor,
    domain_ids_N: Tensor,
    domains: Sequence[str],
    num_experts: int,
    *,
    token_mask_N: Tensor | None = None,
    router_logits: Tensor | Sequence[Tensor] | None = None,
    scoring: Scoring = "softmax",
    fresh_routes_LNK: Tensor | None = None,
) -> MoeBatchStats:
    """Reduce one micro-batch to per-domain sums (see the module docstring for the exact inputs)."""
    domains = tuple(domains)
    D, E = len(domains), int(num_experts)
    if D == 0:
        raise ValueError("moe_batch_stats: `domains` is empty")
    if E <= 0:
        raise ValueError(f"moe_batch_stats: num_experts must be > 0, got {num_experts}")
    if not isinstance(routes_LNK, Tensor) or routes_LNK.ndim != 3:
        raise ValueError(f"routes_LNK must be a [L, N, K] tensor, got {getattr(routes_LNK, 'shape', type(routes_LNK).__name__)}")
    if routes_LNK.is_floating_point() or routes_LNK.dtype == torch.bool:
        raise TypeError(f"routes_LNK must hold integer expert ids, got {routes_LNK.dtype}")
    L, N, K = routes_LNK.shape
    dev = routes_LNK.device
    if domain_ids_N.shape != (N,):
        raise ValueError(f"domain_ids_N must be [N={N}] (one id per token of routes_LNK), got {tuple(domain_ids_N.shape)}")
    mask_N = torch.ones(N, dtype=torch.bool, device=dev) if token_mask_N is None else token_mask_N.reshape(-1).to(dev).bool()
    if mask_N.shape != (N,):
        raise ValueError(f"token_mask_N must have N={N} entries, got {tuple(token_mask_N.shape)}")
    dom_N = domain_ids_N.to(dev).long()
    if bool(mask_N.any()):
        dm = dom_N[mask_N]
        if int(dm.min()) < 0 or int(dm.max()) >= D:
            raise ValueError(f"domain_ids_N out of range: ids in [{int(dm.min())}, {int(dm.max())}] but {D} domains {domains}")
        rm = routes_LNK[:, mask_N]
        if int(rm.min()) < 0 or int(rm.max()) >= E:
            raise ValueError(f"routes_LNK out of range on real tokens: ids in [{int(rm.min())}, {int(rm.max())}] but {E} experts")
    # Padding rows go to an extra "domain" D that is dropped at the end; their expert ids are clamped so
    # scatter never sees -1.
    dom_N = torch.where(mask_N, dom_N, torch.full_like(dom_N, D))
    routes = routes_LNK.long().clamp(0, E - 1)
    tokens_D = torch.bincount(dom_N, minlength=D + 1)[:D].double()
    # counts[d, l, e]: flat index ((d * L) + l) * E + e for every (l, n, k)
    l_idx = torch.arange(L, device=dev)[:, None, None]
    flat = ((dom_N[None, :, None] * L + l_idx) * E + routes).reshape(-1)
    counts_DLE = torch.bincount(flat, minlength=(D + 1) * L * E)[: D * L * E].double().reshape(D, L, E)

    # Everything below works on real tokens only (R of them): padding may hold garbage (NaN logits, -1 ids),
    # and per-domain sums become one matmul with a [R, D] one-hot instead of a scatter per statistic.
    real_R = mask_N.nonzero().squeeze(1)
    dom_R = dom_N.index_select(0, real_R)

    def per_domain_sum(v_LR: Tensor) -> Tensor:  # [L, R] -> [D, L] sums over each domain's real tokens
        onehot_RD = torch.nn.functional.one_hot(dom_R, D).to(v_LR.dtype)
        return (v_LR @ onehot_RD).T.double()

    kw: dict = {}
    if router_logits is not None:
        logits_LNE = _as_LNX("router_logits", router_logits)
        if logits_LNE.shape[:2] != (L, N) or logits_LNE.shape[2] != E:
            raise ValueError(f"router_logits has shape {tuple(logits_LNE.shape)}; expected [L={L}, N={N}, E={E}]")
        # fp32 like the routers themselves (bf16 logits are upcast); fp64 inputs stay fp64 (tests)
        cdt = torch.float64 if logits_LNE.dtype == torch.float64 else torch.float32
        lg_LRE = logits_LNE.index_select(1, real_R.to(logits_LNE.device)).to(device=dev, dtype=cdt)
        if scoring == "softmax":
            logp_LRE = torch.log_softmax(lg_LRE, dim=-1)
            p_LRE = logp_LRE.exp()
        else:
            p_LRE = router_probs(lg_LRE, scoring)
            logp_LRE = torch.log(p_LRE.clamp_min(1e-30))
        onehot_RD = torch.nn.functional.one_hot(dom_R, D).to(cdt)
        prob_LDE = onehot_RD.T[None] @ p_LRE  # [L, D, E]
        ent_LR = -(p_LRE * logp_LRE).sum(-1)
        lse_LR = torch.logsumexp(lg_LRE, dim=-1)
        kw.update(has_logits=True, prob_sum_DLE=prob_LDE.double().permute(1, 0, 2).cpu().numpy(),
                  entropy_sum_DL=per_domain_sum(ent_LR).cpu().numpy(), z_sum_DL=per_domain_sum(lse_LR * lse_LR).cpu().numpy())
    if fresh_routes_LNK is not None:
        if fresh_routes_LNK.shape != routes_LNK.shape:
            raise ValueError(f"fresh_routes_LNK has shape {tuple(fresh_routes_LNK.shape)}; expected {tuple(routes_LNK.shape)} like routes_LNK")
        fresh_LRK = fresh_routes_LNK.to(dev).long().index_select(1, real_R)
        routes_LRK = routes.index_select(1, real_R)
        # |A ∩ B| for top-k sets without duplicates: count slots of A found anywhere in B
        shared_LR = (routes_LRK[..., :, None] == fresh_LRK[..., None, :]).any(-1).sum(-1).double()
        kw.update(has_replay=True, mismatch_slots_DL=per_domain_sum(K - shared_LR).cpu().numpy(),
                  mismatch_tokens_DL=per_domain_sum((shared_LR < K).double()).cpu().numpy())
    return MoeBatchStats(domains=domains, num_experts=E, top_k=int(K), tokens_D=tokens_D.cpu().numpy(),
                         counts_DLE=counts_DLE.cpu().numpy(), **kw)


def stats_from_forward(batch, routes_LNK: Tensor, num_experts: int, *, router_logits: Sequence[Tensor] | Tensor | None = None,
                       scoring: Scoring = "softmax", fresh_routes_LNK: Tensor | None = None) -> MoeBatchStats:
    """`moe_batch_stats` for a trainer micro-batch (a `rl.trainer.batch.TrainBatch`: input_ids_BT,
    attention_mask_BT, domain_ids_B, domains) and what its forward returned (`routed_experts` [L, B*T, K],
    `router_logits` per layer [B*T, E])."""
    B, T = batch.input_ids_BT.shape
    return moe_batch_stats(routes_LNK, token_domain_ids(batch.domain_ids_B, T), batch.domains, num_experts,
                           token_mask_N=batch.attention_mask_BT.reshape(-1) > 0, router_logits=router_logits,
                           scoring=scoring, fresh_routes_LNK=fresh_routes_LNK)


_OPTIONAL_DL = ("entropy_sum_DL", "z_sum_DL", "mismatch_slots_DL", "mismatch_tokens_DL")


def empty_stats(domains: Sequence[str], num_layers: int, num_experts: int, top_k: int) -> MoeBatchStats:
    """Stats of no tokens: what a rank with only padding contributes to the step's sum."""
    D, L, E = len(domains), int(num_layers), int(num_experts)
    return MoeBatchStats(domains=tuple(domains), num_experts=E, top_k=int(top_k), tokens_D=np.zeros(D),
                         counts_DLE=np.zeros((D, L, E)))


def all_reduce_stats(stats: MoeBatchStats, group=None) -> MoeBatchStats:
    """Sum the stats over the ranks of `group` (torch.distributed must be initialised; a no-op otherwise).

    Every rank sends the same layout: each optional array (zeros where this rank has none) and the two
    flags, so ranks whose stats differ in what they hold (a rank with replayed routes beside one that ran
    only padding) still make one all_reduce of one size. An optional sum is kept where any rank had it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return stats
    D, L, E = len(stats.domains), stats.num_layers, stats.num_experts
    shapes = {"tokens_D": (D,), "counts_DLE": (D, L, E), "prob_sum_DLE": (D, L, E), **{n: (D, L) for n in _OPTIONAL_DL}}
    parts = [np.asarray(getattr(stats, n), dtype=np.float64).reshape(-1) if getattr(stats, n) is not None
             else np.zeros(int(np.prod(shape))) for n, shape in shapes.items()]
    parts.append(np.array([float(stats.has_logits), float(stats.has_replay)]))
    flat = torch.from_numpy(np.concatenate(parts))
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    out, i = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        out[name] = flat[i: i + size].numpy().reshape(shape)
        i += size
    has_logits, has_replay = bool(flat[i] > 0), bool(flat[i + 1] > 0)
    if not has_replay:
        out["mismatch_slots_DL"] = out["mismatch_tokens_DL"] = None
    if not has_logits:
        out["prob_sum_DLE"] = out["entropy_sum_DL"] = out["z_sum_DL"] = None
    return replace(stats, has_logits=has_logits, has_replay=has_replay, **out)


def _merged(stats: MoeBatchStats) -> MoeBatchStats:
    """All domains summed into one pseudo-domain 'all'."""
    kw = {f.name: getattr(stats, f.name).sum(0, keepdims=True) for f in fields(stats) if isinstance(getattr(stats, f.name), np.ndarray)}
    return replace(stats, domains=("all",), **kw)


def expert_load_DLE(stats: MoeBatchStats) -> np.ndarray:
    """load[d, l, e] = E * count / (K * n_d): 1.0 = uniform share; NaN for domains without tokens."""
    n = stats.tokens_D[:, None, None] * stats.top_k
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, stats.counts_DLE * stats.num_experts / np.where(n > 0, n, 1), np.nan)


def expert_domain_mi(stats: MoeBatchStats) -> float:
    """I(expert; domain) in nats from the joint assignment counts, averaged over layers."""
    mis = []
    for l in range(stats.num_layers):
        c_DE = stats.counts_DLE[:, l, :]
        tot = c_DE.sum()
        if tot <= 0:
            continue
        p = c_DE / tot
        pd, pe = p.sum(1, keepdims=True), p.sum(0, keepdims=True)
        nz = p > 0
        mis.append(float((p[nz] * np.log(p[nz] / (pd @ pe)[nz])).sum()))
    return float(np.mean(mis)) if mis else 0.0


def moe_metrics(stats: MoeBatchStats, *, per_layer: bool = True, per_expert: bool = True,
                per_layer_expert: bool = False) -> dict[str, float]:
    """Flat metrics, names `moe/<stat>/<domain>` (domain `all` = every domain's tokens together).

    Always: moe/tokens, moe/max_vio (mean over layers), moe/max_vio_worst (worst layer), and, when given,
    moe/router_entropy, moe/router_entropy_norm (/ log E), moe/aux_loss, moe/z_loss, moe/replay_mismatch,
    moe/replay_token_mismatch; plus moe/expert_domain_mi/all.
    per_layer: moe/max_vio_l{LL}; per_expert: moe/load_e{EEE} (layer-averaged load, the domain x expert
    heatmap); per_layer_expert: moe/load_l{LL}_e{EEE} (L*E*D values: off by default for big models).
    Domains without tokens in the stats are left out (no NaNs).
    """
    out: dict[str, float] = {}
    E, K, L = stats.num_experts, stats.top_k, stats.num_layers
    for s in (stats, _merged(stats)):
        load_DLE = expert_load_DLE(s)
        for d, name in enumerate(s.domains):
            n = float(s.tokens_D[d])
            if n <= 0:
                continue
            out[f"moe/tokens/{name}"] = n
            vio_L = load_DLE[d].max(-1) - 1.0  # MaxVio with mean load 1 by construction
            out[f"moe/max_vio/{name}"] = float(vio_L.mean())
            out[f"moe/max_vio_worst/{name}"] = float(vio_L.max())
            if per_layer:
                for l in range(L):
                    out[names.max_vio_layer(l, name)] = float(vio_L[l])
            if per_expert:
                for e in range(E):
                    out[names.moe_load(e, name)] = float(load_DLE[d, :, e].mean())
            if per_layer_expert:
                for l in range(L):
                    for e in range(E):
                        out[f"moe/load_l{l:02d}_e{e:03d}/{name}"] = float(load_DLE[d, l, e])
            if s.has_logits:
                assert s.prob_sum_DLE is not None and s.entropy_sum_DL is not None and s.z_sum_DL is not None
                ent = float(s.entropy_sum_DL[d].sum() / (n * L))
                out[f"moe/router_entropy/{name}"] = ent
                out[f"moe/router_entropy_norm/{name}"] = ent / math.log(E) if E > 1 else 0.0
                f_LE = s.counts_DLE[d] / (n * K)
                P_LE = s.prob_sum_DLE[d] / n
                out[f"moe/aux_loss/{name}"] = float((E * (f_LE * P_LE).sum(-1)).mean())
                out[f"moe/z_loss/{name}"] = float(s.z_sum_DL[d].sum() / (n * L))
            if s.has_replay:
                assert s.mismatch_slots_DL is not None and s.mismatch_tokens_DL is not None
                out[f"moe/replay_mismatch/{name}"] = float(s.mismatch_slots_DL[d].sum() / (n * L * K))
                out[f"moe/replay_token_mismatch/{name}"] = float(s.mismatch_tokens_DL[d].sum() / (n * L))
    out["moe/expert_domain_mi/all"] = expert_domain_mi(stats)
    return out


def moe_telemetry(routes_LNK: Tensor, domain_ids_N: Tensor, domains: Sequence[str], num_experts: int, **kw) -> dict[str, float]:
    """One-shot `moe_metrics(moe_batch_stats(...))` for a single batch (keyword args as in both)."""
    metric_kw = {k: kw.pop(k) for k in ("per_layer", "per_expert", "per_layer_expert") if k in kw}
    return moe_metrics(moe_batch_stats(routes_LNK, domain_ids_N, domains, num_experts, **kw), **metric_kw)


def router_biases(model: torch.nn.Module) -> Tensor | None:
    """[L, E] aux-loss-free selection biases (`e_score_correction_bias` buffers) of a model's MoE routers,
    in layer order (the order of `routed_experts`); None when the routers have none (HF Qwen3-MoE, Mixtral)."""
    bs = [m.e_score_correction_bias for m in model.modules() if isinstance(getattr(m, "e_score_correction_bias", None), Tensor)]
    return torch.stack([b.detach().float() for b in bs]) if bs else None


class MoeStepTelemetry:
    """The trainer's per-step accumulator: `add` each micro-batch after its forward, `finish` once per step.

    replayed=True (R2/R3 routes were fed to the forward) also records how the replayed routes differ from
    the trainer router's own choice (`fresh_routes` with `bias_LE`). `finish` sums over ranks when
    torch.distributed is up, returns `moe_metrics`, and resets.
    """

    def __init__(self, num_experts: int, *, scoring: Scoring = "softmax", bias_LE: Tensor | None = None,
                 per_layer: bool = True, per_expert: bool = True) -> None:
        self.num_experts, self.scoring, self.bias_LE = int(num_experts), scoring, bias_LE
        self.per_layer, self.per_expert = per_layer, per_expert
        self.stats: MoeBatchStats | None = None

    def add(self, batch, routes_LNK: Tensor, router_logits: Sequence[Tensor] | Tensor | None = None, *,
            replayed: bool = False, fresh_routes_LNK: Tensor | None = None) -> None:
        """`fresh_routes_LNK`: the router's own choice where the caller has it (HF routers record it, and it is
        exact for group-limited selection, which `fresh_routes` does not model); else it is recomputed."""
        fresh = fresh_routes_LNK if replayed else None
        if replayed and fresh is None and router_logits is not None:
            fresh = fresh_routes(router_logits, int(routes_LNK.shape[-1]), scoring=self.scoring, bias_LE=self.bias_LE)
        s = stats_from_forward(batch, routes_LNK, self.num_experts, router_logits=router_logits, scoring=self.scoring,
                               fresh_routes_LNK=fresh)
        self.stats = s if self.stats is None else self.stats + s

    def add_padding(self, domains: Sequence[str], routes_LNK: Tensor) -> None:
        """A padding micro-batch: adds no tokens, but gives a rank with only padding the stats' layout, so
        its `finish` joins the other ranks' all_reduce (a rank that skipped it would hang theirs)."""
        if self.stats is None:
            self.stats = empty_stats(domains, int(routes_LNK.shape[0]), self.num_experts, int(routes_LNK.shape[-1]))

    def finish(self, group=None) -> dict[str, float]:
        """The step's metrics summed over ranks. Under torch.distributed every rank must call it once per
        step, padding-only ranks included (`add_padding`)."""
        if self.stats is None:
            return {}
        st, self.stats = all_reduce_stats(self.stats, group), None
        return moe_metrics(st, per_layer=self.per_layer, per_expert=self.per_expert)
