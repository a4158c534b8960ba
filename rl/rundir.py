"""Whether `jointrl train` may use a run directory: a new run, a resume of the same run, or a refusal.

A run directory records the resolved config it was started with (`RUN_DIR/config.json`) and its hash
(`RUN_DIR/config.sha256`, over the keys that define the run). Starting `jointrl train` on a directory that
already holds a run:

* the same config (equal hash)    -> the run resumes from its last checkpoint (SFT or RL), and says so;
* a different config             -> refused, naming every key that differs, unless the caller chose
  `--resume` (continue it under the new config; the change is appended to RUN_DIR/config_changes.jsonl) or
  `--new-run` (the old directory is renamed to RUN_DIR.prev-<time> and a fresh run starts).

Keys that may change between a run and its resume without making it another run (`RESUMABLE_KEYS`): the
number of RL steps (extend a run), how often it checkpoints, `trainer.resume`, and the logging section.
A run with `trainer.resume=false` asks to start over in place, so nothing here refuses it.

This module only reads and writes those small files and renames directories; it starts nothing.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

CONFIG_FILE = "config.json"
HASH_FILE = "config.sha256"
CHANGES_FILE = "config_changes.jsonl"
# Dotted keys (or section prefixes ending in ".") excluded from the hash: changing them continues the same run.
RESUMABLE_KEYS = ("trainer.steps", "trainer.checkpoint_every", "trainer.resume", "logging.")

Choice = Literal["auto", "resume", "new"]


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; mappings become dotted keys, lists stay values."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def _identity(flat: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in flat.items()
            if not any(k == r or (r.endswith(".") and k.startswith(r)) for r in RESUMABLE_KEYS)}


def config_hash(config: dict[str, Any]) -> str:
    """sha256 of the keys that define the run (RESUMABLE_KEYS left out), over canonical JSON."""
    blob = json.dumps(_identity(flatten(config)), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def differing_keys(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for every defining key whose value differs; a missing key reads `<absent>`."""
    a, b = _identity(flatten(old)), _identity(flatten(new))
    absent = "<absent>"
    return [(k, a.get(k, absent), b.get(k, absent)) for k in sorted(set(a) | set(b)) if a.get(k, absent) != b.get(k, absent)]


@dataclass(frozen=True)
class RunDirDecision:
    """What `jointrl train` does with its run directory."""

    action: Literal["new", "resume", "restart", "refuse"]  # restart: trainer.resume=false, start over in place
    run_dir: Path
    message: str
    diffs: tuple[tuple[str, Any, Any], ...] = ()
    move_aside_to: Path | None = None  # --new-run over an existing run: the old directory's new name


def _progress_of(run_dir: Path) -> str:
    meta = run_dir / "checkpoint" / "meta.json"
    if meta.is_file():
        try:
            return f"RL step {json.loads(meta.read_text())['step']}"
        except (OSError, ValueError, KeyError):
            return "an unreadable RL checkpoint"
    sft = run_dir / "sft_snapshot" / "sft_meta.json"
    if sft.is_file():
        try:
            return f"SFT step {json.loads(sft.read_text())['sft_step']}"
        except (OSError, ValueError, KeyError):
            return "an unreadable SFT checkpoint"
    return "the start (no checkpoint yet)"


def decide(config: dict[str, Any], run_dir: Path, choice: Choice = "auto", resume_enabled: bool = True) -> RunDirDecision:
    """The decision for a run of `config` (the resolved config as `rl.config.to_dict` gives it) in `run_dir`."""
    run_dir = Path(run_dir)
    old_file = run_dir / CONFIG_FILE
    if not old_file.is_file():
        return RunDirDecision("new", run_dir, f"new run in {run_dir}")
    if choice == "new":
        aside = run_dir.with_name(f"{run_dir.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
        return RunDirDecision("new", run_dir, f"--new-run: the existing run moves to {aside}; a new run starts in {run_dir}",
                              move_aside_to=aside)
    if not resume_enabled:
        return RunDirDecision("restart", run_dir, f"trainer.resume=false: the run in {run_dir} starts over in place")
    try:
        old = json.loads(old_file.read_text())
    except (OSError, ValueError) as e:
        old = {"<unreadable>": str(e)}
    diffs = tuple(differing_keys(old, config))
    where = _progress_of(run_dir)
    if not diffs:
        return RunDirDecision("resume", run_dir, f"{run_dir} holds this run (same config, sha256 {config_hash(config)[:12]}): "
                                                 f"resuming from {where} (--new-run starts over)")
    listed = "; ".join(f"{k}: {o!r} -> {n!r}" for k, o, n in diffs[:20]) + (f"; and {len(diffs) - 20} more" if len(diffs) > 20 else "")
    if choice == "resume":
        return RunDirDecision("resume", run_dir, f"--resume: continuing the run in {run_dir} from {where} under a changed "
                                                 f"config ({listed})", diffs)
    return RunDirDecision("refuse", run_dir,
                          f"run directory {run_dir} holds a run with a different config ({len(diffs)} key(s) differ: {listed}). "
                          "Pass --resume to continue it under this config, --new-run to keep it aside and start a new run, "
                          "or give another name / run_dir", diffs)


def apply(decision: RunDirDecision, config: dict[str, Any]) -> None:
    """Carry out a decision that is not a refusal: move an old run aside, record a config change, and write
    the config and its hash into the run directory."""
    if decision.action == "refuse":
        raise ValueError(decision.message)
    run_dir = decision.run_dir
    if decision.move_aside_to is not None and run_dir.exists():
        run_dir.rename(decision.move_aside_to)
    run_dir.mkdir(parents=True, exist_ok=True)
    if decision.diffs:
        with open(run_dir / CHANGES_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "changed": [list(d) for d in decision.diffs]},
                               default=str) + "\n")
    write_config(run_dir, config)


def write_config(run_dir: Path, config: dict[str, Any]) -> None:
    """RUN_DIR/config.json (the resolved config) and RUN_DIR/config.sha256 (its defining keys' hash)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str))
    (run_dir / HASH_FILE).write_text(config_hash(config) + "\n")
