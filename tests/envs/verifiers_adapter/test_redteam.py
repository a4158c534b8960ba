"""The standing red team of the verifiers domains, through the public API (`envs.make`, episodes, `grade`).

- Constant answers: the best of a candidate set of fixed replies on held-out prompts (`envs.check.best_constant`,
  as `jointrl envs check` reports it); a domain at or above the limit must be marked out of the default mix
  with its prior. The lipogram's known hole (one poem without e, a, o fits every prompt, the theme is never
  checked) is rebuilt and shown to be what the mark says.
- Saying nothing: an empty reply, or a poem only in `reasoning`, scores 0 on every term.
- Task sets are the same in processes with different `PYTHONHASHSEED`s.
Skipped without the verifiers venv; starts bridges (slow, ~90 s)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

import envs
from envs.check import CONSTANT_LIMIT, best_constant
from envs.play import ScriptedPolicy, run_episode
from envs.verifiers_adapter.catalog import POEM_WITHOUT_EAO, SHIPPED
from jointrl.records import Message
from tests import REPO

pytestmark = pytest.mark.slow


def _grade(env_id: str, task, reply: Message):
    async def go():
        env = envs.make(env_id)
        try:
            tr = await run_episode(env, task, ScriptedPolicy([reply]), max_steps=2)
        finally:
            env.close()
        assert tr.grade.error is None, tr.grade.error
        return tr.grade
    return asyncio.run(go())


@pytest.mark.parametrize("spec", SHIPPED, ids=lambda s: s.env_id)
def test_best_constant_is_below_the_limit_or_marked_with_its_prior(vf_python, spec):
    held = envs.generate_tasks(spec.env_id, "heldout", 0, 8)
    b = best_constant(spec.env_id, held, screen=8)
    assert b is not None
    reg = envs.registry.spec(spec.env_id)
    if b.mean_reward >= CONSTANT_LIMIT:
        assert not reg.default_mix and "prior" in reg.note, (b, reg.note)


def test_the_lipogram_hole_is_what_its_mark_says(vf_python):
    held = envs.generate_tasks("vf-lipogram-v0", "heldout", 0, None)
    assert {json.loads(t.private["info"])["letter"] for t in held} == {"e", "a", "o"}
    assert not set("eao") & set(POEM_WITHOUT_EAO.lower())
    rewards = [_grade("vf-lipogram-v0", t, Message(role="assistant", content=POEM_WITHOUT_EAO)).reward for t in held[::6]]
    assert min(rewards) == 1.0  # one fixed poem, every prompt: the prior the registry states
    reg = envs.registry.spec("vf-lipogram-v0")
    assert not reg.default_mix and "1.000" in reg.note


@pytest.mark.parametrize("spec", SHIPPED, ids=lambda s: s.env_id)
def test_saying_nothing_scores_nothing(vf_python, spec):
    t = envs.generate_tasks(spec.env_id, "heldout", 0, 1)[0]
    for reply in (Message(role="assistant", content=""), Message(role="assistant", content="  \n "),
                  Message(role="assistant", content="", reasoning=POEM_WITHOUT_EAO)):
        g = _grade(spec.env_id, t, reply)
        assert g.reward == 0.0, (reply, g)


_ROWS = """
import json, sys
import envs
print(json.dumps({e: [t.to_row() for t in envs.generate_tasks(e, s, 3, None)] for e in sys.argv[1:] for s in ("heldout",)}))
"""


def test_task_sets_do_not_depend_on_the_hash_seed(vf_python):
    ids = [s.env_id for s in SHIPPED]
    out = []
    for seed in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", _ROWS, *ids], capture_output=True, text=True, cwd=REPO, timeout=300,
                           env={**os.environ, "PYTHONHASHSEED": seed})
        assert r.returncode == 0, r.stderr[-2000:]
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert out[0] == out[1] and all(out[0][e] for e in ids)
