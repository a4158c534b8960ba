"""The error a bad configuration raises, in a module of its own so every component can raise it without
importing the config tree (rl/config.py re-exports it)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, raised before any work starts."""
