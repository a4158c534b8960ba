"""Loss aggregation: how per-token losses `loss_BT` become one scalar, as a parameter of every loss.

What it does: each mode is a function of the mask (and domain ids) only, returning per-token weights
`weights_BT` with loss = sum_t weights_BT * loss_BT. Modes (registry `AGGREGATIONS`):

- `token_mean`: every generated token of the batch weighs the same, 1/N_tokens (DAPO, Yu et al.
  2025, arXiv:2503.14476: long sequences are not down-weighted per token).
- `seq_mean_token_sum`: sum over a sequence's tokens, mean over sequences (Dr. GRPO, Liu et al.
  2025, arXiv:2503.20783, up to its constant normaliser: no per-sequence length division).
- `seq_mean_token_mean`: mean over a sequence's tokens, mean over sequences (the original GRPO
  objective, Shao et al. 2024; and GSPO's sequence-level objective, Zheng et al. 2025).
- `domain_token_mean`: token mean inside each domain, then a weighted mean over the domains present
  (equal weights unless given). Under `token_mean`, a domain with long trajectories (SWE) owns most
  tokens and so most of the gradient; here each domain's share of the gradient is its domain weight,
  whatever its lengths. The shares are reported as metrics (`agg/domain_share/<domain>`).

Why weights, not a reduced scalar: the weights depend only on masks, so a trainer that accumulates
gradients over micro-batches (or data-parallel ranks) computes them once on the whole step batch,
slices them with the micro-batches, and sums `reduce(loss_BT, weights_BT, mask)` — which gives exactly
the full-batch aggregate. Sequences without any generated token count for nothing in any mode.
What it does not do: all-reduce token counts across ranks (pass the whole step's masks instead).
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import Tensor

from rl.algos._common import check_float, check_ids, check_mask, check_same_shape, masked_sum, segment_sum
from rl.algos.registry import Registry

Metrics = dict[str, float]
# (mask_BT bool, domain_ids_B or None, domain_weights or None, domain_names or None) -> (weights_BT, metrics)
AggregationFn = Callable[[Tensor, "Tensor | None", "Mapping[int, float] | None", "Mapping[int, str] | None"], "tuple[Tensor, Metrics]"]
AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation")


def aggregation_weights(
    mode: str,
    mask_BT: Tensor,
    *,
    domain_ids_B: Tensor | None = None,
    domain_weights: Mapping[int, float] | None = None,
    domain_names: Mapping[int, str] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Metrics]:
    """Per-token weights [B, T] (0 off the mask, constant: no gradient) for aggregation `mode`."""
    fn = AGGREGATIONS.get(mode)
    mask = check_mask("mask_BT", mask_BT)
    if domain_ids_B is not None:
        check_ids("domain_ids_B", domain_ids_B, mask.shape[0])
    w_BT, metrics = fn(mask, domain_ids_B, domain_weights, domain_names)
    return w_BT.to(dtype), metrics


def reduce(loss_BT: Tensor, weights_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """sum over generated tokens of weights_BT * loss_BT (garbage off the mask is ignored, even NaN)."""
    mask = check_mask("mask_BT", mask_BT)
    check_same_shape(loss_BT=loss_BT, weights_BT=weights_BT, mask_BT=mask)
    check_float("loss_BT", loss_BT)
    return masked_sum(loss_BT * weights_BT.to(loss_BT.dtype), mask)


def aggregate(
    loss_BT: Tensor,
    mask_BT: Tensor,
    mode: str,
    *,
    domain_ids_B: Tensor | None = None,
    domain_weights: Mapping[int, float] | None = None,
    domain_names: Mapping[int, str] | None = None,
) -> tuple[Tensor, Metrics]:
    """One call: weights for `mode` on this batch, then the weighted sum. Returns (scalar, metrics)."""
    w_BT, metrics = aggregation_weights(
        mode, mask_BT, domain_ids_B=domain_ids_B, domain_weights=domain_weights, domain_names=domain_names, dtype=loss_BT.dtype
    )
    return reduce(loss_BT, w_BT, mask_BT), metrics


# ----------------------------------------------------------------------------- modes
def _zeros(mask: Tensor) -> Tensor:
    return torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)


@AGGREGATIONS.register("token_mean")
def _token_mean(mask: Tensor, domain_ids_B: Tensor | None, domain_weights: Mapping[int, float] | None, domain_names: Mapping[int, str] | None) -> tuple[Tensor, Metrics]:
    n = mask.sum()
    w_BT = torch.where(mask, 1.0 / n.clamp(min=1).double(), _zeros(mask))
    return w_BT, {"agg/num_tokens": float(n)}


def _seq_weights(mask: Tensor, per_token_mean: bool) -> tuple[Tensor, Metrics]:
    len_B = mask.sum(dim=1).double()
    n_seq = (len_B > 0).sum().clamp(min=1).double()
    per_row_B = 1.0 / (n_seq * (len_B.clamp(min=1) if per_token_mean else torch.ones_like(len_B)))
    w_BT = torch.where(mask, per_row_B[:, None], _zeros(mask))
    return w_BT, {"agg/num_sequences": float((len_B > 0).sum()), "agg/num_tokens": float(len_B.sum())}


@AGGREGATIONS.register("seq_mean_token_sum")
def _seq_mean_token_sum(mask: Tensor, domain_ids_B: Tensor | None, domain_weights: Mapping[int, float] | None, domain_names: Mapping[int, str] | None) -> tuple[Tensor, Metrics]:
    return _seq_weights(mask, per_token_mean=False)


@AGGREGATIONS.register("seq_mean_token_mean")
def _seq_mean_token_mean(mask: Tensor, domain_ids_B: Tensor | None, domain_weights: Mapping[int, float] | None, domain_names: Mapping[int, str] | None) -> tuple[Tensor, Metrics]:
    return _seq_weights(mask, per_token_mean=True)


@AGGREGATIONS.register("domain_token_mean")
def _domain_token_mean(mask: Tensor, domain_ids_B: Tensor | None, domain_weights: Mapping[int, float] | None, domain_names: Mapping[int, str] | None) -> tuple[Tensor, Metrics]:
    """Token mean per domain, then sum_d share_d * mean_d with share_d = w_d / sum of w over domains present."""
    if domain_ids_B is None:
        raise ValueError("aggregation 'domain_token_mean' needs domain_ids_B (int [B], one domain id per sequence); got None")
    uniq_D, inv_B = torch.unique(domain_ids_B, return_inverse=True)
    D = int(uniq_D.numel())
    tokens_D = segment_sum(mask.sum(dim=1).double(), inv_B, D)
    ids = [int(i) for i in uniq_D.tolist()]
    if domain_weights is not None:
        for d, w in domain_weights.items():
            if not (w >= 0):
                raise ValueError(f"domain_weights[{d}] = {w} must be >= 0")
        missing = [d for d in ids if d not in domain_weights]
        if missing:
            raise ValueError(f"domain_weights has no weight for domain id(s) {missing} present in domain_ids_B (given: {sorted(domain_weights)})")
        raw_D = torch.tensor([float(domain_weights[d]) for d in ids], dtype=torch.float64, device=mask.device)
    else:
        raw_D = torch.ones(D, dtype=torch.float64, device=mask.device)
    present_D = tokens_D > 0  # a domain whose sequences generated nothing takes no share
    raw_D = torch.where(present_D, raw_D, torch.zeros_like(raw_D))
    total = raw_D.sum()
    if float(total) <= 0 and bool(present_D.any()):
        raise ValueError("domain_weights: every domain present in the batch has weight 0")
    share_D = raw_D / total.clamp(min=1e-300)
    per_token_D = share_D / tokens_D.clamp(min=1)
    w_BT = torch.where(mask, per_token_D[inv_B][:, None], _zeros(mask))
    metrics: Metrics = {"agg/num_tokens": float(tokens_D.sum()), "agg/num_domains": float(present_D.sum())}
    for k, d in enumerate(ids):
        label = domain_names.get(d, str(d)) if domain_names else str(d)
        metrics[f"agg/domain_share/{label}"] = float(share_D[k])
        metrics[f"agg/domain_tokens/{label}"] = float(tokens_D[k])
        # the share `token_mean` would have given this domain, for comparison in dashboards
        metrics[f"agg/domain_token_frac/{label}"] = float(tokens_D[k] / tokens_D.sum().clamp(min=1))
    return w_BT, metrics
