"""The standing red team of the verifiers domains, through the public API (`envs.make`, episodes, `grade`).

- Constant answers: the best of a candidate set of fixed replies on held-out prompts (`envs.check.best_constant`,
  as `jointrl envs check` reports it); a domain at or above the limit must be marked out of the default mix
  with its prior; one that is in the default mix must be under it (the lipogram).
- The lipogram's constants and templates (envs/verifiers_adapter/lipogram.py): the poem without e, a, o that
  fitted every prompt of stardata's own loader, every theme's words in one text, two or one words of every
  held-out theme, one honest poem given to every prompt: each under the limit on the held-out prompts, most
  at 0; honest poems on their own prompts score 1, and 0 with the letter written as a look-alike.
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
from envs.verifiers_adapter.lipogram import LETTERS, key_words
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
    if reg.default_mix:
        assert b.mean_reward < CONSTANT_LIMIT, b
    else:
        assert "prior" in reg.note, (b, reg.note)


# Honest lipograms for three held-out prompts (theme, forbidden letter), written for this test.
HONEST = {
    ("a chess game in the park", "t"): "Old men play chess on a bench in a green park,\nBishops glide and rooks race down open files,\n"
                                       "A queen falls, a king hides behind his brave pawns,\nCrowds murmur as evening cools worn park benches,\n"
                                       "One more game, say sly players, as dusk grows deep.",
    ("the glow of a midnight kitchen", "e"): "A midnight glow spills from a small lamp,\nCold milk, a crust of toast, a warm mug in my hands,\n"
                                             "Tiny clocks tick as a cat curls up by my stool,\nAll is still but a soft drip from a tap,\n"
                                             "I sit in this midnight glow and think of you.",
    ("a dog waiting at a train station", "e"): "A loyal dog sits by a train station door,\nWaiting through cold nights, through wind and fog,\n"
                                               "Its tail still wags at any whistling arrival,\nCrowds pass, a girl stops and pats its fur,\n"
                                               "Still it waits for a form that will not show.",
}


def _lines(words: list[str], n: int = 5) -> str:
    return "\n".join("and " + " and ".join(words[i::n]) + " sing in my song" for i in range(n))


def test_the_lipogram_pays_honest_poems_and_no_constant_or_template(vf_python):
    held = envs.generate_tasks("vf-lipogram-v0", "heldout", 0, None)
    train = envs.generate_tasks("vf-lipogram-v0", "train", 0, None)
    info = [json.loads(t.private["info"]) for t in held]
    assert {i["letter"] for i in info} == set(LETTERS)  # every one of the 12 letters is asked for
    by_prompt = {(i["topic"], i["letter"]): t for i, t in zip(info, held)}
    for key, poem in HONEST.items():
        assert _grade("vf-lipogram-v0", by_prompt[key], Message(role="assistant", content=poem)).reward == 1.0, key
    # the forbidden letter written as a look-alike (Cyrillic е for e) is the letter
    kitchen = by_prompt[("the glow of a midnight kitchen", "e")]
    lookalike = HONEST[("the glow of a midnight kitchen", "e")].replace("small", "smеll").replace("stool", "stооl")
    assert _grade("vf-lipogram-v0", kitchen, Message(role="assistant", content=lookalike)).reward == 0.0
    themes = sorted({i["topic"] for i in info})
    every_theme = sorted({w for t in themes + sorted({json.loads(t.private["info"])["topic"] for t in train}) for w in key_words(t)})
    attacks = {
        "the poem without e, a, o": POEM_WITHOUT_EAO,
        "every theme's words": _lines(every_theme, 6),
        "two words of every held-out theme": _lines([w for t in themes for w in key_words(t)[:2]]),
        "one word of every held-out theme": _lines([min(key_words(t), key=lambda w: len(set(w))) for t in themes]),
        "an honest poem, to every prompt": HONEST[("a chess game in the park", "t")],
    }
    sample = [t for th in themes for t in [t for t, i in zip(held, info) if i["topic"] == th][:3]]  # 3 prompts of each theme
    means = {name: sum(_grade("vf-lipogram-v0", t, Message(role="assistant", content=text)).reward for t in sample) / len(sample)
             for name, text in attacks.items()}
    assert all(m < CONSTANT_LIMIT for m in means.values()), means
    assert means["the poem without e, a, o"] == means["every theme's words"] == means["two words of every held-out theme"] == 0.0, means


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
