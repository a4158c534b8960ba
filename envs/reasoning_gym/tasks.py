"""Tasks of a reasoning-gym domain: seeded draws from its generator, split by a hash of the question.

For jointrl seed `s`, items come from reasoning-gym's `create_dataset(name, seed=rg_seed(name, s),
size=...)`, read at indices 0, 1, 2, ... Each item's split is decided by the sha256 of its question
text: a quarter of the hash space is held out. So the same question is never in both splits, whatever
the seed, the order or `n`, and `Task.private["variant"]` (the question hash) is what the conformance
checker compares. Items are drawn until `n` tasks of the asked split are found (at most `size`).

The private record holds the item as reasoning-gym made it (`entry`: question, answer, metadata, as
JSON text) and how the dataset was built (name, seed, size), which is what the judge needs to call
`score_answer`; `reference` is the answer the scripted reference solution gives.
"""
from __future__ import annotations

import hashlib
import json
import random
from functools import lru_cache
from typing import Callable

from envs.reasoning_gym.catalog import DatasetInfo, reference_answer
from jointrl.records import Limits, Message, Task

HELDOUT_BUCKETS = 1  # of HASH_BUCKETS: the held-out share of the question-hash space
HASH_BUCKETS = 4
DEFAULT_N = {"train": 256, "heldout": 64}
DRAW_SIZES = (4096, 1024, 256)  # dataset sizes tried in turn; some generators cap how many distinct items they make
DEFAULT_LIMITS = Limits(max_turns=4, tool_timeout_s=10.0, episode_timeout_s=120.0, max_obs_chars=2000,
                        max_arg_chars=65_536)
# One prompt for both answer modes (the task set is shared): the tool mode offers `answer`, the
# final-message mode (`envs.make(id, final_message=True)`) offers no tools.
SYSTEM_PROMPT = ("Solve the problem. Give only the final answer, exactly in the format the problem asks for: "
                 "call answer(text) with it, which ends the episode; if you have no tools, end your reply with "
                 "the answer inside <answer></answer> tags.")


def rg_seed(name: str, seed: int) -> int:
    return int(hashlib.sha256(f"jointrl:{name}:{seed}".encode()).hexdigest()[:8], 16)


def question_sha(question: str) -> str:
    return hashlib.sha256(question.encode()).hexdigest()


def split_of(question: str) -> str:
    return "heldout" if int(question_sha(question)[:8], 16) % HASH_BUCKETS < HELDOUT_BUCKETS else "train"


def _tagged(x):
    if isinstance(x, tuple):
        return {"__tuple__": [_tagged(v) for v in x]}
    if isinstance(x, list):
        return [_tagged(v) for v in x]
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x):
            return {k: _tagged(v) for k, v in x.items()}
        return {"__items__": [[_tagged(k), _tagged(v)] for k, v in x.items()]}
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)  # numpy scalars and the like: no 0.1.25 scorer reads them back as objects


def encode_entry(entry: dict) -> str:
    """JSON text that `judge_worker.decode_entry` turns back into the same values, tuples and
    int-keyed dicts included (plain JSON would turn them into lists and string keys)."""
    return json.dumps(_tagged(entry))


def _item(ds, idx: int) -> dict:
    """ds[idx] with the global `random` module seeded from (dataset seed, idx), its state restored after:
    some generators draw from it besides their own Random (list_functions: 9 of 300 items changed with
    the global state), which would make two generations of a task set differ."""
    state = random.getstate()
    random.seed(ds.seed * 1_000_003 + idx)
    try:
        return ds[idx]
    finally:
        random.setstate(state)


@lru_cache(maxsize=512)  # building some datasets reads word lists / task files (up to ~3 s here)
def open_dataset(name: str, seed: int):
    """reasoning-gym's dataset for (name, jointrl seed) and the size it was built with. Items depend only
    on (seed, index), so one object serves every split and every n."""
    import reasoning_gym

    err: Exception | None = None
    for size in DRAW_SIZES:
        try:
            return reasoning_gym.create_dataset(name, seed=rg_seed(name, seed), size=size), size
        except ValueError as e:  # e.g. word_ladder: "Dataset size too large for this algorithm and constraints"
            err = e
    raise ValueError(f"reasoning-gym dataset {name!r} refuses every size in {DRAW_SIZES}: {err}")


@lru_cache(maxsize=None)  # one function per dataset, so registering twice is a no-op
def task_fn(info: DatasetInfo) -> Callable[[str, int, "int | None"], list[Task]]:
    def make_tasks(split: str, seed: int, n: int | None) -> list[Task]:
        want = DEFAULT_N[split] if n is None else n
        out: list[Task] = []
        if want == 0:
            return out
        ds, size = open_dataset(info.name, seed)
        for idx in range(size):
            entry = _item(ds, idx)
            q = entry["question"]
            if split_of(q) != split:
                continue
            ref = reference_answer(entry)
            sha = question_sha(q)
            out.append(Task(
                id=f"{info.env_id}/{split}/s{seed}/{idx}", domain=info.env_id,
                prompt=(Message(role="system", content=SYSTEM_PROMPT),
                        Message(role="user", content=q)),
                public={"family": info.family, "dataset": info.name},
                private={"variant": sha[:16], "dataset": info.name, "seed": rg_seed(info.name, seed), "size": size,
                         "index": idx, "reference": ref,
                         "entry": encode_entry({k: entry.get(k) for k in ("question", "answer", "metadata")})},
                limits=DEFAULT_LIMITS, thinking="low", split=split))
            if len(out) >= want:
                break
        return out

    return make_tasks
