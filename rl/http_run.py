"""Run a uvicorn app until SIGINT/SIGTERM and then return, so the caller's clean-up runs.

uvicorn (>= 0.29) catches SIGINT/SIGTERM, shuts the HTTP server down, restores the handlers it found and
raises the signal again. With Python's default SIGTERM disposition that second delivery kills the process on
the spot: a `finally:` after `uvicorn.run` never runs, so drains, engine shutdowns and child stops are
skipped and the children are left to their parent-death signals. `run_until_stopped` installs handlers
that only record the signal before starting uvicorn, so the re-raise returns here.

After the server has stopped, a further SIGTERM is still only recorded (an orchestrator repeating TERM must not
cut a drain short; it escalates to SIGKILL on its own schedule), while a further SIGINT raises
KeyboardInterrupt again, so a second Ctrl-C at a terminal forces the exit.

This module does not build apps or pick ports; it only owns the signal handling around uvicorn.run.
"""
from __future__ import annotations

import signal
from typing import Any

_received: list[int] = []


def _note(signum: int, _frame: Any) -> None:
    _received.append(signum)


def run_until_stopped(app: Any, host: str, port: int, **uvicorn_kw: Any) -> int | None:
    """Serve `app` until SIGINT/SIGTERM; return the signal that stopped it (None if uvicorn returned by itself).
    Call from the main thread (Python handles signals there only)."""
    import uvicorn

    _received.clear()
    signal.signal(signal.SIGTERM, _note)
    signal.signal(signal.SIGINT, _note)
    try:
        uvicorn.run(app, host=host, port=port, **uvicorn_kw)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C during clean-up forces the exit
    return _received[0] if _received else None
