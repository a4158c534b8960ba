"""Which verifiers environments become jointrl domains, and how: one `VerifiersEnvSpec` each.

`SHIPPED` lists the environments this repository registers when the verifiers venv exists: the constraint
gym of `staros-stardata` (constrained poetry graded by deterministic prosody / Oulipo checks; the
environment package on the index that loads offline), and a lipogram environment kept in this package
(`lipogram.py`: stardata's lipogram with a wider set of forbidden letters and a theme check). Another package adds its own with
`envs.verifiers_adapter.register_environment(spec)` from its `jointrl.envs` entry point (docs/envs.md,
"verifiers environments").
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from envs.verifiers_adapter.judge import LoaderRef


@dataclass(frozen=True)
class VerifiersEnvSpec:
    """env_id: the jointrl id (`vf-<name>-v0` by convention); target: `module:function` (a module installed in
    the verifiers venv) or `/path/to/file.py:function`, returning a verifiers Environment; kwargs: its keyword arguments; heldout_kwargs: the same loader's
    arguments for a held-out dataset, when the environment makes its held-out split that way (else its
    `eval_dataset`, else a hash of the prompt decides); family: the sampling / dashboard group;
    default_mix / note: as `envs.registry.EnvSpec` (False, with the measured prior, for an environment whose
    best constant answer scores >= 0.2 on held-out tasks); constants: extra constant answers the
    conformance checker's best-constant check tries on it (texts a policy could learn to always give)."""

    env_id: str
    target: str
    family: str
    description: str
    # Left out of the hash (a dict has none), kept in ==: specs are cache keys for their tasks and classes.
    kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    heldout_kwargs: Mapping[str, Any] | None = field(default=None, hash=False)
    default_mix: bool = True
    note: str = ""
    constants: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*-v\d+", self.env_id):
            raise ValueError(f"verifiers env id {self.env_id!r} must look like 'vf-name-v0'")
        if ":" not in self.target:
            raise ValueError(f"verifiers loader {self.target!r} must be 'module:function' or '/path/file.py:function'")

    def loader(self, heldout: bool = False) -> LoaderRef:
        kw = self.heldout_kwargs if heldout and self.heldout_kwargs is not None else self.kwargs
        return LoaderRef(self.target, json.dumps(dict(kw), sort_keys=True))


# Constant poems a policy could settle on: one 5-line text without e, a or o (the lipogram's letters), a
# haiku and a limerick-shaped verse. Measured with `jointrl envs check` (docs/envs.md, "verifiers").
POEM_WITHOUT_EAO = ("Still nights find us\nWithin birch husks, dry light,\nQuilting, lifting mist,\n"
                    "Winds sing until dusk;\nSpring thrills its slim thin string.")
HAIKU = "Old pond in the rain\nA frog leaps into the dark\nThe water answers"
LIMERICK = ("There once was a cat from the coast\nWho liked his warm butter on toast\nHe ate it with cream\n"
            "While lost in a dream\nAnd that is the thing he loved most")
POEM_CONSTANTS = (POEM_WITHOUT_EAO, HAIKU, LIMERICK)

SHIPPED: tuple[VerifiersEnvSpec, ...] = (
    VerifiersEnvSpec("vf-constraint-gym-v0", "stardata.envs.constraint_gym:load_environment", family="verifiers-poetry",
                     description="verifiers: staros-stardata constraint gym (haiku, limerick, sonnet, villanelle, "
                                 "acrostic, lipogram, univocalic, palindrome, snowball), prosody / Oulipo rubric",
                     constants=POEM_CONSTANTS, default_mix=False,
                     note="constant-answer prior 0.306: the text 'True False' scores 0.306 on the 7 held-out prompts "
                          "(the composite rubric gives partial credit to any short text)"),
    # stardata's own lipogram loader always forbids e, a or o and never reads the theme (one fixed poem without
    # those letters scored 1.000 on every held-out prompt); lipogram.py draws the letter from 12 and asks for the
    # theme's words, one theme per poem.
    VerifiersEnvSpec("vf-lipogram-v0", f"{Path(__file__).with_name('lipogram.py')}:load_environment", family="verifiers-poetry",
                     description="verifiers: lipogram poems on staros-stardata's themes (one of 12 forbidden letters, the "
                                 "theme's words required, one theme per poem)",
                     heldout_kwargs={"holdout": True}, constants=POEM_CONSTANTS),
)
