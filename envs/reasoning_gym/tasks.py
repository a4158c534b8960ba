"""Tasks of a reasoning-gym domain: seeded draws from its generator, split by a hash of the question.

For jointrl seed `s`, items come from reasoning-gym's `create_dataset(name, seed=rg_seed(name, s),
size=...)`, read at indices 0, 1, 2, ... Each item's split is decided by the sha256 of its question
text: a quarter of the hash space is held out. So the same question is never in both splits, whatever
the seed, the order or `n`, and `Task.private["variant"]` (the question hash) is what the conformance
checker compares. Items are drawn until `n` tasks of the asked split are found (at most `size`).

The private record holds the item as reasoning-gym made it (`entry`: question, answer, metadata, as
JSON text) and how the dataset was built (name, seed, size), which is what the judge needs to call
`score_answer`; `reference` is the answer the scripted reference solution gives. An item whose reference
answer the project's own grammar for that dataset refuses (`answers.reference_ok`: intermediate_integration
states some references as an unevaluated `Integral(...)`) is skipped: it has no solution to learn. In a
dataset of `catalog.ANSWER_SHARE_CAP`, an item is skipped when its reference answer already holds
1 + floor(cap x k) of the k tasks kept so far, so every prefix of the set (every `n`) keeps each answer within
cap + 1/k of it (the one extra lets a set grow while only a few answers are common).

Same tasks in every process: several generators iterate sets of strings (`list(self.letters - {...})` in
ransom_note and isomorphic_strings, word sets in word_ladder, knight_swap's and polynomial_multiplication's
internals), whose order follows the per-process `str` hash salt; without a fixed `PYTHONHASHSEED` 5 of
101 datasets gave another question at the same index in another process. So items are drawn only in an
interpreter whose hash randomisation is off: this one when it runs with `PYTHONHASHSEED=0`, else a
generator child started with it (`Generator`, one per process, reused; a line of JSON per request).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
from functools import lru_cache
from pathlib import Path
from typing import Callable

from envs.reasoning_gym.answers import reference_ok
from envs.reasoning_gym.catalog import ANSWER_SHARE_CAP, DatasetInfo, by_env_id, reference_answer
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


def build_tasks(info: DatasetInfo, split: str, seed: int, n: int | None) -> list[Task]:
    """The task set, drawn in this interpreter (callers make sure its hash randomisation is off)."""
    want = DEFAULT_N[split] if n is None else n
    out: list[Task] = []
    if want == 0:
        return out
    ds, size = open_dataset(info.name, seed)
    cap = ANSWER_SHARE_CAP.get(info.name)
    answers: dict[str | None, int] = {}
    for idx in range(size):
        entry = _item(ds, idx)
        q = entry["question"]
        if split_of(q) != split:
            continue
        ref = reference_answer(entry)
        if ref is not None and not reference_ok(info.name, ref, entry):
            continue
        if cap is not None and answers.get(ref, 0) >= 1 + int(cap * len(out)):
            continue
        answers[ref] = answers.get(ref, 0) + 1
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


def hash_fixed() -> bool:
    """True when this interpreter runs with `PYTHONHASHSEED=0` (str hashes carry no per-process salt)."""
    return sys.flags.hash_randomization == 0


_ROOT = Path(__file__).resolve().parents[2]
_CHILD = "from envs.reasoning_gym.tasks import serve_generation; serve_generation()"


class Generator:
    """A child interpreter with `PYTHONHASHSEED=0` that builds task sets (`rows`) on request.

    Started on first use, reused for every dataset, one request at a time (a lock); replaced when it
    dies. It runs trusted code only (reasoning-gym's generators), never a policy's answer."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "PYTHONHASHSEED": "0",
               "PYTHONPATH": os.pathsep.join(filter(None, (str(_ROOT), os.environ.get("PYTHONPATH"))))}
        return subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, bufsize=1, cwd=str(_ROOT), env=env)

    def rows(self, env_id: str, split: str, seed: int, n: int | None) -> list[dict]:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps({"env_id": env_id, "split": split, "seed": seed, "n": n}) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
            except (BrokenPipeError, OSError):
                line = ""
            if not line:
                self.close_locked()
                raise RuntimeError(f"the reasoning-gym task generator process died building {env_id} {split}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"building {env_id} {split} seed {seed}: {reply['error']}")
        return reply["rows"]

    def close_locked(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        with self._lock:
            self.close_locked()


_GENERATOR = Generator()


def serve_generation() -> None:
    """The generator child's loop: one request line in, one reply line out (`Generator.rows`)."""
    if not hash_fixed():
        raise SystemExit("serve_generation needs PYTHONHASHSEED=0")
    # Some generators print (bf writes dots to stdout): the replies get a descriptor of their own, and
    # fd 1 goes where stderr goes.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        try:
            req = json.loads(line)
            info = by_env_id()[req["env_id"]]
            rows = [t.to_row() for t in build_tasks(info, req["split"], int(req["seed"]), req["n"])]
            reply: dict = {"rows": rows}
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


@lru_cache(maxsize=None)  # one function per dataset, so registering twice is a no-op
def task_fn(info: DatasetInfo) -> Callable[[str, int, "int | None"], list[Task]]:
    def make_tasks(split: str, seed: int, n: int | None) -> list[Task]:
        if hash_fixed():
            return build_tasks(info, split, seed, n)
        return [Task.from_row(r) for r in _GENERATOR.rows(info.env_id, split, seed, n)]

    return make_tasks
