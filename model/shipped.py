"""The configs the project ships (`configs/model/{tiny,small,full}.json`) and how to load them by name.

`load_shipped_config("tiny")` or a path to a JSON file / HF checkpoint dir -> `HybridMoeConfig`. Nothing else.
"""
from __future__ import annotations

import json
from pathlib import Path

from .configuration import HybridMoeConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "model"
SHIPPED_CONFIGS = ("tiny", "small", "full")


def load_shipped_config(name_or_path: str, **overrides) -> HybridMoeConfig:
    """A shipped config by name, a JSON file, or a checkpoint directory holding config.json."""
    p = Path(name_or_path)
    if name_or_path in SHIPPED_CONFIGS:
        p = CONFIG_DIR / f"{name_or_path}.json"
    elif p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no model config {name_or_path!r}: expected one of {SHIPPED_CONFIGS} or a path to "
                                f"a config JSON / checkpoint dir (looked at {p})")
    d = json.loads(p.read_text())
    d.pop("model_type", None)
    d.pop("_comment", None)
    d.update(overrides)
    return HybridMoeConfig(**d)
