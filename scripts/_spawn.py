"""Measuring a benchmark arm in a fresh spawned process, and reading its result back.

Benchmarks that run each arm in a fresh process (so that arms do not share memory or warm caches) wait
on a queue; a process that dies first (killed for memory, say) would leave that wait hanging forever.
"""
from __future__ import annotations

import queue
from typing import Any


def result_of(q: Any, p: Any, what: str, bench: str) -> Any:
    """The item `p` puts on `q`, or `SystemExit` naming `bench` and `what` if `p` exits without one."""
    while True:
        try:
            return q.get(timeout=5)
        except queue.Empty:
            if not p.is_alive():
                try:  # it may have reported just before exiting
                    return q.get(timeout=1)
                except queue.Empty:
                    pass
                raise SystemExit(f"{bench}: the process of {what} exited with {p.exitcode} before reporting")


def in_fresh_process(target: Any, args: tuple, what: str, bench: str) -> Any:
    """Run `target(*args, q)` in a new spawned process and return what it puts on `q` (`result_of`)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    try:
        return result_of(q, p, what, bench)
    finally:
        p.join()
