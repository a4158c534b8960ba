"""Sampling seeds of rollouts: a function of (run seed, step, task position, sample, turn) only, so a resumed run
replays an uninterrupted run's requests (docs/rollout.md, "Determinism"). Re-exported by rl/rollout/agent_loop.py.
"""
from __future__ import annotations

import hashlib

import numpy as np


_SEED_BITS = 63  # torch generators take any int64 >= 0; vLLM passes the seed to torch.Generator.manual_seed


def derive_seed(*parts: int) -> int:
    """A 63-bit seed determined by a tuple of integers (BLAKE2b of their decimal text).

    Used instead of arithmetic like `seed * 1000 + turn`, which collides as soon as one part outgrows
    its slot, and instead of Python's `hash`, which is salted per process for strings. Stable across
    processes, machines and Python versions, so a resumed run recomputes the same seeds.
    """
    if not parts:
        raise ValueError("derive_seed needs at least one integer")
    for p in parts:
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
            raise TypeError(f"derive_seed takes integers, got {type(p).__name__} {p!r}")
    digest = hashlib.blake2b("/".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _SEED_BITS)


def rollout_seed(run_seed: int, step: int) -> int:
    """The base seed of one training step's rollouts: a function of the step, never of a counter.

    A resumed run restores the step, so its step k uses the same seed as an uninterrupted run's step k.
    (The policy version is not a substitute: it stays put on steps whose groups were all dropped, so
    two steps would share seeds, and a repeated task would get a copy of its earlier episodes.)
    """
    if step < 0:
        raise ValueError(f"rollout_seed: step must be >= 0, got {step}")
    return derive_seed(run_seed, step)


def episode_seed(rollout_seed_: int, task_index: int, sample_index: int) -> int:
    """Seed of sample `sample_index` of the `task_index`-th task of a rollout (positions, not ids: a task
    drawn twice in one step gets two independent groups)."""
    return derive_seed(rollout_seed_, task_index, sample_index)


def turn_seed(episode_seed_: int, turn: int) -> int:
    """Seed of one generation request of an episode (turn 0, 1, ...)."""
    return derive_seed(episode_seed_, turn)
