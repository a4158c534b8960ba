"""The run config: YAML + dotted overrides reach the right fields; bad keys/types/values fail early and clearly."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rl.config import ConfigError, RunConfig, load_config

from tests import REPO


def test_defaults_load_and_are_typed():
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    assert cfg.trainer.zero_stage in (0, 1, 2, 3)
    assert cfg.algorithm.advantage == "grpo"


def test_dotted_overrides_reach_the_right_field():
    cfg = load_config(None, ["trainer.lr=1e-5", "envs.weights.swe=0.5", "algorithm.group_size=8", "rollout.enforce_eager=false"])
    assert cfg.trainer.lr == pytest.approx(1e-5)
    assert isinstance(cfg.trainer.lr, float)
    assert cfg.envs.weights["swe"] == 0.5
    assert cfg.envs.weights["terminal"] == 1.0  # a dotted override merges into the mapping
    assert cfg.algorithm.group_size == 8
    assert cfg.rollout.enforce_eager is False


def test_yaml_then_override(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("name: t\ntrainer:\n  lr: 0.001\n  zero_stage: 2\nenvs:\n  weights: {terminal: 1.0, browse: 2.0}\n")
    cfg = load_config(p, ["trainer.lr=0.5"])
    assert cfg.name == "t" and cfg.trainer.zero_stage == 2 and cfg.trainer.lr == 0.5
    assert cfg.envs.weights == {"terminal": 1.0, "browse": 2.0}


@pytest.mark.parametrize(
    "override, needles",
    [
        ("trainer.lrr=1", ["trainer.lrr", "did you mean 'trainer.lr'"]),
        ("trainr.lr=1", ["trainr", "did you mean 'trainer'"]),
        ("trainer.lr=abc", ["trainer.lr", "'abc'", "number"]),
        ("trainer.steps=1.5", ["trainer.steps", "integer"]),
        ("trainer.zero_stage=5", ["trainer.zero_stage", "5", "allowed values: 0, 1, 2, 3"]),
        ("trainer.zero_stage=true", ["trainer.zero_stage", "True"]),
        ("algorithm.advantage=grpoo", ["algorithm.advantage", "'grpoo'", "'grpo'", "'rloo'"]),
        ("envs.weights.swee=1", ["envs.weights.swee", "did you mean 'swe'"]),
        ("envs.weights.swe=-1", ["envs.weights.swe", "-1"]),
        ("rollout.enforce_eager=maybe", ["rollout.enforce_eager", "'maybe'"]),
        ("trainer=3", ["trainer", "section"]),
    ],
)
def test_bad_config_names_key_value_and_allowed(override, needles):
    with pytest.raises(ConfigError) as ei:
        load_config(None, [override])
    msg = str(ei.value)
    for n in needles:
        assert n in msg, (n, msg)


def test_shipped_configs_validate():
    for p in sorted((REPO / "configs").glob("*.yaml")):
        load_config(p)


def test_cli_reports_config_error_before_starting():
    r = subprocess.run([sys.executable, "-m", "rl.cli", "train", "trainer.lrr=1"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2
    assert "trainer.lrr" in r.stderr and "did you mean 'trainer.lr'" in r.stderr


def test_cli_help_lists_subcommands():
    r = subprocess.run([sys.executable, "-m", "rl.cli", "--help"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0
    for sub in ["train", "eval", "serve", "envs", "export", "report"]:
        assert sub in r.stdout
    for sub in ["train", "eval", "serve", "export", "report"]:
        r = subprocess.run([sys.executable, "-m", "rl.cli", sub, "--help"], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert r.returncode == 0 and "usage" in r.stdout, sub


def test_cluster_launcher_validates_and_builds_a_job_submit_command():
    r = subprocess.run([sys.executable, "scripts/ray_submit.py", "--address", "http://head:8265", "--print-only",
                        "configs/quickstart.yaml", "trainer.steps=3"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ray job submit --address http://head:8265 --runtime-env-json")
    assert "vllm==" in r.stdout and "trainer.steps=3" in r.stdout
    bad = subprocess.run([sys.executable, "scripts/ray_submit.py", "--address", "x", "--print-only", "configs/quickstart.yaml",
                          "trainer.stepz=3"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert bad.returncode != 0 and "did you mean 'trainer.steps'" in bad.stderr


def test_yaml_words_off_on_yes_no_stay_strings():
    cfg = load_config(None, ["algorithm.dynamic_sampling=off", "rollout.enforce_eager=true"])
    assert cfg.algorithm.dynamic_sampling == "off" and cfg.rollout.enforce_eager is True
