"""What the project ships for its own model: configs (`configs/model/{tiny,small,full}.json`) and the
tokenizer (`model/tokenizer/`), and the one builder of a checkpoint from them.

- `load_shipped_config("tiny")` or a path to a JSON file / HF checkpoint dir -> `HybridMoeConfig`;
- `copy_tokenizer(dst)` puts the tokenizer files of a source directory (by default the shipped
  tokenizer) next to a checkpoint's weights;
- `build_random_checkpoint("tiny", out_dir, seed)` writes a fresh-weights `HybridMoeForCausalLM`
  with the shipped tokenizer, atomically (a marker file says it is complete), so concurrent callers
  and interrupted builds never see half a checkpoint.

What this module does not do: download anything, or build other architectures (test-only builders
live under tests/).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .chat import TOKENIZER_DIR
from .configuration import HybridMoeConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "model"
SHIPPED_CONFIGS = ("tiny", "small", "full")
# The files that make a HF tokenizer (and its chat template) usable next to a checkpoint.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
COMPLETE_MARKER = ".complete"


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


def copy_tokenizer(dst: str | os.PathLike[str], src: str | os.PathLike[str] = TOKENIZER_DIR, overwrite: bool = False) -> Path:
    """Copy the tokenizer files of `src` that exist into `dst` (kept where `dst` has them, unless `overwrite`)."""
    dst, src = Path(dst), Path(src)
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and (overwrite or not (dst / name).exists()):
            shutil.copy(src / name, dst / name)
    return dst


def build_random_checkpoint(name_or_path: str, out_dir: str | os.PathLike[str], seed: int = 0, **overrides) -> Path:
    """A `HybridMoeForCausalLM` with fresh weights (torch seed `seed`) of a shipped config, plus the
    shipped tokenizer, in `out_dir`. Idempotent: a complete `out_dir` is returned as it is."""
    import torch

    from .modeling import HybridMoeForCausalLM

    out = Path(out_dir)
    if (out / COMPLETE_MARKER).exists():
        return out
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(seed)
    HybridMoeForCausalLM(load_shipped_config(name_or_path, **overrides)).save_pretrained(tmp)
    copy_tokenizer(tmp)
    (tmp / COMPLETE_MARKER).write_text(json.dumps({"config": name_or_path, "seed": seed, "overrides": overrides}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
