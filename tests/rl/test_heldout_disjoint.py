"""The held-out split never feeds training: for every environment the learning configs use, held-out task
ids (and their prompts) are disjoint from train's, and the SFT set is built from train tasks only."""
from __future__ import annotations

import types
import pytest

import envs
import envs.registry
from jointrl.records import Task
from rl.config import CONFIG_DIR, load_config

LEARNING_CONFIGS = ("quickstart.yaml", "quickstart_all.yaml", "basics.yaml", "learning_smollm2.yaml")


def _env_ids() -> list[str]:
    ids: set[str] = set()
    for name in LEARNING_CONFIGS:
        if not (CONFIG_DIR / name).exists():
            continue
        raw = __import__("yaml").safe_load((CONFIG_DIR / name).read_text())
        e = raw.get("envs", {})
        defaults = load_config(None).envs.env_ids
        for d, w in e.get("weights", {}).items():
            if w > 0:
                ids.add(e.get("env_ids", {}).get(d, defaults.get(d, d)))
    registered = {e.env_id for e in envs.registry.list_envs()}
    return sorted(i for i in ids if i in registered)


def _params():
    # Building a full domain's task set the first time takes minutes (SWE instances, the browse corpus):
    # those cases run with the slow tests.
    return [pytest.param(i, marks=() if i.startswith("terminal") else pytest.mark.slow) for i in _env_ids()]


@pytest.mark.parametrize("env_id", _params())
def test_heldout_tasks_are_disjoint_from_train(env_id):
    train = [Task.from_row(r) for r in envs.tasks(env_id, "train", seed=0)]
    held = [Task.from_row(r) for r in envs.tasks(env_id, "heldout", seed=0)]
    assert train and held
    assert {t.split for t in train} == {"train"} and {t.split for t in held} == {"heldout"}
    assert not {t.id for t in train} & {t.id for t in held}
    # disjoint structural variants are each domain's own test (envs/splits.py and tests/envs/<domain>/)


def test_sft_set_is_built_from_train_tasks_only():
    from model.chat import IM_END_ID
    from rl.rollout.codec import as_codec
    from rl.sft import SftSet
    from model.chat import load_tokenizer

    env_id = "terminal-basics-v0"
    train = [Task.from_row(r) for r in envs.tasks(env_id, "train", seed=0)]
    held = [Task.from_row(r) for r in envs.tasks(env_id, "heldout", seed=0)]
    tok = load_tokenizer()
    # The run's task pools hold both splits; a held-out task placed in the train pool is refused by the
    # SFT builder (it checks each task's split), so even a wrong pool cannot leak held-out tasks.
    pools = types.SimpleNamespace(domains=["terminal"], train={"terminal": [held[0], *train[:2]]}, heldout={})
    rollouts = types.SimpleNamespace(make_env=lambda t: envs.make(env_id), tok=tok,
                                     codec=as_codec(__import__("model.chat", fromlist=["x"]), tok, end_token_id=IM_END_ID))
    eps = SftSet(pools, tasks_per_domain=3, sandbox_slots=2, max_model_len=2048).episodes(rollouts)
    assert len(eps) == 2
    assert {e.task_id for e in eps} == {t.id for t in train[:2]}
    assert held[0].id not in {e.task_id for e in eps}
