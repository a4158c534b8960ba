"""Which verifiers environments become jointrl domains, and how: one `VerifiersEnvSpec` each.

`SHIPPED` lists the environments this repository registers when the verifiers venv exists: the two
loaders of `staros-stardata` (constrained poetry graded by deterministic prosody / Oulipo checks; the
environment packages on the index that load offline). Another package adds its own with
`envs.verifiers_adapter.register_environment(spec)` from its `jointrl.envs` entry point (docs/envs.md,
"verifiers environments").
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from envs.verifiers_adapter.judge import LoaderRef


@dataclass(frozen=True)
class VerifiersEnvSpec:
    """env_id: the jointrl id (`vf-<name>-v0` by convention); target: `module:function` (a module installed in
    the verifiers venv) or `/path/to/file.py:function`, returning a verifiers Environment; kwargs: its keyword arguments; heldout_kwargs: the same loader's
    arguments for a held-out dataset, when the environment makes its held-out split that way (else its
    `eval_dataset`, else a hash of the prompt decides); family: the sampling / dashboard group."""

    env_id: str
    target: str
    family: str
    description: str
    # Left out of the hash (a dict has none), kept in ==: specs are cache keys for their tasks and classes.
    kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    heldout_kwargs: Mapping[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*-v\d+", self.env_id):
            raise ValueError(f"verifiers env id {self.env_id!r} must look like 'vf-name-v0'")
        if ":" not in self.target:
            raise ValueError(f"verifiers loader {self.target!r} must be 'module:function' or '/path/file.py:function'")

    def loader(self, heldout: bool = False) -> LoaderRef:
        kw = self.heldout_kwargs if heldout and self.heldout_kwargs is not None else self.kwargs
        return LoaderRef(self.target, json.dumps(dict(kw), sort_keys=True))


SHIPPED: tuple[VerifiersEnvSpec, ...] = (
    VerifiersEnvSpec("vf-constraint-gym-v0", "stardata.envs.constraint_gym:load_environment", family="verifiers-poetry",
                     description="verifiers: staros-stardata constraint gym (haiku, limerick, sonnet, villanelle, "
                                 "acrostic, lipogram, univocalic, palindrome, snowball), prosody / Oulipo rubric"),
    VerifiersEnvSpec("vf-lipogram-v0", "stardata.envs.constraint_gym:load_lipogram_env", family="verifiers-poetry",
                     description="verifiers: staros-stardata lipogram poems (forbidden e / a / o), hardened reward",
                     heldout_kwargs={"holdout": True}),
)
