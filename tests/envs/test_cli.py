"""`jointrl envs list|check|play|tasks` through envs.cli.main."""
from __future__ import annotations

import pytest

from envs.cli import main
from envs.sandbox.base import SandboxUnavailable


def _bwrap_or_skip():
    try:
        from envs.sandbox.bwrap import BwrapBackend

        BwrapBackend().open().close()
    except SandboxUnavailable as e:
        pytest.skip(f"bubblewrap sandbox unavailable: {e}")


def test_list_shows_terminal(capsys):
    assert main(["list"]) == 0
    assert "terminal-v0" in capsys.readouterr().out


def test_unknown_id_is_a_clear_error(capsys):
    assert main(["check", "nope-v0"]) == 2
    assert "unknown env id 'nope-v0'" in capsys.readouterr().err


def test_play_prints_a_transcript_with_reward(capsys):
    _bwrap_or_skip()
    assert main(["play", "terminal-v0", "--index", "2"]) == 0
    out = capsys.readouterr().out
    assert "=> bash(" in out and "reward=1 terminated=True" in out
    assert main(["play", "terminal-v0", "--policy", "noop"]) == 0
    assert "reward=0 terminated=True" in capsys.readouterr().out


def test_tasks_builds_a_cached_set(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("JOINTRL_CACHE", str(tmp_path))
    assert main(["tasks", "terminal-v0", "--split", "heldout", "--n", "5"]) == 0
    assert "heldout seed=0: 5 tasks; first: terminal-v0/heldout/s0/00000-grep_count" in capsys.readouterr().out
    assert any((tmp_path / "envs" / "terminal-v0").iterdir())
