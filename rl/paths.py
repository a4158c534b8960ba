"""One place for scratch and caches: everything goes under the run's cache dir, not scattered in $HOME.

`setup_cache_env(cache_dir)` points the caches of the libraries we use at sub-folders of one
directory (default `.cache/` in the repo, or $JOINTRL_CACHE). It only sets environment variables
that are not already set by the user, so a cluster launcher can still place them elsewhere.
Call it before importing vllm / deepspeed / ray / wandb.
"""
from __future__ import annotations

import os
from pathlib import Path

from jointrl.paths import cache_root


def setup_cache_env(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    subdirs = {
        "JOINTRL_CACHE": root,
        "VLLM_CACHE_ROOT": root / "vllm",
        "TORCH_EXTENSIONS_DIR": root / "torch_extensions",
        "TRITON_CACHE_DIR": root / "triton",
        "HF_HOME": root / "hf",
        "HF_DATASETS_CACHE": root / "hf" / "datasets",
        "WANDB_DIR": root / "wandb",
        "WANDB_CACHE_DIR": root / "wandb" / "cache",
        "WANDB_CONFIG_DIR": root / "wandb" / "config",
        "RAY_TMPDIR": root / "ray",
        "XDG_CACHE_HOME": root / "xdg",
        "MPLCONFIGDIR": root / "mpl",
    }
    for var, path in subdirs.items():
        if var not in os.environ:
            Path(path).mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(path)
    # No hub access here: never try to download at run time.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return root
