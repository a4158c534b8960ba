"""scripts/_spawn.py: a benchmark waiting on an arm's process gets its result, or a clear stop naming the arm
when that process dies without reporting (instead of waiting forever)."""
from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from scripts._spawn import result_of


def _reports(q) -> None:
    q.put({"step_s": 1.5})


def _dies(q) -> None:
    os._exit(7)  # what the kernel's OOM kill looks like to the parent: no report, a non-zero exit


def test_result_of_returns_what_the_process_reported():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_reports, args=(q,))
    p.start()
    assert result_of(q, p, "row 'a'", "bench_x") == {"step_s": 1.5}
    p.join()


def test_result_of_stops_naming_the_arm_when_its_process_dies():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_dies, args=(q,))
    p.start()
    with pytest.raises(SystemExit, match=r"bench_x: the process of row 'b' exited with 7 before reporting"):
        result_of(q, p, "row 'b'", "bench_x")


def test_in_fresh_process_runs_the_target_and_returns_its_report():
    from scripts._spawn import in_fresh_process

    assert in_fresh_process(_reports, (), "row 'c'", "bench_x") == {"step_s": 1.5}
    with pytest.raises(SystemExit, match=r"bench_x: the process of row 'd' exited with 7 before reporting"):
        in_fresh_process(_dies, (), "row 'd'", "bench_x")
