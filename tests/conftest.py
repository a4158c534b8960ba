"""Suite-wide pytest options.

`--run-learning` runs the tests marked `learning`: end-to-end learning checks of ~10 minutes each
that would push the default run (README's test command) past its time budget. CI runs them as a
second step (.ci/run); without the flag they are skipped with the reason shown.

The default run uses two pytest-xdist workers (scripts/test.sh: `-n 2 --dist loadscope`): one test
alone keeps about one of this machine's two cores busy, so a second worker fills the idle one. Each
module's tests stay on one worker (module fixtures, such as a started engine, are built once), and the
modules in `ONE_AT_A_TIME` form a single unit: they each hold many GiB (a Ray cluster with trainer
ranks and an engine, a jobs service, a trainer benchmark), so two of them never run at once. Add a
module there when it starts such a run (tests/test_suite_units.py fails for a module that starts a
Ray cluster outside it). `-n 0` runs everything in one process.

Ray left initialized past the module whose test started it leaks into later tests (they join that
instance, with its settings): `pytest_runtest_teardown` notes the first test after which Ray is still up,
`pytest_runtest_setup` reports it once a test of another module finds it up, and the run's summary names
each leak (the test that left it, the test that found it).
"""
from __future__ import annotations

import sys

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-learning", action="store_true", default=False,
                     help="also run the tests marked `learning` (~10 min each on 2 cores; CI runs them)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-learning"):
        return
    skip = pytest.mark.skip(reason="a learning check: runs with --run-learning (CI: .ci/run)")
    for item in items:
        if "learning" in item.keywords:
            item.add_marker(skip)


ONE_AT_A_TIME = frozenset({
    "tests/scripts/test_ray_submit.py", "tests/scripts/test_check_learning.py",
    "tests/scripts/test_bench_knobs.py", "tests/scripts/test_bench_long.py",
    "tests/scripts/test_bench_microbatch.py", "tests/scripts/test_bench_packing.py",
    "tests/rl/test_train_e2e.py", "tests/rl/test_multinode.py", "tests/rl/test_train_ranks.py",
    "tests/rl/test_train_ranks_cli.py", "tests/rl/test_admission.py", "tests/rl/test_families.py",
    "tests/rl/test_gpu.py", "tests/rl/jobs/test_jobs_e2e.py",
    "tests/rl/rollout/test_worker_dispatcher.py", "tests/rl/rollout/test_dispatcher_oom.py",
    "tests/rl/trainer/test_group.py", "tests/rl/trainer/test_group_lost_rank.py",
    "tests/rl/trainer/test_group_padding.py", "tests/rl/trainer/test_sequence_parallel.py",
    "tests/rl/trainer/test_lora.py", "tests/rl/weights/test_weights_formats.py",
    "tests/rl/weights/test_weights_shm.py", "tests/rl/tinker/test_service_sdk.py",
})


ONE_AT_A_TIME_UNIT = "one-at-a-time"


def _work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its module, or the one shared unit of the `ONE_AT_A_TIME` modules."""
    module = nodeid.split("::")[0]
    return ONE_AT_A_TIME_UNIT if module in ONE_AT_A_TIME else module


def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201 - xdist's Producer / Scheduling
    """xdist's module-scoped scheduling with the heavy modules as one unit, handed out first (it is the
    longest; started last it would leave one worker alone at the end)."""
    from xdist.scheduler import LoadScopeScheduling

    class Grouped(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:  # noqa: ANN001 - xdist's WorkerController
            if ONE_AT_A_TIME_UNIT in self.workqueue:
                self.workqueue.move_to_end(ONE_AT_A_TIME_UNIT, last=False)
            super()._assign_work_unit(node)

    return Grouped(config, log)


_ray_seen: dict[str, str] = {}  # "started": nodeid of the first test that found Ray initialized after its own run
_ray_leaks: list[str] = []


def _ray_up() -> bool:
    ray = sys.modules.get("ray")  # never import Ray here: most tests do not need it
    return bool(ray is not None and ray.is_initialized())


def pytest_runtest_setup(item: pytest.Item) -> None:
    started = _ray_seen.get("started")
    if started is None or not _ray_up():
        return
    if started.split("::")[0] != item.nodeid.split("::")[0] and "reported" not in _ray_seen:
        _ray_leaks.append(f"Ray initialized by {started} was still up at {item.nodeid}")
        _ray_seen["reported"] = item.nodeid  # one line per leak, not one per later module


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _ray_up():
        _ray_seen.setdefault("started", item.nodeid)
    else:
        _ray_seen.clear()


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 - pytest's TerminalReporter
    if _ray_leaks:
        terminalreporter.section("Ray left running across test modules")
        for line in _ray_leaks:
            terminalreporter.write_line(line)
