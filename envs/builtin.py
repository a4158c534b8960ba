"""Registers the domains that ship with jointrl (the `builtin` entry point of group `jointrl.envs`).

One line per domain. A domain whose optional third-party dependency is missing (e.g. cadquery for
CAD) is skipped with the reason logged at INFO; a domain that fails for any other reason (a bug)
is skipped with a WARNING, so it cannot take the other domains down. Both reasons are kept in
`SKIPPED` and shown by `jointrl envs list`.
"""
from __future__ import annotations

import importlib
import logging

log = logging.getLogger(__name__)

SKIPPED: dict[str, str] = {}  # domain -> why it was not registered


def _try(domain: str, target: str) -> None:
    module, _, fn = target.partition(":")
    try:
        getattr(importlib.import_module(module), fn)()
    except ModuleNotFoundError as e:
        ours = (e.name or "").split(".")[0] in {"envs", "rewards", "rl", "model"}
        SKIPPED[domain] = f"{'error' if ours else 'optional dependency missing'}: {e}"
        (log.warning if ours else log.info)("environment domain %r skipped: %s", domain, e)
    except Exception as e:  # noqa: BLE001 - one broken domain must not hide the others
        SKIPPED[domain] = f"error: {type(e).__name__}: {e}"
        log.warning("environment domain %r failed to register: %s", domain, e, exc_info=True)


def register_all() -> None:
    _try("terminal", "envs.terminal:register")
    _try("browse", "envs.browse:register")
    _try("cad", "envs.cad:register")
    _try("swe", "envs.swe:register")
    _try("reasoning_gym", "envs.reasoning_gym:register")
    _try("verifiers", "envs.verifiers_adapter:register")
