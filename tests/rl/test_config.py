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
    assert cfg.trainer.zero_stage in ("auto", 0, 1, 2, 3)
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
        ("trainer.zero_stage=5", ["trainer.zero_stage", "5", "allowed values: 'auto', 0, 1, 2, 3"]),
        ("trainer.zero_stage=true", ["trainer.zero_stage", "True"]),
        ("algorithm.advantage=grpoo", ["algorithm.advantage", "'grpoo'", "'grpo'", "'rloo'"]),
        ("envs.weights.swee=1", ["envs.weights.swee", "did you mean 'swe'"]),
        ("envs.weights.swe=-1", ["envs.weights.swe", "-1"]),
        ("rollout.enforce_eager=maybe", ["rollout.enforce_eager", "'maybe'"]),
        ("trainer=3", ["trainer", "section"]),
        ("logging.gap_every=-1", ["logging.gap_every", "-1", "integer >= 0"]),
    ],
)
def test_bad_config_names_key_value_and_allowed(override, needles):
    with pytest.raises(ConfigError) as ei:
        load_config(None, [override])
    msg = str(ei.value)
    for n in needles:
        assert n in msg, (n, msg)


def test_every_thinking_tier_needs_a_budget(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("rollout:\n  thinking_budgets: {low: 64}\n")  # a YAML mapping replaces the default one
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    for needle in ("rollout.thinking_budgets", "'high', 'max'", "tiers: 'low', 'high', 'max'"):
        assert needle in str(ei.value), (needle, str(ei.value))
    p.write_text("rollout:\n  thinking_budgets: {low: 64, high: 128, max: -1}\n")
    assert load_config(p).rollout.thinking_budgets == {"low": 64, "high": 128, "max": -1}
    with pytest.raises(ConfigError, match="rollout.thinking_budgets.mid': unknown tier; allowed: 'low', 'high', 'max'"):
        load_config(None, ["rollout.thinking_budgets.mid=3"])


def test_model_arch_is_read_like_every_model_argument(tmp_path):
    run = tmp_path / "run" / "checkpoint"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "config.json").write_text("{}")
    cfg = RunConfig()
    from dataclasses import replace

    from rl.config import resolve_pullable

    def arch(value: str) -> str:
        return resolve_pullable(replace(cfg, model=replace(cfg.model, arch=value)), pull=False).model.arch

    assert arch(str(run)) == str(run / "hf")  # a run's checkpoint directory: its hf/ weights
    assert arch(str(run / "hf") + "/") == str(run / "hf") + "/"  # a checkpoint directory is kept as written
    assert arch("tiny") == "tiny"
    assert resolve_pullable(cfg).model.reference == "initial"


def test_load_config_pulls_nothing_and_start_up_checks_what_it_pulls(tmp_path):
    """load_config leaves a pullable model that is not on this machine as its name (no download, no cache entry);
    start-up's pull (`pull_models`) checks the weights it resolves, naming the key, before anything starts."""
    code = ("import sys; import rl.config as c; assert 'torch' not in sys.modules, 'rl.config imports torch'; "
            "print(c.load_config('configs/quickstart.yaml').model.arch)")
    env = {**__import__("os").environ, "JOINTRL_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "smollm2-135m-moe"
    assert not (tmp_path / "cache" / "models").exists()
    from dataclasses import replace

    from rl.config import pull_models

    run = tmp_path / "run" / "checkpoint"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "config.json").write_text('{"model_type": "bert"}')
    cfg = RunConfig()
    assert pull_models(cfg) is cfg  # nothing to pull, nothing checked again
    with pytest.raises(ConfigError, match="config key 'model.arch': .*model_type 'bert' is not a model family"):
        pull_models(replace(cfg, model=replace(cfg.model, arch=str(run))))  # resolved to its hf/, then checked


def test_shipped_configs_validate():
    for p in sorted((REPO / "configs").glob("*.yaml")):
        load_config(p)


def test_cli_reports_config_error_before_starting():
    r = subprocess.run([sys.executable, "-m", "rl.cli", "train", "-", "trainer.lrr=1"], capture_output=True, text=True, cwd=REPO, timeout=180)
    assert r.returncode == 2
    assert "trainer.lrr" in r.stderr and "did you mean 'trainer.lr'" in r.stderr


def test_cli_help_lists_subcommands():
    r = subprocess.run([sys.executable, "-m", "rl.cli", "--help"], capture_output=True, text=True, cwd=REPO, timeout=180)
    assert r.returncode == 0
    for sub in ["train", "eval", "serve", "envs", "export", "report"]:
        assert sub in r.stdout
    for sub in ["train", "eval", "serve", "export", "report"]:
        r = subprocess.run([sys.executable, "-m", "rl.cli", sub, "--help"], capture_output=True, text=True, cwd=REPO, timeout=180)
        assert r.returncode == 0 and "usage" in r.stdout, sub


def test_cluster_launcher_validates_and_builds_a_job_submit_command():
    r = subprocess.run([sys.executable, "scripts/ray_submit.py", "--address", "http://head:8265", "--print-only",
                        "configs/tiny.yaml", "trainer.steps=3"], capture_output=True, text=True, cwd=REPO, timeout=180)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ray job submit --address http://head:8265 --runtime-env-json")
    assert "vllm==" in r.stdout and "trainer.steps=3" in r.stdout
    bad = subprocess.run([sys.executable, "scripts/ray_submit.py", "--address", "x", "--print-only", "configs/tiny.yaml",
                          "trainer.stepz=3"], capture_output=True, text=True, cwd=REPO, timeout=180)
    assert bad.returncode != 0 and "did you mean 'trainer.steps'" in bad.stderr


def test_yaml_words_off_on_yes_no_stay_strings():
    cfg = load_config(None, ["algorithm.dynamic_sampling=off", "rollout.enforce_eager=true"])
    assert cfg.algorithm.dynamic_sampling == "off" and cfg.rollout.enforce_eager is True


# ----------------------------------------------------------------------------- no dead keys
def _section_reads() -> set[str]:
    """`section.key` for every config key that code outside rl/config.py reads.

    Reads are attribute accesses in the code (docstrings and comments do not count): `X.key` where
    X ends in `.section` (`cfg.trainer.lr`), is a name bound from one (`a = cfg.algorithm`), or is a
    parameter annotated with the section's class (`section: RolloutSection`).
    """
    import ast
    import dataclasses

    from rl.config import RunConfig

    sections = {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in dataclasses.fields(RunConfig)
                if dataclasses.is_dataclass(getattr(RunConfig(), f.name))}
    reads: set[str] = set()
    files = [p for d in ("rl", "scripts") for p in (REPO / d).rglob("*.py") if p.name != "config.py"]
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and node.value.attr in sections:
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        aliases[t.id] = node.value.attr
            if isinstance(node, ast.arg) and node.annotation is not None:
                ann = ast.unparse(node.annotation)
                for sec, cls in sections.items():
                    if cls in ann:
                        aliases[node.arg] = sec
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            base = node.value
            if isinstance(base, ast.Attribute) and base.attr in sections:
                reads.add(f"{base.attr}.{node.attr}")
            elif isinstance(base, ast.Name) and base.id in aliases:
                reads.add(f"{aliases[base.id]}.{node.attr}")
    return reads


def test_every_config_key_is_read_by_the_code():
    import dataclasses

    from rl.config import RunConfig

    cfg = RunConfig()
    keys = {f"{f.name}.{sf.name}" for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(getattr(cfg, f.name))
            for sf in dataclasses.fields(getattr(cfg, f.name))}
    reads = _section_reads()
    assert "trainer.lr" in reads and "rollout.kv_cache_gib" in reads  # the walk sees direct and parameter reads
    dead = sorted(keys - reads)
    assert not dead, f"config keys nothing reads (wire them or remove them): {dead}"


def test_dry_run_prints_the_config_and_every_role_s_placement(capsys):
    from rl.cli import main

    assert main(["train", str(REPO / "configs" / "tiny.yaml"), "algorithm.kl_coef=0.1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    placement = out.split("# placement\n", 1)[1].split("\n# ", 1)[0].splitlines()  # up to the dry run's next section
    assert [line.split(":", 1)[0] for line in placement] == ["ray", "trainer", "reference", "rollout", "environments"]
    assert "ZeRO-1" in placement[1] and "kl_coef: 0.1" in out


def test_image_keys_are_checked_before_anything_starts():
    with pytest.raises(ConfigError, match=r"'rollout.max_images_per_prompt': value 9 must be in \[0, 8\]"):
        load_config(None, ["rollout.max_images_per_prompt=9"])
    with pytest.raises(ConfigError, match="images need the jointrl chat codec"):
        load_config(None, ["rollout.max_images_per_prompt=2", "model.chat_codec=hf"])
    with pytest.raises(ConfigError, match="'rollout.image_pixels'.*allowed values: 'real', 'blank'"):
        load_config(None, ["rollout.image_pixels=grey"])
    cfg = load_config(None, ["rollout.max_images_per_prompt=2", "rollout.image_pixels=blank"])
    assert (cfg.rollout.max_images_per_prompt, cfg.rollout.image_pixels) == (2, "blank")


def test_an_optional_key_takes_its_type_or_null_and_nothing_else():
    from rl.config import _coerce

    assert _coerce("k", None, float | None) is None and _coerce("k", 2, float | None) == 2.0
    with pytest.raises(ConfigError, match=r"config key 'k': value 'fast' does not match"):
        _coerce("k", "fast", float | None)
    with pytest.raises(ConfigError, match=r"config key 'rollout.step_time_budget_s': value 'fast' does not match"):
        load_config(None, ["rollout.partial=on", "rollout.step_time_budget_s=fast"])
