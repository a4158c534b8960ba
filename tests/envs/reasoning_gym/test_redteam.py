"""The standing red team of the reasoning-gym domains: answers that reach the target without solving the task.

Written as the attacker would, through the public API (`envs.make`, an episode, `grade`):
- scope lookups: reasoning-gym scorers that `eval` the answer do it in a frame holding the task's entry
  and its reference (`entry['answer']`, `oracle_answer`, `entry['metadata']['valid_answers'][0]`);
- solver calls: sympy's namespace computes the answer from the question (`Integral(f, x)`, `integrate`,
  `expand`);
- digit-free arithmetic and arithmetic over the wrong numbers (countdown, puzzle24);
- constant answers (the best of a candidate set on held-out tasks, as `jointrl envs check` measures it).
Each attack is first shown to work against reasoning-gym's own scorer called in this process (the
control), then to earn nothing through jointrl. Starts a judge process (slow, ~60 s)."""
from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("reasoning_gym")

import envs  # noqa: E402
from envs.base import ToolInvocation  # noqa: E402
from envs.check import CONSTANT_LIMIT, best_constant  # noqa: E402
from envs.play import ScriptedPolicy, run_episode  # noqa: E402
from envs.reasoning_gym.catalog import ANSWER_SHARE_CAP, datasets  # noqa: E402
from envs.reasoning_gym.judge_worker import decode_entry  # noqa: E402
from tests.envs.reasoning_gym.helpers import SLOW_GENERATORS, stratified_sample  # noqa: E402

pytestmark = pytest.mark.slow

SCOPE_LOOKUPS = ("entry['answer']", "str(entry['answer'])", "oracle_answer", "''.join(oracle_answer)",
                 "oracle_answer.split()", "[[int(c) for c in r.split()] for r in oracle_answer.split('\\n')]",
                 "entry['metadata']['valid_answers'][0]", "entry['metadata']['solution']", "answer")


def reward(env_id: str, task, text: str) -> float:
    async def go():
        env = envs.make(env_id)
        try:
            tr = await run_episode(env, task, ScriptedPolicy([ToolInvocation("answer", {"text": text})]), max_steps=3)
        finally:
            env.close()
        assert tr.grade.error is None, tr.grade.error
        return tr.grade.reward
    return asyncio.run(go())


def upstream(task, text: str) -> float:
    """reasoning-gym's own scorer in this process: the control that shows an attack is real."""
    import reasoning_gym

    p = task.private
    ds = reasoning_gym.create_dataset(p["dataset"], seed=int(p["seed"]), size=int(p["size"]))
    try:
        return float(ds.score_answer(text, decode_entry(p["entry"])))
    except Exception:  # noqa: BLE001
        return 0.0


def targeted(task) -> list[str]:
    """Attacks built from the task's own metadata: solver calls on the question, digit-free arithmetic."""
    meta = json.loads(task.private["entry"])["metadata"]
    out = []
    if "integrand" in meta:
        f, x = meta["integrand"], meta["variable"]
        out += [f"Integral({f}, {x}) + C", f"integrate({f}, {x})", f"Integral({f}, {x}).doit() + C"]
    if "polynomial_expr" in meta:
        out += [f"expand({meta['polynomial_expr']})", f"({meta['polynomial_expr']}).expand()"]
    nums = meta.get("numbers")
    nums = json.loads(nums) if isinstance(nums, str) and nums.startswith("[") else nums
    if isinstance(nums, list) and all(isinstance(n, int) for n in nums):
        target = int(meta.get("target", 24))
        zeroed = " + ".join(f"{n}*len('')" for n in nums)  # each number once, times a zero written without digits
        out += [f"{zeroed} + len('{'a' * target}')", "6*4*1*1", "3*8/(1*1)"]
    return out


EXPLOITS = [  # (dataset, attack builder, what reasoning-gym's scorer pays for it)
    ("puzzle24", lambda t: "6*4*1*1", 1.0),
    ("countdown", lambda t: targeted(t)[0], 1.0),
    ("n_queens", lambda t: "entry['metadata']['valid_answers'][0].split('\\n')", 0.5),
    ("simple_integration", lambda t: targeted(t)[0], 1.0),
    ("intermediate_integration", lambda t: targeted(t)[1], 1.0),
    ("polynomial_multiplication", lambda t: targeted(t)[0], 1.0),
    ("string_insertion", lambda t: "oracle_answer", 0.1),
    ("spiral_matrix", lambda t: "oracle_answer.split()", 0.1),
    ("coin_flip", lambda t: "0", 0.5),
]


@pytest.mark.parametrize("name,attack,pays", EXPLOITS, ids=[e[0] for e in EXPLOITS])
def test_known_exploits_pay_upstream_and_nothing_here(name, attack, pays):
    env_id = f"rg-{name}-v0"
    tasks = envs.generate_tasks(env_id, "heldout", 0, 12)
    paid = 0
    for t in tasks[:6]:
        text = attack(t)
        if name == "n_queens":  # eval of a list of rows: the board the scorer re-renders
            text = "[r.split(' ') for r in " + text + "]"
        paid += upstream(t, text) >= pays
        assert reward(env_id, t, text) < 0.1, (t.id, text)
    assert paid >= 3, f"the control: reasoning-gym's scorer paid >= {pays} on only {paid} of 6 tasks"


EVAL_SCORERS = {name for name, _, _ in EXPLOITS} | {"binary_matrix"}


def test_no_domain_pays_for_scope_lookups_or_solver_calls():
    """Every domain, one held-out task, every attack. A scope lookup or solver call that ran would return
    the reference itself (1.0, or the scorer's level for the form: 0.5, 0.1). Where the scorer evaluates
    answers, each attack stays under 0.1; elsewhere the text is only text, and per-character credit for
    a chance match (spell_backward pays 0.2 for "str(entry['answer'])" on one task) stays under 0.25."""
    paid = []
    for info in datasets():
        t = envs.generate_tasks(info.env_id, "heldout", 0, 1)[0]
        for text in SCOPE_LOOKUPS + tuple(targeted(t)):
            r = reward(info.env_id, t, text)
            if r >= (0.1 if info.name in EVAL_SCORERS else 0.25):
                paid.append((info.name, text, r))
    assert not paid, paid


CONSTANT_SAMPLE = [d for d in stratified_sample(8, skip=SLOW_GENERATORS)]  # 11 domains with the three above


@pytest.mark.parametrize("name", ["coin_flip", "puzzle24", "countdown", *sorted(ANSWER_SHARE_CAP)]
                         + [d.name for d in CONSTANT_SAMPLE if d.name not in ANSWER_SHARE_CAP])
def test_best_constant_answer_is_below_the_limit_or_the_domain_is_marked(name):
    env_id = f"rg-{name}-v0"
    spec = envs.registry.spec(env_id)
    held = envs.generate_tasks(env_id, "heldout", 0, 24)
    train = envs.generate_tasks(env_id, "train", 0, 24)
    b = best_constant(env_id, held, train, screen=8)
    assert b is not None
    if spec.default_mix:
        assert b.mean_reward < CONSTANT_LIMIT, b
    else:
        assert "prior" in spec.note, spec.note
