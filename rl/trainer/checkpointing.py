"""Activation checkpointing of a trained model's decoder layers (`trainer.activation_checkpointing`).

A decoder layer under checkpointing keeps only its input for the backward and runs its forward again there:
activation memory drops from every layer's intermediates (attention, the MoE's routed copies, the delta
rule's chunks: ~34 x hidden bytes a token a layer in half precision, Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", twice that in fp32) to one hidden state per layer,
for one more forward (~1/3 more compute per micro-batch).

Which layers: every transformers `GradientCheckpointingLayer` (the decoder layer of each HF family, and the
HybridMoe's `HybridMoeDecoderLayer`), the layers `gradient_checkpointing_enable` marks, set here directly:
that call also hooks the input embeddings to require a gradient (a need of reentrant checkpointing only),
which would run the backward through `trainer.frozen_layers` for nothing. Non-reentrant
`torch.utils.checkpoint` (the recompute restores the RNG state, so dropout masks repeat).

Exactness under routing replay and packing: the recompute sees the same inputs, so a layer's routes,
attention (tree masks included: the mask is an argument) and gradients are the forward's. Two kinds of
state a forward writes are handled where they live: the HybridMoe's expert-load counter is not counted
twice (`model.modeling.recompute_context`), and an HF family's router hooks keep the replayed routes set
until the backward has run (rl/trainer/policy.py).

Modes: "on" checkpoints every training forward; "off" none; "auto" a micro-batch whose estimated activation
memory exceeds `AUTO_BYTES`, so short sequences keep their speed and long ones fit.
"""
from __future__ import annotations

from functools import partial

from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("off", "on", "auto")
# "auto" checkpoints a micro-batch above this many bytes of estimated activations (`activation_bytes`):
# 4 GiB is ~3.6k tokens of the upcycled SmolLM2-MoE in fp32 (measured ~1.2 MB a token), where a 2k-token
# episode stays unchecked and at full speed (scripts/bench_long.py).
AUTO_BYTES = 4 * 2**30


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"trainer.activation_checkpointing={mode!r}; allowed values: 'off', 'on', 'auto'")
    return mode


def checkpoint_layers(model: nn.Module) -> list[nn.Module]:
    """The model's transformers `GradientCheckpointingLayer`s (its decoder layers), also under a peft wrapper."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def prepare(model: nn.Module, mode: str, role: str, recomputing=None) -> bool:
    """Give the model's decoder layers a non-reentrant checkpoint function (still off); True when `mode`
    may turn it on. 'on' with a model that has no checkpointable layer is an error naming `role`.
    `recomputing`: a context manager factory entered around each recompute (the router hooks' `recomputing`,
    so they do not keep recomputed graphs alive)."""
    check_mode(mode)
    if mode == "off":
        return False
    layers = checkpoint_layers(model)
    if not layers:
        if mode == "on":
            raise ValueError(f"trainer.activation_checkpointing='on' but the {role} ({type(model).__name__}) has no "
                             "transformers GradientCheckpointingLayer; use 'auto' or 'off'")
        return False
    ctx = _context_fn(model, recomputing)
    fn = partial(checkpoint, use_reentrant=False, **({"context_fn": ctx} if ctx is not None else {}))
    for layer in layers:
        layer._gradient_checkpointing_func = fn
        layer.gradient_checkpointing = False
    return True


def _context_fn(model: nn.Module, recomputing=None):
    """The (forward, recompute) contexts: the model's own, where it has state a recompute must not write twice,
    and `recomputing()` around the recompute."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    own = getattr(type(base), "recompute_context", None)
    if recomputing is None:
        return own
    from contextlib import contextmanager, nullcontext

    @contextmanager
    def recompute(rec):  # entered by torch.utils.checkpoint at the recompute, not before
        with rec, recomputing():
            yield

    def both():
        fwd, rec = own() if own is not None else (nullcontext(), nullcontext())
        return fwd, recompute(rec)
    return both


def set_active(model: nn.Module, on: bool) -> None:
    """Checkpoint the next training forwards of a `prepare`d model (or stop)."""
    for layer in checkpoint_layers(model):
        layer.gradient_checkpointing = on


def activation_bytes(tokens: int, config) -> float:
    """Estimated activation memory of a training forward over `tokens` positions: 34 x hidden bytes a token a
    layer at 2-byte precision (Korthikanti et al. 2022), doubled for fp32 (the trainer's default dtype)."""
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    return 68.0 * tokens * hidden * layers


def wanted(mode: str, tokens: int, config) -> bool:
    """Whether a training forward over `tokens` positions is checkpointed under `mode`."""
    if mode == "on":
        return True
    if mode == "off":
        return False
    return activation_bytes(tokens, config) > AUTO_BYTES


def on_every_rank(model: nn.Module, on: bool) -> bool:
    """`on` agreed over the ranks (any rank's True wins) where the model's weights are partitioned by ZeRO-3,
    else `on` as it is. Under ZeRO-3 each layer's forward gathers its weights collectively, and so does its
    recompute in the backward; ranks hold micro-batches of different sizes, so "auto" can decide differently
    on two ranks, and the rank that recomputes would wait in a gather the other never makes."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return on
    params = [p for p in model.parameters()]
    if not any(hasattr(p, "ds_id") for p in params):  # not a ZeRO-3 parameter: no collective per forward
        return on
    flag = torch.tensor([int(on)], dtype=torch.long, device=params[0].device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())

