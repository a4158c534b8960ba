"""`jointrl train` through its command line: refusing what was not asked, the run-directory guard
(resume only the same config; --resume / --new-run), and the dry run's checks (environment ids, model
names, YAML errors by line, no downloads); `jointrl models list` stays fast; every flag has help text."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOINTRL = [sys.executable, "-m", "rl.cli"]


def _run(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*JOINTRL, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "JOINTRL_PROGRESS": "0", **(env or {})})


def test_train_without_a_config_prints_usage_and_exits_2():
    p = _run("train")
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("usage: jointrl train") and "give a YAML run config" in p.stderr
    assert p.stdout == ""
    # overrides alone are not a config either
    p = _run("train", "trainer.lr=1e-5")
    assert p.returncode == 2 and "give a YAML run config" in p.stderr


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    from rl.cli import main

    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_run_directory_resumes_only_the_same_config(tmp_path, capsys):
    from rl.config import load_config, to_dict
    from rl.rundir import CHANGES_FILE, HASH_FILE, apply, config_hash, decide, write_config

    run_dir = tmp_path / "run"
    base = ["configs/tiny.yaml", f"run_dir={run_dir}", "envs.weights={terminal: 1.0}"]
    rc, out, _ = _main(capsys, "train", *base, "--dry-run")
    assert rc == 0 and f"new run in {run_dir}" in out
    assert not run_dir.exists()  # a dry run writes nothing

    # a run that was started with this config
    cfg = load_config("configs/tiny.yaml", [f"run_dir={run_dir}", "envs.weights={terminal: 1.0}"])
    write_config(run_dir, to_dict(cfg))
    assert (run_dir / HASH_FILE).read_text().strip() == config_hash(to_dict(cfg))
    rc, out, _ = _main(capsys, "train", *base, "--dry-run")
    assert rc == 0 and "same config" in out and "resuming from the start (no checkpoint yet)" in out
    (run_dir / "checkpoint").mkdir()
    (run_dir / "checkpoint" / "meta.json").write_text(json.dumps({"step": 3, "policy_version": 3}))
    rc, out, _ = _main(capsys, "train", *base, "trainer.steps=20", "--dry-run")  # more steps: the same run, extended
    assert rc == 0 and "resuming from RL step 3" in out

    # a changed config is refused, naming the keys and the way out
    rc, out, err = _main(capsys, "train", *base, "trainer.lr=0.5", "algorithm.group_size=8", "--dry-run")
    assert rc == 2
    assert "trainer.lr: 0.0002 -> 0.5" in err and "algorithm.group_size: 4 -> 8" in err and "2 key(s) differ" in err
    assert "--resume" in err and "--new-run" in err
    rc, out, _ = _main(capsys, "train", *base, "trainer.lr=0.5", "--dry-run", "--resume")
    assert rc == 0 and "--resume: continuing" in out and "trainer.lr" in out
    rc, out, _ = _main(capsys, "train", *base, "trainer.lr=0.5", "--dry-run", "--new-run")
    assert rc == 0 and "--new-run: the existing run moves to" in out
    assert json.loads((run_dir / "config.json").read_text())["trainer"]["lr"] == 2e-4  # the dry run changed nothing

    # what the real run does with those decisions (rl/cli.py applies them before training starts)
    new = to_dict(load_config("configs/tiny.yaml", [f"run_dir={run_dir}", "envs.weights={terminal: 1.0}", "trainer.lr=0.5"]))
    d = decide(new, run_dir, "resume")
    apply(d, new)
    change = json.loads((run_dir / CHANGES_FILE).read_text().splitlines()[-1])
    assert change["changed"] == [["trainer.lr", 2e-4, 0.5]]
    assert decide(new, run_dir).action == "resume"  # the recorded config is the new one now
    d = decide(new, run_dir, "new")
    apply(d, new)
    assert d.move_aside_to.is_dir() and (d.move_aside_to / "checkpoint" / "meta.json").is_file()
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "config.sha256"]


def test_cli_refuses_a_changed_config_before_anything_starts(tmp_path):
    from rl.config import load_config, to_dict
    from rl.rundir import write_config

    run_dir = tmp_path / "run"
    write_config(run_dir, to_dict(load_config("configs/tiny.yaml", [f"run_dir={run_dir}"])))
    t0 = time.perf_counter()
    p = _run("train", "configs/tiny.yaml", f"run_dir={run_dir}", "trainer.lr=0.5")  # a real run, not a dry one
    assert p.returncode == 2, p.stderr[-2000:]
    assert "holds a run with a different config" in p.stderr and "trainer.lr: 0.0002 -> 0.5" in p.stderr
    assert time.perf_counter() - t0 < 60 and "Traceback" not in p.stderr
    assert sorted(x.name for x in run_dir.iterdir()) == ["config.json", "config.sha256"]


def test_dry_run_checks_ids_and_names_with_suggestions(capsys):
    rc, _, err = _main(capsys, "train", "configs/tiny.yaml", "envs.env_ids.terminal=terminal-basic-v0", "--dry-run")
    assert rc == 2 and "config key 'envs.env_ids.terminal'" in err and "did you mean 'terminal-basics-v0'" in err
    rc, _, err = _main(capsys, "train", "configs/tiny.yaml", "model.arch=smollm2-135-moe", "--dry-run")
    assert rc == 2 and "config key 'model.arch'" in err and "did you mean 'smollm2-135m-moe'" in err
    rc, _, err = _main(capsys, "train", "configs/tiny.yaml", "trainer.sft_data=/nonexistent.jsonl", "--dry-run")
    assert rc == 2 and "trainer.sft_data" in err


def test_dry_run_refuses_what_the_engine_would_refuse_for_the_hybrid_moe(capsys, tmp_path):
    """The engine refuses a HybridMoe whose DSA layers it would serve inexactly (max_model_len past index_topk) or
    in fp32 on CPU; the dry run says so before anything starts, naming the keys."""
    rc, _, err = _main(capsys, "train", "configs/tiny.yaml", "rollout.max_model_len=4096", "--dry-run")
    assert rc == 2 and "rollout.max_model_len" in err and "index_topk (2048)" in err
    from rl.dryrun import _gpus_here

    if _gpus_here() == 0:  # the bf16 rule is the CPU kernel's
        rc, _, err = _main(capsys, "train", "configs/tiny.yaml", "rollout.dtype=float32", "--dry-run")
        assert rc == 2 and "rollout.dtype" in err and "bfloat16" in err
    # the 32k-position shape with top-k 32,768 serves a 24k context exactly
    # (a run directory of its own: the dry run also refuses one that holds a run with another config)
    rc, out, err = _main(capsys, "train", "configs/longhorizon_xl.yaml", f"run_dir={tmp_path / 'xl'}", "--dry-run")
    assert rc == 0, err
    assert "engine: refused" not in out


def test_yaml_syntax_error_points_at_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrainer:\n  lr: 1e-5\n  steps: [1, 2\nenvs:\n  max_turns: 3\n")
    p = _run("train", str(bad), "--dry-run")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"config file {bad}, line 5" in p.stderr and "not valid YAML" in p.stderr


def test_dry_run_downloads_nothing_and_says_what_a_run_pulls(tmp_path):
    cache = tmp_path / "cache"
    t0 = time.perf_counter()
    p = _run("train", "configs/quickstart.yaml", f"run_dir={tmp_path / 'run'}", "--dry-run", env={"JOINTRL_CACHE": str(cache)})
    dt = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    assert "model.arch: pulls 'smollm2-135m-moe' (downloads 93 MB" in p.stdout
    assert "# placement" in p.stdout and "memory: the run needs" in p.stdout
    assert not (cache / "models").exists() and not (cache / "downloads").exists() and not (tmp_path / "run").exists()
    assert dt < 60, dt  # seconds, not a model conversion (~45 s + download on first use)
    print(f"dry run of the quickstart config: {dt:.1f} s")


def test_models_list_is_fast_and_imports_no_torch():
    code = ("import sys, time; t = time.perf_counter(); from rl.cli import main; rc = main(['models', 'list']); "
            "print('torch' in sys.modules, round(time.perf_counter() - t, 2), rc)")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    torch_loaded, secs, rc = p.stdout.split()[-3:]
    assert rc == "0" and "smollm2-135m-moe" in p.stdout, p.stderr
    assert torch_loaded == "False"  # the 7-20 s were `import model` (torch + transformers) for a registry of two rows
    print(f"jointrl models list: {secs} s in-process")


def test_every_flag_has_help_text():
    from rl.cli import build_parser

    missing = []

    def walk(p: argparse.ArgumentParser, path: list[str]) -> None:
        for a in p._actions:  # noqa: SLF001 - argparse keeps them here
            if isinstance(a, argparse._SubParsersAction):  # noqa: SLF001
                for name, sp in a.choices.items():
                    walk(sp, [*path, name])
            elif not isinstance(a, argparse._HelpAction) and not a.help:  # noqa: SLF001
                missing.append(" ".join([*path, a.dest]))

    walk(build_parser(), [])
    mine = [m for m in missing if not m.startswith("serve")]  # `jointrl serve`'s flags come from rl/serve/settings.py
    assert mine == [], mine
