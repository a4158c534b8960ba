"""Registries: duplicates rejected, unknown names listed, every name the config allows is registered,
and rl/algos stays pure (no ray / deepspeed / vllm / config imports)."""
from __future__ import annotations

import subprocess
import sys
import typing

import pytest

from rl.algos import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, Registry, RegistryError
from rl.config import AlgorithmSection


def test_duplicate_name_is_rejected():
    reg: Registry = Registry("thing")

    @reg.register("a")
    def first():
        return 1

    with pytest.raises(RegistryError, match="thing 'a' is already registered .*first"):
        reg.register("a")(lambda: 2)
    assert reg.get("a") is first
    with pytest.raises(RegistryError, match="already registered"):
        ADVANTAGES.register("grpo")(lambda i, p: None)


def test_unknown_name_lists_registered_names_and_bad_names_refused():
    reg: Registry = Registry("thing")
    reg.register("b")(len)
    reg.register("a")(len)
    with pytest.raises(RegistryError, match="unknown thing 'c'; registered names: a, b"):
        reg.get("c")
    with pytest.raises(RegistryError, match="non-empty string"):
        reg.register(" a")
    assert isinstance(RegistryError("x"), ValueError)


@pytest.mark.parametrize(
    "field,registry",
    [("advantage", ADVANTAGES), ("policy_loss", POLICY_LOSSES), ("aggregation", AGGREGATIONS), ("kl_estimator", KL_ESTIMATORS)],
)
def test_every_config_name_is_registered(field, registry):
    allowed = typing.get_args(typing.get_type_hints(AlgorithmSection)[field])
    assert allowed, field
    missing = [n for n in allowed if n not in registry]
    assert not missing, f"AlgorithmSection.{field} allows {missing} but rl/algos does not register them"
    assert callable(registry.get(getattr(AlgorithmSection(), field)))


def test_algos_imports_no_heavy_or_config_modules():
    code = (
        "import sys, rl.algos\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'deepspeed', 'vllm', 'transformers') or m == 'rl.config']\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "", f"rl.algos pulled in: {out.stdout.strip()}"
