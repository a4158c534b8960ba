"""`jointrl envs check` on a stratified sample of 20 reasoning-gym domains (round-robin over the families,
generators slower than ~20 ms per item left out for time). Starts the judge process (slow, ~60 s)."""
from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym")

from envs.check import check_env  # noqa: E402
from tests.envs.reasoning_gym.helpers import SLOW_GENERATORS, stratified_sample  # noqa: E402

pytestmark = pytest.mark.slow
SAMPLE = stratified_sample(20, skip=SLOW_GENERATORS)


def test_the_sample_covers_every_family():
    from envs.reasoning_gym.catalog import families

    assert len(SAMPLE) == 20
    assert {d.family for d in SAMPLE} == set(families())


@pytest.mark.parametrize("info", SAMPLE, ids=[d.name for d in SAMPLE])
def test_envs_check_passes(info):
    # The best-constant check is left to test_redteam.py (35 candidates x the held-out tasks per domain).
    report = check_env(info.env_id, n_tasks=2, n_generate=12, n_constant=0)
    assert report.passed, report.render()
