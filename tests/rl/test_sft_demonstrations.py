"""`trainer.sft_data`: a demonstration file replaces the references as the SFT set. Its turns are replayed in
the real terminal sandbox, kept whatever they score, and a bad file is refused naming the key and the line."""
from __future__ import annotations

import json
import types

import pytest

import envs
from jointrl.records import Task
from rl.config import ConfigError, load_config

ENV_ID = "terminal-basics-v0"


def _sft_set(cfg, train, held):
    """The run's SftSet over one domain's pools, and rollouts that make its environments (no engine)."""
    from model.chat import IM_END_ID, load_tokenizer
    from rl.rollout.codec import as_codec
    from rl.sft import SftSet

    tok = load_tokenizer()
    pools = types.SimpleNamespace(domains=("terminal",), train={"terminal": train}, heldout={"terminal": held})
    rollouts = types.SimpleNamespace(make_env=lambda t: envs.make(ENV_ID), tok=tok,
                                     codec=as_codec(__import__("model.chat", fromlist=["x"]), tok, end_token_id=IM_END_ID))
    return SftSet.load(pools, cfg.trainer, sandbox_slots=cfg.envs.sandbox_slots, max_model_len=cfg.rollout.max_model_len), rollouts


def _tasks():
    train = [Task.from_row(r) for r in envs.tasks(ENV_ID, "train", seed=0)]
    held = [Task.from_row(r) for r in envs.tasks(ENV_ID, "heldout", seed=0)]
    return train, held


def test_demonstrations_replace_references_and_keep_wrong_ones(tmp_path):
    """A file of 6 demonstrations, 3 of them another family's command (scripts/make_demonstrations.py): all 6
    become episodes, the wrong ones with reward 0 and their own tokens, the right ones with reward 1."""
    from scripts.make_demonstrations import demonstrations

    lines, n_wrong = demonstrations(ENV_ID, 6, wrong=0.5, seed=3)
    assert 0 < n_wrong < 6
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    train, held = _tasks()
    cfg = load_config(None, [f"trainer.sft_data={path}", "envs.sandbox_slots=2"])
    sft, rollouts = _sft_set(cfg, train, held)
    eps = {e.task_id: e for e in sft.episodes(rollouts)}
    assert list(eps) == [x["task_id"] for x in lines]          # the file's tasks, none of the references' choice
    env = envs.make(ENV_ID)
    try:
        refs = {t.id: env.reference(t) for t in train[:6]}
    finally:
        env.close()
    wrong = [x["task_id"] for x in lines
             if json.loads(x["messages"][0]["tool_calls"][0]["function"]["arguments"])["command"]
             != dict(refs[x["task_id"]][0].arguments)["command"]]
    assert len(wrong) == n_wrong
    for tid, e in eps.items():
        assert e.reward == (0.0 if tid in wrong else 1.0), tid   # graded by the real sandbox, kept either way
        said = rollouts.tok.decode([t for t, m in zip(e.token_ids, e.loss_mask) if m])
        cmd = json.loads(next(x for x in lines if x["task_id"] == tid)["messages"][0]["tool_calls"][0]["function"]["arguments"])["command"]
        assert cmd in said                                        # the loss is on the demonstration's own turns


def test_pose_blind_mistakes_keep_the_numbers_and_misplace_the_solid():
    """cad-primitive-v0 with `--mistake pose-blind --wrong 1`: every task whose pose is not the default gets its
    own primitive and numbers on the XY workplane, centred, a solid away from the target's place;
    tasks already on the default pose keep their reference and are not counted."""
    from envs.cad.primitive import CENTRED_Z, PRIMITIVES
    from scripts.make_demonstrations import demonstrations

    lines, n_wrong = demonstrations("cad-primitive-v0", 24, wrong=1.0, mistake="pose-blind")
    train = {t.id: t for t in (Task.from_row(r) for r in envs.tasks("cad-primitive-v0", "train", seed=0))}
    off_default = 0
    for x in lines:
        task = train[x["task_id"]]
        code = json.loads(x["messages"][0]["tool_calls"][0]["function"]["arguments"])["code"]
        family, params = PRIMITIVES[task.private["family"]], task.private["params"]
        assert code == family.reference(params, CENTRED_Z)
        default = task.private["pose"] == {"plane": "XY", "on_floor": False}
        assert (code == task.private["reference_code"]) == default
        if not default:
            off_default += 1
            # a cylinder as long as it is wide keeps its bounding box on another axis (the solid still differs)
            square = family.name == "cylinder" and params["H"] == 2 * params["R"]
            assert square or list(family.summary(params, CENTRED_Z).bbox) != task.private["reference"]["bbox"]
    assert n_wrong == off_default and 0 < n_wrong < 24
    with pytest.raises(ValueError, match="only cad-primitive-v0 has poses"):
        demonstrations(ENV_ID, 6, wrong=0.5, mistake="pose-blind")


def test_without_the_key_the_references_make_the_set(tmp_path):

    train, held = _tasks()
    cfg = load_config(None, ["trainer.sft_tasks_per_domain=2", "envs.sandbox_slots=2"])
    sft, rollouts = _sft_set(cfg, train, held)
    eps = sft.episodes(rollouts)
    assert [e.task_id for e in eps] == [t.id for t in train[:2]] and all(e.reward == 1.0 for e in eps)


def _line(tid: str, role: str = "assistant") -> str:
    msg = {"role": role, "content": "", "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "submit", "arguments": "{}"}}]}
    return json.dumps({"task_id": tid, "messages": [msg]}) + "\n"


@pytest.mark.parametrize("case, match", [
    ("heldout", "held-out task"),
    ("unknown", "is not a train task"),
    ("role", "assistant's messages only"),
    ("json", "not JSON"),
    ("shape", "each line must be"),
    ("empty", "holds no demonstrations"),
])
def test_bad_demonstration_files_are_refused_naming_key_and_line(tmp_path, case, match):
    from rl.sft import read_demonstrations

    train, held = _tasks()
    text = {"heldout": _line(train[0].id) + _line(held[0].id),
            "unknown": _line("terminal-basics-v0/train/s0/99999-nothing"),
            "role": _line(train[0].id, role="tool"),
            "json": "{not json\n",
            "shape": json.dumps({"task": train[0].id}) + "\n",
            "empty": "\n"}[case]
    path = tmp_path / "d.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as e:
        read_demonstrations(path, {t.id: t for t in train}, {t.id for t in held})
    assert "trainer.sft_data" in str(e.value)
    if case == "heldout":
        assert ":2:" in str(e.value)                              # the line that holds it


def test_config_refuses_a_missing_file_and_both_sources(tmp_path):
    with pytest.raises(ConfigError, match="trainer.sft_data"):
        load_config(None, [f"trainer.sft_data={tmp_path / 'nope.jsonl'}"])
    f = tmp_path / "d.jsonl"
    f.write_text(_line("x"))
    with pytest.raises(ConfigError, match="sft_tasks_per_domain"):
        load_config(None, [f"trainer.sft_data={f}", "trainer.sft_tasks_per_domain=4"])
