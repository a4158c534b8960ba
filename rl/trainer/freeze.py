"""`trainer.frozen_layers`: the input embeddings and the bottom decoder layers of a causal LM stop training.

What it does not do: choose N (the config does) or keep optimizer state out of DeepSpeed (parameters that do not
require a gradient are simply not given to the optimizer, rl/trainer/policy.py).
"""
from __future__ import annotations

import torch


def decoder_layers(m: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer stack of a causal LM (HF's `model.layers` convention; HybridMoe follows it), also
    under a peft wrapper."""
    base = m.get_base_model() if hasattr(m, "get_base_model") else m
    layers = getattr(getattr(base, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(base).__name__} has no model.layers stack; trainer.frozen_layers needs one")
    return layers


def freeze_bottom_layers(m: torch.nn.Module, n: int) -> int:
    """Stop the input embeddings and the first `n` decoder layers from training; returns the number of
    parameters frozen. Backward then stops at layer n (nothing below needs a gradient) and the optimizer
    holds no moments for them: on CPU, training the top half costs about half the backward pass.
    With tied input/output embeddings (SmolLM2) the LM head is the embedding matrix and freezes with it."""
    if n <= 0:
        return 0
    layers = decoder_layers(m)
    if n > len(layers):
        raise ValueError(f"trainer.frozen_layers={n} but the model has {len(layers)} decoder layers")
    frozen = [*m.get_input_embeddings().parameters(), *(p for layer in layers[:n] for p in layer.parameters())]
    count = 0
    for p in frozen:
        if p.requires_grad:
            p.requires_grad_(False)
            count += p.numel()
    return count
