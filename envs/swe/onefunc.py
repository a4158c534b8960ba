"""swe-onefunc-v0: fix a one-line bug in one named function, shown a failing test; the first rung of swe.

Same domain as swe-v0 (envs/swe/domain.py): the same sandbox and repository set-up, the same tool
implementations, the same grading (edit validation, the full suite with the hidden FAIL_TO_PASS
tests in a fresh sandbox, the judge process, canaries) and the same rubric. What differs:

- the instances (onefunc_build.py): one-token or one-line bugs (an operator flipped, an off-by-one,
  two arguments swapped, a `not` dropped ...) in functions of at most 30 lines, each caught by at
  least two tests;
- the prompt names the file, the function and its lines, and shows one failing test's source and
  its assertion output (the agent's repository still lacks every failing test, as in swe-v0; a
  patch that satisfies only the shown test fails a hidden one);
- the tools offered are `view`, `str_replace` and `submit` (three short schemas instead of five,
  and no shell: nothing a fix of one line needs);
- the reference solution is three calls: view the function, replace the buggy line with its
  fix, submit.

This module does not build instances (onefunc_build.py) nor grade (grader.py through SweDomain).
"""
from __future__ import annotations

import dataclasses
import logging
import random
from typing import Sequence

from envs.base import ToolEnv, ToolInvocation
from envs.swe import onefunc_build as OB
from envs.swe.domain import SweDomain
from envs.swe.tasks import InstanceSets, task_of
from jointrl.records import Limits, Message, Task

log = logging.getLogger(__name__)

ENV_ID = "swe-onefunc-v0"
TOOLS = ("view", "str_replace", "submit")
# Three calls solve a task; the slack lets a policy re-read or retry an edit once or twice.
LIMITS = Limits(max_turns=6, tool_timeout_s=30.0, episode_timeout_s=300.0, max_obs_chars=3000, max_arg_chars=4000)

SYSTEM_PROMPT = (
    "You fix a one-line bug in a Python library checked out in your working directory. "
    "Read the named function with `view`, fix the buggy line with one `str_replace`, then call `submit`. "
    "Edit only the library function, not the tests.")


class OneFuncDomain(SweDomain):
    """swe-v0's domain with the rung's reference solution (tools and grading inherited unchanged)."""

    def reference(self, task: Task) -> list[ToolInvocation]:
        ref = task.private["reference"]
        return [ToolInvocation("view", {"path": ref["path"], "line_range": list(ref["lines"])}),
                ToolInvocation("str_replace", {"path": ref["path"], "old": ref["old"], "new": ref["new"]}),
                ToolInvocation("submit")]


class ToolSubsetEnv(ToolEnv):
    """A `ToolEnv` offering only some of its domain's tools; a call to any other is an unknown tool."""

    def __init__(self, domain: SweDomain, tools: Sequence[str], **kw) -> None:
        super().__init__(domain, **kw)
        unknown = sorted(set(tools) - set(self._tools))
        if unknown or not tools:
            raise ValueError(f"tools {unknown or list(tools)} are not tools of {type(domain).__name__}; "
                             f"it has: {', '.join(self._tools)}")
        self._tools = {name: entry for name, entry in self._tools.items() if name in tools}


def make_env(*, backend=None, sandbox_limits=None, grade_limits=None, **env_kwargs) -> ToolEnv:
    """`envs.make("swe-onefunc-v0", backend=..., sandbox_limits=..., grade_limits=..., limits=..., ...)`."""
    from envs.swe import domain_limits

    env_kwargs.setdefault("grade_timeout_s", 180.0)
    return ToolSubsetEnv(OneFuncDomain(backend=backend, **domain_limits(sandbox_limits, grade_limits)), TOOLS, **env_kwargs)


def user_prompt(inst: OB.OneFuncInstance) -> str:
    m = inst.base.mutation
    where = f"\nThe traceback ends at {inst.crash_frame}." if inst.crash_frame else ""
    return (f"Function `{m.function}` in {m.path} (lines {inst.first_line}-{inst.last_line}) has a bug. "
            f"This test fails:\n```python\n{inst.test_source}\n```\nOutput:\n```\n{inst.failure}\n```{where}\n"
            f"Fix the line, then submit.")


def task_of_onefunc(inst: OB.OneFuncInstance) -> Task:
    base = task_of(inst.base)  # swe-v0's private record: what SweDomain's set-up and grading read
    m = inst.base.mutation
    private = {**base.private, "shown_test": inst.shown_test,
               "reference": {"path": m.path, "lines": [inst.first_line, inst.last_line], "old": inst.old,
                             "new": inst.new}}
    return dataclasses.replace(
        base, id=f"{ENV_ID}/{inst.base.split}/{inst.base.instance_id}",
        prompt=(Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=user_prompt(inst))),
        public={**base.public, "path": m.path, "function": m.function}, private=private, limits=LIMITS)


_SETS: InstanceSets[OB.OneFuncInstance] = InstanceSets(ENV_ID, OB.FULL, OB.SMALL, OB.load, OB.ensure_built,
                                                       "python -m envs.swe.onefunc_build", warn_small=True)


def instance_set() -> list[OB.OneFuncInstance]:
    """The full rung set if built, else the small one (built now if missing: minutes).

    `JOINTRL_SWE_SET` chooses as for swe-v0 (`InstanceSets`): `small`, `full` (raises if not built: build it
    with `python -m envs.swe.onefunc_build`, tens of minutes to hours on 2 shared cores) or `auto`.
    """
    return _SETS.get()


def make_tasks(split: str, seed: int = 0, n: int | None = None) -> list[Task]:
    """The split's instances in the order `Random(f"swe-onefunc-v0:{split}:{seed}")` shuffles them; the first n."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}; splits are: train, heldout")
    pool = sorted((i for i in instance_set() if i.base.split == split), key=lambda i: i.base.instance_id)
    random.Random(f"{ENV_ID}:{split}:{seed}").shuffle(pool)
    return [task_of_onefunc(i) for i in pool[: len(pool) if n is None else n]]
