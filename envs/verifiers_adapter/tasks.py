"""Tasks of a verifiers environment: its dataset rows as jointrl `Task`s, with disjoint train / held-out splits.

The held-out rows are, in order of preference: the loader's own held-out dataset (`heldout_kwargs`), the
environment's `eval_dataset`, or the quarter of its rows whose prompt hash falls in the held-out bucket.
Train rows whose prompt also appears held out are dropped, so a prompt is never in both splits
(`Task.private["variant"]` is the prompt hash the conformance checker compares). A seed shuffles each
split's order; `n` takes the first n.

A row's `prompt` (a string, or chat messages) becomes the task's prompt; `answer`, `info` and `task` go to
`Task.private` as JSON for the rubric, never to the policy.
"""
from __future__ import annotations

import hashlib
import json
import random
from functools import lru_cache
from typing import Any, Callable

from envs.verifiers_adapter.catalog import VerifiersEnvSpec
from envs.verifiers_adapter.judge import describe
from jointrl.records import Limits, Message, Task

HASH_BUCKETS, HELDOUT_BUCKETS = 4, 1
# A tool call starts the verifiers stack in a fresh sandboxed process (8-13 s measured on this 2-core machine
# at load 5-9), so the per-call budget is generous.
DEFAULT_LIMITS = Limits(max_turns=8, tool_timeout_s=60.0, episode_timeout_s=600.0, max_obs_chars=4000, max_arg_chars=65_536)


def prompt_messages(prompt: Any) -> tuple[Message, ...]:
    if isinstance(prompt, str):
        return (Message(role="user", content=prompt),)
    if isinstance(prompt, list) and all(isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") for m in prompt):
        return tuple(Message.from_openai(m) for m in prompt)
    raise ValueError(f"a verifiers prompt must be a string or system/user/assistant messages, got {str(prompt)[:200]!r}")


def prompt_sha(prompt: Any) -> str:
    return hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()


@lru_cache(maxsize=None)
def split_rows(spec: VerifiersEnvSpec) -> dict[str, tuple[dict, ...]]:
    """{"train": rows, "heldout": rows}, disjoint by prompt hash (see the module docstring)."""
    d = describe(spec.loader())
    if spec.heldout_kwargs is not None:
        held = list(describe(spec.loader(heldout=True))["train"] or ())
        train = list(d["train"] or ())
    elif d.get("eval"):
        held, train = list(d["eval"]), list(d["train"] or ())
    else:
        rows = list(d["train"] or ())
        held = [r for r in rows if int(prompt_sha(r["prompt"])[:8], 16) % HASH_BUCKETS < HELDOUT_BUCKETS]
        train = [r for r in rows if int(prompt_sha(r["prompt"])[:8], 16) % HASH_BUCKETS >= HELDOUT_BUCKETS]
    held_sha = {prompt_sha(r["prompt"]) for r in held}
    return {"train": tuple(r for r in train if prompt_sha(r["prompt"]) not in held_sha), "heldout": tuple(held)}


def make_task(spec: VerifiersEnvSpec, split: str, seed: int, i: int, row: dict) -> Task:
    sha = prompt_sha(row["prompt"])
    return Task(id=f"{spec.env_id}/{split}/s{seed}/{sha[:12]}", domain=spec.env_id, prompt=prompt_messages(row["prompt"]),
                public={"family": spec.family},
                private={"variant": sha[:16], "prompt": json.dumps(row["prompt"]), "answer": json.dumps(row.get("answer")),
                         "info": json.dumps(row.get("info")), "task": row.get("task") or "default"},
                limits=DEFAULT_LIMITS, thinking="low", split=split)


@lru_cache(maxsize=None)
def task_fn(spec: VerifiersEnvSpec) -> Callable[[str, int, "int | None"], list[Task]]:
    def make_tasks(split: str, seed: int, n: int | None) -> list[Task]:
        rows = list(split_rows(spec)[split])
        random.Random(f"{spec.env_id}:{split}:{seed}").shuffle(rows)
        return [make_task(spec, split, seed, i, r) for i, r in enumerate(rows[: len(rows) if n is None else n])]

    return make_tasks
