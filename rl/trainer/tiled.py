"""Per-token logprobs without the full-vocabulary logits: the LM head and log-softmax run in tiles of tokens.

An RL update needs log p(x_t | x_<t) of every loss-masked target. Computed from the model's logits that is a
[tokens, vocab] fp32 tensor, its log-softmax and, in the backward, their gradients: ~200 kB a token each at
SmolLM2's 49k vocabulary, so ~3 x 0.8 GB for a 4k-token answer, and more than the rest of the step at 32k.
Here the model runs with its head cut to one position (`head_inputs` takes the final hidden states the head
would have read), and `chunked_logprobs` applies the head in tiles of `trainer.logprob_tile_tokens` tokens,
each under `torch.utils.checkpoint`: the forward keeps only each tile's [n] logprobs, and the backward
recomputes one tile's logits at a time. Peak memory is one tile's logits, whatever the sequence length; the
cost is one more head matmul per tile in the backward (the head's forward, recomputed). With one tile (a
short answer) nothing is recomputed: the logprobs are computed exactly as `token_logprobs` does.

Why not DeepSpeed's Arctic Long Sequence Training pieces (0.19.8, `deepspeed.runtime.sequence_parallel.ulysses_sp`):
- `TiledFusedLogitsLoss` returns one reduced loss and runs its backward inside the forward with an incoming
  gradient of 1. The RL objective is not a per-tile sum of a loss known up front: it needs the per-token
  logprobs first (ratios to pi_old, clipping, KL to the reference, aggregation weights of the whole step
  batch), so the gradient reaching each token is only known after the objective has run.
- `sequence_tiled_compute` (`SequenceTiledCompute`) recomputes per tile in the backward, as here, but views
  each tile's incoming gradient as the tile of the grad-requiring input (`incoming_grad.narrow(...)
  .view_as(hidden_shard)`): it fits outputs shaped like the input (an MLP), not [B, t] logprobs of a
  [B, t, D] hidden state, and it gives no gradient to the head except through a nested backward that
  bypasses autograd's accumulation order. `torch.utils.checkpoint` per tile does what is needed in a
  few lines and leaves the head's gradient to autograd (and to ZeRO's hooks, which see a module call).

What it does not do: tile the decoder (activation checkpointing does that, rl/trainer/checkpointing.py),
compute entropy (no pass of the trainer logs it), or serve models whose logits are post-processed after the
head (soft-capping, logit scaling): `tiling_refusal` names them and the trainer keeps the model's own logits.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Config attributes of families that change the logits after the LM head (Gemma 2/3 soft-capping, Granite's
# scaling, Cohere's scale): the head alone would give other logprobs than the model's.
_POSTPROCESSED = ("final_logit_softcapping", "logits_scaling", "logit_scale")


def tiling_refusal(config) -> str | None:
    """Why the logprobs of a model with this config cannot be computed from its head in tiles, or None."""
    for key in _POSTPROCESSED:
        v = getattr(config, key, None)
        if v not in (None, 1, 1.0):
            return f"{getattr(config, 'model_type', '?')} post-processes its logits ({key}={v})"
    return None


@contextmanager
def head_inputs(model: nn.Module) -> Iterator[tuple[nn.Module, list[torch.Tensor]]]:
    """Within the block, the model's output head reads only its first position (one logit row per sequence)
    and the hidden states it was given (after the final norm and `logits_to_keep`) are appended to the list.
    Yields (head, list). The head then runs on them in tiles, outside the block (the hook is gone by then)."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings to tile")
    seen: list[torch.Tensor] = []

    def cut(_module, args):
        h = args[0]
        seen.append(h)
        return (h[..., :1, :], *args[1:])

    handle = head.register_forward_pre_hook(cut)
    try:
        yield head, seen
    finally:
        handle.remove()


def _logprobs(head: nn.Module, h_ND: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """log_softmax(head(h))[target], in fp32, the way `token_logprobs` computes it from logits."""
    logp_NV = torch.log_softmax(head(h_ND).float(), dim=-1)
    return logp_NV.gather(-1, targets_N[:, None]).squeeze(-1)


def _frozen_zero3(head: nn.Module) -> bool:
    """Whether ZeRO-3 partitions the head's weights and they do not train (a LoRA policy, a tied head under
    trainer.frozen_layers). DeepSpeed 0.19.8 does not gather such a module's weights again when a checkpointed tile
    is recomputed in the backward (the recompute sees the [0] placeholder and torch.utils.checkpoint refuses it), so
    its tiles run without checkpointing: exact, with the memory of the full logits."""
    params = list(head.parameters())
    return bool(params) and all(hasattr(p, "ds_id") and not p.requires_grad for p in params)


def chunked_logprobs(head: nn.Module, h_ND: torch.Tensor, targets_N: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """log p(targets_N[n] | h_ND[n]) [N] through `head`, `tile_tokens` rows at a time; each tile of a forward
    that records a graph is checkpointed (its logits are recomputed in the backward, one tile at a time).
    `tile_tokens` <= 0 or N <= `tile_tokens`: one untiled call."""
    N = h_ND.shape[0]
    n_tiles = 1 if tile_tokens <= 0 else max(1, -(-N // tile_tokens))
    n_tiles = _tiles_on_every_rank(head, n_tiles, h_ND.device)
    if n_tiles == 1:
        return _logprobs(head, h_ND, targets_N)
    grad = torch.is_grad_enabled() and (h_ND.requires_grad or any(p.requires_grad for p in head.parameters()))
    checkpointed = grad and not _frozen_zero3(head)
    parts = []
    for i in range(n_tiles):  # tiles past the rows are empty: calls that keep ZeRO-3's gathers in step
        s = min(i * tile_tokens, N)
        h, y = h_ND[s:s + tile_tokens], targets_N[s:s + tile_tokens]
        parts.append(checkpoint(_logprobs, head, h, y, use_reentrant=False) if checkpointed else _logprobs(head, h, y))
    return torch.cat(parts)


def _tiles_on_every_rank(head: nn.Module, n_tiles: int, device: torch.device) -> int:
    """The most tiles any rank needs, where the head's weights are partitioned by ZeRO-3 (an all_reduce), else
    `n_tiles`. Each call of a partitioned head gathers its weights collectively (and again in the backward's
    recompute), so every rank must make as many calls: ranks hold different micro-batches (a padding-only rank
    holds one short row), and a rank with fewer tiles would leave the others waiting in a gather."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return n_tiles
    if not any(hasattr(p, "ds_id") for p in head.parameters()):  # not a ZeRO-3 parameter: no collective per call
        return n_tiles
    t = torch.tensor([n_tiles], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def tiled_token_logprobs(head: nn.Module, hidden_BWD: torch.Tensor, input_ids_BT: torch.Tensor,
                         tile_tokens: int) -> torch.Tensor:
    """`token_logprobs` (rl/trainer/batch.py) from the hidden states of the last W positions instead of their
    logits: out[:, t] = log p(x_t | x_<t) for t >= T - W + 1, 0 before."""
    B, T = input_ids_BT.shape
    W = hidden_BWD.shape[1]
    if W > T:
        raise ValueError(f"tiled_token_logprobs: {W} hidden positions for {T} tokens")
    first = T - W + 1
    h_ND = hidden_BWD[:, :-1].reshape(B * (W - 1), -1)
    lp_N = chunked_logprobs(head, h_ND, input_ids_BT[:, first:].reshape(-1), tile_tokens)
    out = torch.zeros(input_ids_BT.shape, dtype=torch.float32, device=hidden_BWD.device)
    out[:, first:] = lp_N.view(B, W - 1)
    return out


def tiled_packed_logprobs(head: nn.Module, hidden_PKD: torch.Tensor, rows_M: torch.Tensor, input_ids_BT: torch.Tensor,
                          loss_mask_BT: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """`packed_logprobs` (rl/trainer/packing.py) from the packed forward's hidden states at the kept node
    columns: only the loss-masked targets' predicting nodes go through the head (`rows_M` from `logit_nodes`)."""
    P, K, D = hidden_PKD.shape
    b_M, t_M = torch.nonzero(loss_mask_BT[:, 1:] > 0, as_tuple=True)
    h_MD = hidden_PKD.reshape(P * K, D)[rows_M]
    vals_M = chunked_logprobs(head, h_MD, input_ids_BT[b_M, t_M + 1], tile_tokens)
    B, T = input_ids_BT.shape
    out = torch.zeros(B * T, dtype=vals_M.dtype, device=hidden_PKD.device)
    return out.index_put((b_M * T + t_M + 1,), vals_M).reshape(B, T)
