"""Shared helpers for the rollout tests: special token ids, fixed token sequences, comparisons."""
from __future__ import annotations

import numpy as np

from rl.rollout.testing import SPECIAL_TOKENS

# Token ids of the trained tiny tokenizer: special tokens come first, in SPECIAL_TOKENS order.
EOS_ID = SPECIAL_TOKENS.index("<|endoftext|>")
THINK_ID = SPECIAL_TOKENS.index("<think>")
END_THINK_ID = SPECIAL_TOKENS.index("</think>")


def fixed_sequences(n: int, length: int, seed: int = 0, low: int = 10, high: int = 500) -> tuple[tuple[int, ...], ...]:
    """Random ordinary (non-special) token sequences, fixed by `seed`."""
    rs = np.random.RandomState(seed)
    return tuple(tuple(int(x) for x in rs.randint(low, high, size=length)) for _ in range(n))


def cut_at_eos(ids) -> tuple[int, ...]:
    ids = tuple(ids)
    return ids[: ids.index(EOS_ID) + 1] if EOS_ID in ids else ids


def max_abs_diff(a_list, b_list) -> float:
    assert len(a_list) == len(b_list)
    return max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(a_list, b_list))
