"""envs/verifiers_adapter: dataset rows -> Tasks with disjoint splits, for the shipped verifiers environments."""
from __future__ import annotations

import json

import pytest

import envs
from envs.verifiers_adapter.catalog import SHIPPED, VerifiersEnvSpec
from envs.verifiers_adapter.judge import describe
from envs.verifiers_adapter.tasks import prompt_sha, split_rows
from jointrl.records import Task


def _tasks(env_id, split, seed=0, n=None):
    return [Task.from_row(r) for r in envs.tasks(env_id, split, seed=seed, n=n)]


@pytest.mark.parametrize("spec", SHIPPED, ids=lambda s: s.env_id)
def test_splits_are_disjoint_and_cover_the_rows(vf_python, spec):
    train, held = _tasks(spec.env_id, "train"), _tasks(spec.env_id, "heldout")
    assert train and held
    assert not {t.private["variant"] for t in train} & {t.private["variant"] for t in held}
    assert not {t.prompt[-1].content for t in train} & {t.prompt[-1].content for t in held}
    rows = split_rows(spec)
    assert len(train) == len(rows["train"]) and len(held) == len(rows["heldout"])
    for t in train + held:
        assert t.domain == spec.env_id and t.public == {"family": spec.family}
        # the rubric's inputs ride in private, and the prompt is the row's prompt
        row_answer = json.loads(t.private["answer"])
        assert row_answer is None or json.dumps(row_answer) not in t.prompt[-1].content
        assert prompt_sha(json.loads(t.private["prompt"]))[:16] == t.private["variant"]


def test_held_out_split_follows_the_environment(vf_python):
    gym, lipo = SHIPPED
    # constraint gym: no held-out dataset of its own -> a quarter of the prompt-hash space
    d = describe(gym.loader())
    assert d["eval"] is None and len(split_rows(gym)["train"]) + len(split_rows(gym)["heldout"]) == len(d["train"])
    # lipogram: the loader's holdout=True dataset is the held-out split
    held = describe(lipo.loader(heldout=True))["train"]
    assert [prompt_sha(r["prompt"]) for r in split_rows(lipo)["heldout"]] == [prompt_sha(r["prompt"]) for r in held]


def test_seed_orders_and_n_takes_a_prefix(vf_python):
    a = [t.private["variant"] for t in _tasks("vf-lipogram-v0", "train", seed=0)]
    b = [t.private["variant"] for t in _tasks("vf-lipogram-v0", "train", seed=1)]
    assert sorted(a) == sorted(b) and a != b  # the same rows, in another order
    assert [t.private["variant"] for t in _tasks("vf-lipogram-v0", "train", seed=0, n=5)] == a[:5]


@pytest.mark.parametrize("kw,msg", [
    ({"env_id": "Bad_Id", "target": "m:f"}, "must look like 'vf-name-v0'"),
    ({"env_id": "vf-x-v0", "target": "module_only"}, "must be 'module:function'"),
])
def test_specs_are_checked(kw, msg):
    with pytest.raises(ValueError, match=msg):
        VerifiersEnvSpec(family="f", description="d", **kw)
