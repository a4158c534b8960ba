"""Suite-wide pytest options.

`--run-learning` runs the tests marked `learning`: end-to-end learning checks of ~10 minutes each
that would push the default run (README's test command) past its time budget. CI runs them as a
second step (.ci/run); without the flag they are skipped with the reason shown.

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
