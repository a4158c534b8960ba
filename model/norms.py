"""RMSNorm variants used by the hybrid MoE, with Qwen3-Next's exact conventions.

- `ZeroCenteredRMSNorm`: y = x / rms(x) * (1 + w), w initialised to 0 (Qwen3-Next's `Qwen3NextRMSNorm`; the
  "zero-centred" weight keeps weight decay from shrinking the scale towards 0). Used for the decoder-layer norms,
  the final norm and the per-head q/k norms of attention.
- `GatedRMSNorm`: y = (x / rms(x) * w) * SiLU(z), w initialised to 1 (Qwen3-Next's `Qwen3NextRMSNormGated`, the
  delta layer's output norm "norm(o)·SiLU(z)").

Both compute the statistics in float32 and return the input dtype. Nothing else lives here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ZeroCenteredRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # (x * (1 + w)) in fp32 then cast, as Qwen3-Next does (not Llama's cast-then-scale).
        return (y * (1.0 + self.weight.float())).type_as(x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * y.to(dtype)  # norm before gate, weight applied in the input dtype (Qwen3-Next / FLA)
        return (y * F.silu(gate.float())).to(dtype)
