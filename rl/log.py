"""One logger set-up for every entry point, quiet consoles with full logs kept, and progress helpers.

`setup_logging(level, run_dir=None)` configures the `jointrl` logger hierarchy once (idempotent) with a compact
format on stderr. Given a run directory it also keeps everything at full detail in RUN_DIR/logs/:
`driver.log` (this process, every logger, DEBUG), `engines.log` (the vLLM engines of the run's rollout workers,
configured through vLLM's own VLLM_LOGGING_CONFIG_PATH, which each worker process reads at start) and `ray`
(a link to the latest Ray session's logs, `ray-<session>` one per start: every worker's stdout and stderr, the
trainer's DeepSpeed output included).

The console gets what a person acts on: `QuietStreamHandler` folds library chatter that repeats per weight into
one line per burst, with a count (`CHATTER`): vLLM's "Attempted to load weight ... with dtype" notices (one per
converted tensor at every engine start) become one INFO line, its "Following weights were not loaded" notices
(one per partial weight update) one DEBUG line. The originals, in full, are in the log files.

The same line repeated back to back (vLLM's CPU worker warns once per thread) is written once, then
"(the line above N more time(s))".

`progress(iterable, desc, total)` wraps tqdm (silenced with JOINTRL_PROGRESS=0, so CI logs stay readable);
`StartupStages` logs a run's start-up as numbered stages with the time each took and, from the previous start
of the same model on this machine, an estimate of the time left.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Iterable, TypeVar

T = TypeVar("T")
_CONFIGURED = False
_FILE_HANDLER: logging.Handler | None = None
LOG_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"

# (pattern of the message format, the one-line summary of a burst with {n} and {first}, its level)
CHATTER: tuple[tuple[re.Pattern[str], str, int], ...] = (
    (re.compile(r"^Attempted to load weight"),
     "vLLM loaded {n} weight(s) into parameters of another dtype (first: {first}); the list is in RUN_DIR/logs/engines.log",
     logging.INFO),
    (re.compile(r"^Following weights were not loaded"),
     "vLLM: {n} partial weight update(s) left the other weights as they were (expected: a sync sends what changed)",
     logging.DEBUG),
)


class QuietStreamHandler(logging.StreamHandler):
    """A stream handler that folds each burst of `CHATTER` records into one summary line with a count.

    A burst ends at the next record that is not the same chatter, or when the process exits; the summary is
    written at that point, at its own level (so a DEBUG summary shows only when this handler's level is DEBUG).
    Everything else passes unchanged."""

    def __init__(self, stream=None) -> None:
        super().__init__(stream)
        self._follow_stderr = stream is None  # None: whatever sys.stderr is at each write (test capture, redirection)
        self._pending: dict[int, list] = {}  # chatter index -> [count, first record]
        self._last_key: tuple | None = None  # the last line written, and how often it came again since
        self._last_args: object = None
        self._repeats = 0
        atexit.register(self.flush_chatter)
        atexit.register(self._flush_repeats)

    def flush(self) -> None:
        if self._follow_stderr:
            self.stream = sys.stderr
        super().flush()

    @staticmethod
    def chatter_of(record: logging.LogRecord) -> int | None:
        msg = record.msg if isinstance(record.msg, str) else ""
        for i, (rx, _, _) in enumerate(CHATTER):
            if rx.match(msg):
                return i
        return None

    def flush_chatter(self) -> None:
        pending, self._pending = self._pending, {}
        for i, (n, first) in sorted(pending.items()):
            _, text, level = CHATTER[i]
            args = first.args if isinstance(first.args, tuple) else ()
            example = " ".join(str(a) for a in args)[:160]  # the first notice's values (weight name, dtypes)
            rec = logging.LogRecord(first.name, level, first.pathname, first.lineno, text.format(n=n, first=example), None, None)
            if level >= self.level:
                super().emit(rec)

    def emit(self, record: logging.LogRecord) -> None:
        if self._follow_stderr:
            self.stream = sys.stderr
        i = self.chatter_of(record)
        if i is None:
            if self._pending:
                self.flush_chatter()
            key = (record.name, record.levelno, record.msg if isinstance(record.msg, str) else None)
            if key[2] is not None and key == self._last_key and record.args == self._last_args:
                self._repeats += 1  # the same line again (one per thread, per worker start...): counted, not shown
                return
            self._flush_repeats()
            self._last_key, self._last_args = key, record.args
            super().emit(record)
            return
        self._flush_repeats()
        if self._pending and i not in self._pending:
            self.flush_chatter()
        entry = self._pending.setdefault(i, [0, record])
        entry[0] += 1

    def _flush_repeats(self) -> None:
        if self._repeats:
            n, self._repeats = self._repeats, 0
            name, level, _ = self._last_key
            super().emit(logging.LogRecord(name, level, "", 0, f"(the line above {n} more time(s))", None, None))
        self._last_key, self._last_args = None, None

    def close(self) -> None:
        self.flush_chatter()
        self._flush_repeats()
        super().close()


def engine_logging_config(log_dir: Path, level: str) -> dict:
    """vLLM's logging config for a run's engines: the console through QuietStreamHandler at `level`, every record
    at full detail appended to `log_dir`/engines.log."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"compact": {"format": LOG_FORMAT, "datefmt": DATE_FORMAT}},
        "handlers": {
            "console": {"()": "rl.log.QuietStreamHandler", "level": level, "formatter": "compact", "stream": "ext://sys.stderr"},
            "file": {"class": "logging.FileHandler", "level": "DEBUG", "formatter": "compact",
                     "filename": str(log_dir / "engines.log"), "mode": "a", "encoding": "utf-8"},
        },
        "loggers": {"vllm": {"handlers": ["console", "file"], "level": level, "propagate": False}},
    }


def setup_logging(level: str = "INFO", run_dir: str | os.PathLike[str] | None = None) -> logging.Logger:
    """The `jointrl` loggers on stderr at `level`; with `run_dir`, also RUN_DIR/logs/ at full detail (see the
    module docstring) and the engines' logging config (unless VLLM_LOGGING_CONFIG_PATH is already set)."""
    global _CONFIGURED, _FILE_HANDLER
    logger = logging.getLogger("jointrl")
    if not _CONFIGURED:
        handler = QuietStreamHandler()  # follows sys.stderr
        handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
        logger.addHandler(handler)
        logger.propagate = False
        _CONFIGURED = True
    for h in logger.handlers:
        if isinstance(h, QuietStreamHandler):
            h.setLevel(level)
    logger.setLevel(logging.DEBUG if run_dir is not None else level)
    if run_dir is not None:
        log_dir = Path(run_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        root = logging.getLogger()
        if _FILE_HANDLER is not None:
            logger.removeHandler(_FILE_HANDLER)
            root.removeHandler(_FILE_HANDLER)
            _FILE_HANDLER.close()
        _FILE_HANDLER = logging.FileHandler(log_dir / "driver.log", mode="a", encoding="utf-8")
        _FILE_HANDLER.setLevel(logging.DEBUG)
        _FILE_HANDLER.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
        logger.addHandler(_FILE_HANDLER)
        root.addHandler(_FILE_HANDLER)  # libraries in this process (Ray's client, datasets, ...) at their own levels
        if root.level > logging.INFO:
            root.setLevel(logging.INFO)
        cfg_path = log_dir / "engine_logging.json"
        cfg_path.write_text(json.dumps(engine_logging_config(log_dir, level), indent=1))
        current = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
        if not current or current == os.environ.get("JOINTRL_ENGINE_LOGGING"):  # unset, or set by an earlier run here
            os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(cfg_path)  # the rollout workers get VLLM_* variables
            os.environ["JOINTRL_ENGINE_LOGGING"] = str(cfg_path)  # ours to replace on the next run in this process
    return logger


def link_ray_logs(run_dir: str | os.PathLike[str]) -> Path | None:
    """RUN_DIR/logs/ray-<session> -> this Ray session's log directory (worker stdout / stderr), when Ray runs here,
    and RUN_DIR/logs/ray -> the latest such link (each start of a resumed run keeps its own). Never raises: a
    link that cannot be made costs the link, not the run."""
    try:
        import ray

        node = ray._private.worker._global_node  # noqa: SLF001 - the session's paths live here
        session_logs = Path(node.get_session_dir_path()) / "logs" if node is not None else None
        if session_logs is None or not session_logs.is_dir():
            return None
        logs = Path(run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        own = logs / f"ray-{session_logs.parent.name}"
        if not own.is_symlink() and not own.exists():
            own.symlink_to(session_logs, target_is_directory=True)
        latest = logs / "ray"
        if latest.is_symlink():
            latest.unlink()
        if not latest.exists():  # a copied run directory may hold a real directory here: left as it is
            latest.symlink_to(own.name, target_is_directory=True)
        return own
    except Exception:  # noqa: BLE001
        return None


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"jointrl.{name}")


def progress(iterable: Iterable[T] | None = None, *, desc: str = "", total: int | None = None, **kw):
    from tqdm.auto import tqdm

    disable = os.environ.get("JOINTRL_PROGRESS", "1") == "0"
    return tqdm(iterable, desc=desc, total=total, disable=disable, dynamic_ncols=True, **kw)


class StartupStages:
    """Numbered start-up stages on the log: `next(name)` ends the previous stage and starts `name`; each line says
    the stage, the time so far and, when this machine started the same `key` before, about how long is left
    (the earlier start's stage times, kept in `<cache>/startup_times.json`)."""

    def __init__(self, names: Iterable[str], key: str, logger: logging.Logger | None = None) -> None:
        from jointrl.paths import cache_root

        self.names = list(names)
        self.key = key
        self.log = logger or get_logger("startup")
        self.times: dict[str, float] = {}
        self._file = cache_root() / "startup_times.json"
        try:
            self.before: dict[str, float] = json.loads(self._file.read_text()).get(key, {})
        except (OSError, ValueError):
            self.before = {}
        self._current: str | None = None
        self._t0 = self._t_stage = time.perf_counter()

    def _end_current(self) -> None:
        if self._current is not None:
            self.times[self._current] = time.perf_counter() - self._t_stage

    def next(self, name: str) -> None:
        self._end_current()
        self._current, self._t_stage = name, time.perf_counter()
        i = self.names.index(name) if name in self.names else len(self.times)
        left = sum(self.before.get(n, 0.0) for n in self.names[i:]) if self.before else None
        eta = f", ~{left:.0f} s left (last start here)" if left else ""
        self.log.info("start-up [%d/%d] %s (%.0f s so far%s)", i + 1, len(self.names), name, time.perf_counter() - self._t0, eta)

    def done(self) -> float:
        self._end_current()
        self._current = None
        total = time.perf_counter() - self._t0
        self.log.info("start-up done in %.0f s", total)
        try:
            data = json.loads(self._file.read_text()) if self._file.is_file() else {}
            data[self.key] = {k: round(v, 1) for k, v in self.times.items()}
            self._file.parent.mkdir(parents=True, exist_ok=True)
            self._file.write_text(json.dumps(data, indent=1))
        except (OSError, ValueError):
            pass
        return total
