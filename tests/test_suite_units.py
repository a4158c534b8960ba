"""The parallel run's grouping (tests/conftest.py) keeps every test module that starts a Ray cluster in
the one-at-a-time unit: two such modules at once could exceed this machine's memory, and a cluster
started with `ray start` is found by any later plain `ray.init()` on the machine."""
from __future__ import annotations

import re
from pathlib import Path

from tests import REPO
from tests.conftest import ONE_AT_A_TIME, ONE_AT_A_TIME_UNIT, _work_unit

# What starts a cluster: Ray's own entry points, not the word "ray" in a string.
STARTS_RAY = re.compile(r"\bray\.init\(\s*address=|\bcluster_utils\b|\bTrainerGroup\.start\(|\bRAY,\s*\"start\"|"
                        r"\bstart_run\(|\"jointrl\"\)\), \"train\"")


def test_every_module_that_starts_ray_runs_one_at_a_time():
    starting = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                if STARTS_RAY.search(p.read_text(encoding="utf-8"))}
    assert starting, "the pattern found no module at all: it no longer matches how tests start Ray"
    assert starting <= ONE_AT_A_TIME, sorted(starting - ONE_AT_A_TIME)


def test_listed_modules_exist_and_units_split_as_documented():
    missing = [m for m in ONE_AT_A_TIME if not (REPO / m).is_file()]
    assert not missing, missing
    assert _work_unit("tests/rl/test_train_e2e.py::test_x[a-b]") == ONE_AT_A_TIME_UNIT
    assert _work_unit("tests/envs/test_tools_fuzz.py::test_y") == "tests/envs/test_tools_fuzz.py"
