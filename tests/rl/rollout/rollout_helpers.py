"""Shared helpers for the rollout tests: special token ids, fixed token sequences, comparisons."""
from __future__ import annotations

import numpy as np

from tests.helpers.checkpoints import SPECIAL_TOKENS

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


def random_qwen3_moe(hidden: int = 64, moe_inter: int = 32, seed: int = 0):
    """A tiny Qwen3-MoE (4 experts, top-2, vocab 96) with N(0, 1) weights: large, distinct values make
    any sync or cast error visible."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, intermediate_size=48, moe_intermediate_size=moe_inter, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(seed)
    m = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    return m


LONG_ENV = "terminal-longhorizon-v0"


def long_task(i: int = 0, split: str = "train"):
    """Task i of the long-horizon rung's split (seed 0)."""
    import envs
    from jointrl.records import Task

    return Task.from_row(envs.tasks(LONG_ENV, split, seed=0, n=i + 1)[i])


class TrailPolicy:
    """Answers each request with the next reference call, or with `summary(k)` (k: calls made so far) when the
    context ends with the summary request. Records (prompt, generated, logprobs) of every request."""

    def __init__(self, codec, task, summary=None):
        import envs
        from envs.base import messages_for_calls

        self.codec = codec
        self.calls = messages_for_calls(envs.make(LONG_ENV).reference(task))
        self.k = 0
        self.summary = summary or (lambda k: f"I have read {k} logs; the last call holds my tally.")
        self.seen: list[tuple[list[int], list[int], list[float]]] = []

    async def __call__(self, reqs):
        from jointrl.records import Message
        from rl.rollout.context import SUMMARY_REQUEST
        from rl.rollout.engine import GenerateResult

        out = []
        for r in reqs:
            tail = self.codec.tokenizer.decode(list(r.prompt_token_ids[-120:]), skip_special_tokens=False)
            if SUMMARY_REQUEST[-40:] in tail:
                msg = Message(role="assistant", content=self.summary(self.k))
            else:
                msg, self.k = self.calls[min(self.k, len(self.calls) - 1)], self.k + 1
            if "<|" in msg.content:  # special-token *text*, written with ordinary tokens (a real engine stops at the real one)
                ids = self.codec.tokenizer.encode(msg.content, add_special_tokens=False, split_special_tokens=True)
                ids = ids[: r.max_tokens - 1] + [self.codec.end_token_id]
            else:
                ids = self.codec.completion_ids([Message(role="user", content=".")], msg, None)[: r.max_tokens]
            lps = [-0.01 * (1 + (len(self.seen) + j) % 7) for j in range(len(ids))]
            self.seen.append((list(r.prompt_token_ids), list(ids), lps))
            out.append(GenerateResult(token_ids=tuple(ids), logprobs=tuple(lps), finish_reason="stop"))
        return out
