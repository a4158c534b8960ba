"""`jointrl models pull NAME` / `jointrl models list` (rl/models_cli.py over model/hub.py).

Fast: argument handling, the listing of an empty cache, an unknown name. Slow: the console script in a
subprocess, with pip pointed at no index, pulling the already-cached MoE: its last stdout line is the
checkpoint directory and nothing is downloaded.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.cli import build_parser, main


def test_models_subcommand_parses():
    args = build_parser().parse_args(["models", "pull", "smollm2-135m-moe"])
    assert (args.cmd, args.models_cmd, args.name) == ("models", "pull", "smollm2-135m-moe")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["models"])  # a sub-subcommand is required


def test_list_on_an_empty_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JOINTRL_CACHE", str(tmp_path))
    assert main(["models", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["name", "params", "disk", "cached"]
    rows = {ln.split()[0]: ln for ln in lines[1:]}
    assert set(rows) == {"smollm2-135m", "smollm2-135m-moe"}
    assert "135M" in rows["smollm2-135m"] and "no (downloads 93 MB)" in rows["smollm2-135m"]
    assert "373M" in rows["smollm2-135m-moe"] and "no (downloads 93 MB)" in rows["smollm2-135m-moe"]  # through its base
    assert rows["smollm2-135m-moe"].endswith(str(tmp_path / "models" / "smollm2-135m-moe"))


def test_unknown_name_exits_2_naming_the_known_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JOINTRL_CACHE", str(tmp_path))
    assert main(["models", "pull", "gpt-5"]) == 2
    err = capsys.readouterr().err
    assert "gpt-5" in err and "smollm2-135m-moe" in err
    assert not (tmp_path / "models" / "gpt-5").exists()


@pytest.mark.slow
def test_pull_prints_the_directory_last_and_is_offline_when_cached():
    from model import hub

    want = hub.pull("smollm2-135m-moe")
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_INDEX_URL": "http://127.0.0.1:9/simple"}
    exe = Path(sys.executable).with_name("jointrl")
    proc = subprocess.run([str(exe), "models", "pull", "smollm2-135m-moe"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert Path(last) == want
    cfg = json.loads((Path(last) / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["num_local_experts"] == 4
    assert "downloading" not in proc.stderr
