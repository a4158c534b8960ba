"""terminal-longhorizon-v0: a log trail that takes 20+ tool calls and more context than the policy has.

The long-horizon rung of the terminal curriculum. A task's world is a trail of 20-27 service logs. The agent's
one reading tool, `read_log(name, tally)`, returns one log; each log ends with the name of the next one
(`NEXT: <name>`, `NEXT: none` on the last), and the instruction names the first. The question: how many logs of
the trail report `STATUS: FAIL`; `submit(answer)` ends the episode and the answer is graded.

Why it needs one call per log: log names are random (nothing to guess), there is no listing tool and no shell,
so no script can walk the trail for the agent. Why the history outgrows the context: every log carries a few
lines of ordinary log noise, so the whole trail is ~6k tokens of history (the shipped tokenizer), about six times a 1024-token
`max_model_len`. A `full` context therefore cannot finish most tasks (rl/rollout/context.py).

`tally` is the agent's own notebook: the tool ignores it (nothing is graded on it), but a policy that writes
its running FAIL count there keeps what it needs in its most recent turn, which a `window` context keeps; the
scripted reference does exactly that. Held-out tasks use (service, trail length) variants that no train task
uses (envs/splits.py).

terminal-longhorizon-xl-v0 is the same rung with five times the noise per log (22-28 lines: a trail's logs are
13.7k-19.7k tokens in the shipped tokenizer, 15.1k for the first train task): episodes past 16k tokens with few
generated tokens, for training long sequences end to end (docs/training.md, "Long sequences").
"""
from __future__ import annotations

import random
from itertools import product
from typing import Any, Mapping

from envs.base import Domain, ToolEnv, ToolInvocation
from envs.splits import split_by_hash, tasks_of_split, variant_key
from envs.terminal.basics import NAMES
from envs.tools import tool
from jointrl.records import Limits, Message, Task
from rewards import Rubric, Term, check, malformed_fraction

ENV_ID = "terminal-longhorizon-v0"
XL_ENV_ID = "terminal-longhorizon-xl-v0"
FAMILY = "log_trail"
LENGTHS = tuple(range(20, 28))  # logs per trail: each needs its own call, plus one to submit
HELDOUT_FRACTION = 0.2
DEFAULT_N = {"train": 400, "heldout": 60}
LIMITS = Limits(max_turns=40, tool_timeout_s=5.0, episode_timeout_s=600.0, max_obs_chars=1500, max_arg_chars=200)
XL_LIMITS = Limits(max_turns=40, tool_timeout_s=5.0, episode_timeout_s=1800.0, max_obs_chars=4000, max_arg_chars=200)
NOISE_LINES = {ENV_ID: (4, 6), XL_ENV_ID: (22, 28)}  # log-noise lines per log
SYSTEM_PROMPT = ("You are inspecting service logs. Use `read_log` to read one log at a time; pass in `tally` your running "
                 "count so far. When you know the answer, call `submit` with it.")
_LEVELS = ("INFO", "DEBUG", "WARN", "INFO", "INFO")
_EVENTS = ("request served", "cache refreshed", "worker started", "connection closed", "retry scheduled",
           "config reloaded", "queue drained", "heartbeat sent", "lock released", "batch flushed")


def variants() -> list[tuple[str, int]]:
    return list(product(NAMES, LENGTHS))


def split_variants() -> dict[str, list[tuple[str, int]]]:
    return split_by_hash(FAMILY, variants(), HELDOUT_FRACTION, min_variants=2)


def _name(rng: random.Random, taken: set[str]) -> str:
    while True:
        n = "log-" + "".join(rng.choice("0123456789abcdef") for _ in range(6))
        if n not in taken:
            taken.add(n)
            return n


def _log_text(rng: random.Random, service: str, index: int, status: str, nxt: str | None,
              noise: tuple[int, int]) -> str:
    lines = [f"== {service} log {index + 1} =="]
    t = rng.randint(0, 80_000)
    for _ in range(rng.randint(*noise)):
        t += rng.randint(1, 300)
        lines.append(f"{t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d} {rng.choice(_LEVELS)} {service}: "
                     f"{rng.choice(_EVENTS)} ({rng.choice(NAMES)} {rng.randint(1, 999)})")
    lines.append(f"STATUS: {status}")
    lines.append(f"NEXT: {nxt or 'none'}")
    return "\n".join(lines)


def make_task(split: str, seed: int, index: int, env_id: str = ENV_ID) -> Task:
    rng = random.Random(f"{env_id}:{seed}:{split}:{index}")
    service, length = rng.choice(split_variants()[split])
    taken: set[str] = set()
    names = [_name(rng, taken) for _ in range(length)]
    statuses = ["FAIL" if rng.random() < 0.3 else "OK" for _ in range(length)]
    logs = {n: _log_text(rng, service, i, s, names[i + 1] if i + 1 < length else None, NOISE_LINES[env_id])
            for i, (n, s) in enumerate(zip(names, statuses))}
    instruction = (f"The logs of service {service} form a trail: each log names the next one on its last line. "
                   f"Start at {names[0]} and read every log of the trail. How many of them report STATUS: FAIL? "
                   "Submit that number.")
    return Task(
        id=f"{env_id}/{split}/s{seed}/{index:05d}-{FAMILY}",
        domain="terminal",
        prompt=(Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=instruction)),
        public={"family": FAMILY, "logs": logs},
        private={"family": FAMILY, "variant": variant_key(FAMILY, (service, length)), "trail": names,
                 "statuses": statuses, "expected": str(statuses.count("FAIL"))},
        limits=XL_LIMITS if env_id == XL_ENV_ID else LIMITS,
        thinking="low",
        split=split,
    )


def make_tasks(split: str, seed: int = 0, n: int | None = None) -> list[Task]:
    return tasks_of_split(make_task, DEFAULT_N, split, seed, n)


def make_xl_task(split: str, seed: int, index: int) -> Task:
    return make_task(split, seed, index, XL_ENV_ID)


def make_xl_tasks(split: str, seed: int = 0, n: int | None = None) -> list[Task]:
    return tasks_of_split(make_xl_task, DEFAULT_N, split, seed, n)


class LogTrailDomain(Domain):
    rubric = Rubric(terms=(Term("correct", check("correct"), 1.0), Term("malformed", malformed_fraction, -0.1)),
                    truncated_reward=0.0, error_reward=0.0)

    def __init__(self) -> None:
        self.logs: dict[str, str] = {}
        self.answer: str | None = None

    def setup(self, task: Task) -> None:
        self.logs = dict(task.public["logs"])
        self.answer = None

    @tool
    def read_log(self, name: str, tally: int = 0) -> str:
        """Read one log of the trail.

        Args:
            name: the log's name, e.g. log-0a1b2c
            tally: your running count so far (a note for yourself; it is not checked)
        """
        text = self.logs.get(name.strip())
        return text if text is not None else f"no log named {name!r}"

    @tool(ends_episode=True)
    def submit(self, answer: str) -> str:
        """Submit your answer and finish the task.

        Args:
            answer: the number of logs of the trail that report STATUS: FAIL
        """
        self.answer = answer
        return "Submitted."

    def check(self, task: Task, transcript: tuple[Message, ...]) -> Mapping[str, float]:
        return {"correct": float(self.answer is not None and self.answer.strip() == task.private["expected"])}

    def teardown(self) -> None:
        self.logs = {}

    def reference(self, task: Task) -> list[ToolInvocation]:
        calls, tally = [], 0
        for name, status in zip(task.private["trail"], task.private["statuses"]):
            calls.append(ToolInvocation("read_log", {"name": name, "tally": tally}))
            tally += status == "FAIL"
        return calls + [ToolInvocation("submit", {"answer": str(tally)})]

    def noop(self, task: Task) -> list[ToolInvocation]:
        return [ToolInvocation("submit", {"answer": "none"})]


def make_env(**env_kwargs: Any) -> ToolEnv:
    """`envs.make("terminal-longhorizon-v0", limits=..., max_calls_per_turn=...)`."""
    return ToolEnv(LogTrailDomain(), **env_kwargs)
