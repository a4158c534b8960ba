"""Running a test's body in a fresh spawned process (torch.distributed and its process group are process-global,
so a test that builds trainers runs them away from the pytest process) and reading its result back."""
from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable


def _report(fn: Callable[..., Any], args: tuple, q: Any) -> None:
    try:
        q.put(fn(*args))
    except BaseException as e:  # pragma: no cover - reported by the parent
        import traceback

        q.put({"error": traceback.format_exc() + repr(e)})


def run_spawned(fn: Callable[..., dict], *args: Any, timeout: float = 900) -> dict:
    """`fn(*args)` in a new spawned process (`fn` a module-level function, so the child can import it): its
    result, or `{"error": <traceback>}` if it raised."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_report, args=(fn, args, q))
    p.start()
    res = q.get(timeout=timeout)
    p.join(60)
    return res
