"""Shared checks and masked reductions for rl/algos (internal).

Conventions used by every function in the package:
- Padded tensors `[B, T]` with an explicit `mask_BT` (1 exactly on policy-generated tokens; 0 on
  prompt, template, tool-output and padding tokens). Masks may be bool or 0/1 numbers.
- Values at masked-out positions are never trusted: they may be garbage, even NaN or -inf (a padded
  logprob), so reductions select with `torch.where` instead of multiplying by the mask
  (`nan * 0 == nan`).
- Metrics are plain `dict[str, float]`, computed without gradient.
"""
from __future__ import annotations

import torch
from torch import Tensor


def check_tensor(name: str, x: object, ndim: int | None = None) -> Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_float(name: str, x: Tensor) -> Tensor:
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    return x


def check_same_shape(**tensors: Tensor) -> None:
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.shape != first.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but {first_name} has shape {tuple(first.shape)}; they must match")


def check_mask(name: str, mask: Tensor, ndim: int = 2) -> Tensor:
    """Validate a 0/1 mask and return it as bool (one device sync for the value check)."""
    check_tensor(name, mask, ndim)
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"{name}: complex masks are not allowed")
    if not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)].flatten()[:3].tolist()
        raise ValueError(f"{name}: mask values must be 0 or 1, found e.g. {bad}")
    return mask.bool()


def check_ids(name: str, ids: Tensor, length: int) -> Tensor:
    check_tensor(name, ids, 1)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise TypeError(f"{name}: expected an integer tensor, got dtype {ids.dtype}")
    if ids.shape[0] != length:
        raise ValueError(f"{name}: expected {length} entries (one per sequence), got {ids.shape[0]}")
    return ids


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    picked = torch.where(mask, x, zero)
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask (a scalar); 0 when the mask is empty."""
    n = mask.sum()
    return masked_sum(x, mask) / n.clamp(min=1)


def group_inverse(ids_B: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary integer ids to 0..n-1 (`inverse_B`) and return (inverse_B, n)."""
    uniq, inverse_B = torch.unique(ids_B, return_inverse=True)
    return inverse_B, int(uniq.numel())


def segment_sum(x_B: Tensor, inverse_B: Tensor, n: int) -> Tensor:
    out = torch.zeros(n, dtype=x_B.dtype, device=x_B.device)
    return out.index_add(0, inverse_B, x_B)


@torch.no_grad()
def stats(prefix: str, x: Tensor, mask: Tensor | None = None) -> dict[str, float]:
    """mean/std/min/max of x (over mask if given) as floats; empty selections give zeros."""
    v = x.detach().float()
    if mask is not None:
        v = v[mask]
    else:
        v = v.flatten()
    if v.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/std": 0.0, f"{prefix}/min": 0.0, f"{prefix}/max": 0.0}
    return {
        f"{prefix}/mean": float(v.mean()),
        f"{prefix}/std": float(v.std(unbiased=False)),
        f"{prefix}/min": float(v.min()),
        f"{prefix}/max": float(v.max()),
    }
