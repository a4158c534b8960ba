"""scripts/learning_run.py: every recipe's commands run as they stand (the demonstration file is written, the
training overrides load as a valid config naming that file, the report reads the run's directory), and an
unknown recipe is refused by name."""
from __future__ import annotations

import pytest

from rl.config import load_config
from scripts import learning_run as lr


@pytest.mark.parametrize("name", sorted(lr.RECIPES))
def test_recipe_commands_make_a_valid_run(name, tmp_path, monkeypatch):
    from scripts.make_demonstrations import main as make_demos

    cmds = lr.commands(name, ["trainer.steps=2"], "PY", "JOINTRL")
    train = next(c for c in cmds if c[0] == "JOINTRL")
    assert train[1:3] == ["train", lr.RECIPES[name].config]
    overrides = train[3:]
    assert overrides[-1] == "trainer.steps=2"  # the caller's overrides come last, so they win
    if lr.RECIPES[name].demos:
        demo = cmds[0]
        assert demo[:2] == ["PY", "scripts/make_demonstrations.py"]
        out = tmp_path / "demos.jsonl"
        assert make_demos([demo[2], str(out), *demo[4:]]) == 0 and out.stat().st_size > 0
        overrides = [f"trainer.sft_data={out}" if o.startswith("trainer.sft_data=") else o for o in overrides]
    cfg = load_config(lr.RECIPES[name].config, overrides)
    assert cfg.trainer.steps == 2
    assert cmds[-1] == ["PY", "scripts/learning_report.py", f"runs/{cfg.name}"]


def test_unknown_recipe_is_refused_by_name():
    with pytest.raises(SystemExit, match="unknown recipe 'cad-posee'; recipes: terminal, cad"):
        lr.commands("cad-posee", [], "PY", "JOINTRL")
