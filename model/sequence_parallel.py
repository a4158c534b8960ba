"""Sequence parallelism inside the HybridMoe: what its token mixers do when a sequence is split over ranks.

A trainer with `trainer.sequence_parallel_size = N` (rl/trainer/ulysses.py) runs each micro-batch on N ranks, rank r
holding the positions [r * L, (r + 1) * L) of a sequence padded to N * L. It announces the split with
`sharded(SequenceShard(...))` around the forward and backward; the layers here read it with `current()`:

- Gated delta layers (model/delta.py) split by heads, as Ulysses does (Jacobs et al. 2023, "DeepSpeed Ulysses",
  arXiv:2309.14509): the causal conv reads its K - 1 positions of left context from the previous rank (`halo`),
  then one all-to-all turns [B, L, H, *] into [B, N * L, H / N, *], the chunked delta rule runs over the whole
  sequence for H / N heads, and a second all-to-all brings the outputs back to the rank's positions. The recurrence
  is per head, so this is the unsplit computation; it needs `linear_num_value_heads` divisible by N.
- Gated DSA layers (model/dsa.py) keep their queries and gather keys instead (`gather`): the lightning indexer sums
  its heads into one score per (query, key) pair and the top-k selection is over all heads at once, so the layer
  cannot split by heads without an all-reduce of [T, T] scores. Each rank gathers K, V and the indexer's keys of
  the positions before its last one and attends its own L queries to them, as a prefill with a cache of r * L
  positions does: scores and selections are [L, S] per rank, and the gathered K / V are what Ulysses holds anyway.
  The indexer loss is the sum over the rank's queries over the sequence's count of queries, so the ranks' losses
  add up to the unsplit mean.
- MoE blocks, norms and projections are per token and run on the rank's positions unchanged.

Collectives: `torch.distributed` all_gather, all_reduce and all_to_all_single over the shard's group; all three run
on gloo (CPU) and NCCL. Each has an autograd rule, and every rank of a group makes the same calls in the same order
(forward, backward, and an activation-checkpointed layer's recompute).

What this module does not do: split the batch or pick the group (rl/trainer/ulysses.py), split images (a sharded
forward takes text only), or hold a decoding cache (sharding is for training forwards).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

# Not thread-local: under CUDA the backward (and an activation-checkpointed layer's recompute in it) runs on
# autograd's device thread, which must see the shard of the forward it differentiates.
_CURRENT: list["SequenceShard"] = []


@dataclass(frozen=True)
class SequenceShard:
    """This rank's part of the sequences of the current forward."""

    group: Any  # the torch.distributed process group of the N ranks sharing each sequence
    rank: int  # this rank's index in `group`
    size: int  # N
    local: int  # L: positions per rank; the padded sequence has N * L
    rows: int  # B: rows of the micro-batch
    key_padding_BT: torch.Tensor | None  # the whole sequence's mask (1 = real token), None without padding

    @property
    def start(self) -> int:
        return self.rank * self.local

    @property
    def stop(self) -> int:
        return self.start + self.local


def current() -> SequenceShard | None:
    return _CURRENT[-1] if _CURRENT else None


@contextmanager
def sharded(shard: SequenceShard) -> Iterator[SequenceShard]:
    """Within the block the HybridMoe's layers run as rank `shard.rank` of a sequence split `shard.size` ways."""
    _CURRENT.append(shard)
    try:
        yield shard
    finally:
        _CURRENT.remove(shard)


class _Gather(torch.autograd.Function):
    """Concatenate every rank's `x` along `dim`. Backward: with `replicated` the ranks computed the same function of
    the result, so each already holds the whole gradient and keeps its own slice; otherwise each rank's result fed
    a different computation, and a slice's gradient is the sum over the ranks (an all-reduce)."""

    @staticmethod
    def forward(ctx, x, dim: int, group, rank: int, size: int, replicated: bool):
        x = x.contiguous()  # (empty_like keeps a view's strides; the collective writes densely)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        ctx.dim, ctx.group, ctx.rank, ctx.n, ctx.replicated = dim, group, rank, x.shape[dim], replicated
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.replicated:
            grad = grad.clone(memory_format=torch.contiguous_format)  # all_reduce works in place
            dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(ctx.dim, ctx.rank * ctx.n, ctx.n), None, None, None, None, None


def gather(x: torch.Tensor, dim: int, shard: SequenceShard, replicated: bool = False) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in rank order (differentiable; see `_Gather` for `replicated`)."""
    if not x.requires_grad:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(shard.size)]
        dist.all_gather(parts, x, group=shard.group)
        return torch.cat(parts, dim)
    return _Gather.apply(x, dim, shard.group, shard.rank, shard.size, replicated)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (one block per rank); the exchange is its own adjoint."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def heads_to_sequence(x_BLHX: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """[B, L, H, X] (this rank's positions, every head) -> [B, N * L, H / N, X] (every position, this rank's heads)."""
    B, L, H, X = x_BLHX.shape
    n = shard.size
    blocks = x_BLHX.reshape(B, L, n, H // n, X).permute(2, 0, 1, 3, 4)  # block j: head group j, to rank j
    got = _AllToAll.apply(blocks, shard.group)  # block i: rank i's positions of this rank's head group
    return got.permute(1, 0, 2, 3, 4).reshape(B, n * L, H // n, X)


def sequence_to_heads(y_BThX: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """The inverse of `heads_to_sequence`: [B, N * L, h, X] -> [B, L, N * h, X]."""
    B, T, h, X = y_BThX.shape
    n = shard.size
    blocks = y_BThX.reshape(B, n, T // n, h, X).permute(1, 0, 2, 3, 4)  # block j: positions of rank j
    got = _AllToAll.apply(blocks, shard.group)  # block i: this rank's positions of head group i
    return got.permute(1, 2, 0, 3, 4).reshape(B, T // n, n * h, X)


def halo(x_BCL: torch.Tensor, width: int, shard: SequenceShard) -> torch.Tensor:
    """The previous rank's last `width` positions of `x_BCL` ([B, C, width]; zeros on rank 0, which has none).
    Every rank joins the gather, and rank 0 keeps a zero-weighted use of it so that its backward joins too."""
    edges = gather(x_BCL[..., -width:], -1, shard)  # [B, C, N * width]
    prev = edges.narrow(-1, max(shard.rank - 1, 0) * width, width)
    return prev * 0.0 if shard.rank == 0 else prev


class ShardKeys:
    """Stands in for a DSA layer's cache in a sharded forward: `update` returns the keys and values of every position
    up to this rank's last (gathered from the ranks before it), so the layer attends its own queries as the last
    L of S = stop positions, the layout of a prefill after a cache."""

    def __init__(self, shard: SequenceShard) -> None:
        self.shard = shard

    def update(self, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        stop = self.shard.stop
        return gather(k_BHLD, 2, self.shard)[:, :, :stop], gather(v_BHLD, 2, self.shard)[:, :, :stop]

    def update_indexer(self, k_BLD: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return gather(k_BLD, 1, self.shard)[:, :self.shard.stop]

    def key_padding(self, B: int, device) -> torch.Tensor | None:
        """The padding mask of the S = stop positions this rank's queries may see."""
        kp = self.shard.key_padding_BT
        return None if kp is None else kp[:, :self.shard.stop].to(device).bool()

    def query_share(self, B: int) -> float:
        """This rank's real queries over the whole sequence's: the weight of its mean indexer loss."""
        kp, s = self.shard.key_padding_BT, self.shard
        if kp is None:
            return s.local / (s.size * s.local)
        total = float(kp.sum())
        return float(kp[:, s.start:s.stop].sum()) / max(total, 1.0)
