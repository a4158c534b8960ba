"""One logger set-up for every entry point, and a progress-bar helper for long work.

`setup_logging(level)` configures the `jointrl` logger hierarchy once (idempotent) with a
compact format on stderr. `progress(iterable, desc, total)` wraps tqdm, silenced when stderr is
not a terminal and JOINTRL_PROGRESS=0, so CI logs stay readable.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Iterable, TypeVar

T = TypeVar("T")
_CONFIGURED = False


def setup_logging(level: str = "INFO") -> logging.Logger:
    global _CONFIGURED
    logger = logging.getLogger("jointrl")
    if not _CONFIGURED:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
        _CONFIGURED = True
    logger.setLevel(level)
    return logger


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"jointrl.{name}")


def progress(iterable: Iterable[T] | None = None, *, desc: str = "", total: int | None = None, **kw):
    from tqdm.auto import tqdm

    disable = os.environ.get("JOINTRL_PROGRESS", "1") == "0"
    return tqdm(iterable, desc=desc, total=total, disable=disable, dynamic_ncols=True, **kw)
