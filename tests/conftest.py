"""Suite-wide pytest options.

`--run-learning` runs the tests marked `learning`: end-to-end learning checks of ~10 minutes each
that would push the default run (README's test command) past its time budget. CI runs them as a
second step (.ci/run); without the flag they are skipped with the reason shown.
"""
from __future__ import annotations

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
