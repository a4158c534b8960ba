"""docs/envs.md's complete one-file domain, run as it stands in the page: registered without editing any tracked
file (a plug-in path in $JOINTRL_ENV_PLUGINS or the run config's `envs.plugins`), it passes `jointrl envs check`
and a `jointrl train --dry-run` accepts it; a broken plug-in path is a config error naming the key."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _doc_domain(tmp_path: Path) -> Path:
    page = (REPO / "docs" / "envs.md").read_text()
    section = page.split("## A complete domain in one file", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(code) == 1, "the section holds one python block: the whole domain"
    path = tmp_path / "mysum.py"
    path.write_text(code[0])
    return path


def _jointrl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rl.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JOINTRL_PROGRESS": "0", **(env or {})})


def test_the_page_domain_passes_the_checker_as_a_plugin_file(tmp_path):
    plugin = _doc_domain(tmp_path)
    p = _jointrl("envs", "check", "mysum-v0", env={"JOINTRL_ENV_PLUGINS": str(plugin), "JOINTRL_CACHE": str(tmp_path / "c")})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "conformance check of mysum-v0: PASSED" in p.stdout
    assert "[ok] reference scores 1" in p.stdout and "[ok] held-out disjoint" in p.stdout
    assert not (REPO / "mysum.py").exists() and "mysum" not in (REPO / "envs" / "builtin.py").read_text()


def test_a_run_config_names_the_plugin(tmp_path, capsys, monkeypatch):
    from rl.cli import main as jointrl

    monkeypatch.setenv("JOINTRL_ENV_PLUGINS", "")  # the config sets it for the run's processes; restored after

    plugin = _doc_domain(tmp_path)
    base = ["train", "configs/tiny.yaml", f"run_dir={tmp_path / 'run'}", "envs.weights={sum: 1.0}", "envs.env_ids.sum=mysum-v0"]
    assert jointrl([*base, f"envs.plugins=[{tmp_path / 'nope.py'}]", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "config key 'envs.plugins'" in err and "no such plug-in file" in err
    assert jointrl([*base, "--dry-run"]) == 2  # without the plug-in the id is unknown
    assert "config key 'envs.env_ids.sum': unknown environment id 'mysum-v0'" in capsys.readouterr().err
    assert jointrl([*base, f"envs.plugins=[{plugin}]", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "plugins:" in out and str(plugin) in out and "mysum-v0" in out
    assert str(plugin) in os.environ["JOINTRL_ENV_PLUGINS"]  # processes the run starts find it too
