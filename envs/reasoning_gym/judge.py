"""The parent side of the reasoning-gym judge: one worker process per env process, called at grading time.

`score(item, answer) -> Verdict` sends one request to the worker (`judge_worker.py`), which forks a
scorer child per answer and kills it after `timeout_s`. The worker is started on first use, serves
requests one at a time (a lock), and is itself killed and replaced only when it dies or stops
answering (a backstop deadline); replies must carry the request's nonce.

Outcomes, and why:
- a score                           -> `Verdict(score)`, clamped to [0, 1] (NaN is 0)
- an answer over `MAX_ANSWER_CHARS` -> 0 without calling the scorer (`answer_too_long`): a flood is the
  agent's failure, and no scorer should see megabytes
- the scorer overruns or dies       -> 0 (`judge_timeout` / `judge_crash`): the answer made the scorer
  hang or blow its memory limit (a child that sends no authenticated result counts as dead)
- the scorer raises on the answer   -> 0 (`scorer_error`): reasoning-gym's scorers return 0 for answers
  they cannot parse; one that raises is treated alike, and counted
- the dataset cannot be built or the entry is not JSON -> `JudgeError`: a grading bug (e.g. a task
  set cached under another reasoning-gym version), which `ToolEnv.grade` reports as a grade error
It never runs `score_answer` in this process.
"""
from __future__ import annotations

import json
import logging
import math
import os
import resource
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 32_768  # the longest reference answer in 0.1.25 is ~4,100 chars (tower_of_hanoi)
WORKER = Path(__file__).with_name("judge_worker.py")
ADDRESS_SPACE_BYTES = 4 << 30  # the worker's RLIMIT_AS: a memory bomb in a scorer ends the worker only


class JudgeError(RuntimeError):
    """The judge could not grade for a reason that is not the agent's (a grading bug)."""


@dataclass(frozen=True)
class ItemRef:
    """The item to score against: the dataset as built for the task set, and the task's entry."""

    dataset: str
    seed: int
    size: int
    entry_json: str  # {"question", "answer", "metadata"} as the task generator stored them


@dataclass(frozen=True)
class Verdict:
    score: float
    outcome: str = "scored"  # scored | answer_too_long | judge_timeout | judge_crash | scorer_error
    detail: str = ""


def _limit_worker() -> None:  # runs in the child between fork and exec
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class Judge:
    """A reasoning-gym scorer in a child process (see the module docstring)."""

    def __init__(self, timeout_s: float = 10.0, start_timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.restarts = 0

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-I", str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, bufsize=0, start_new_session=True, preexec_fn=_limit_worker, cwd=str(WORKER.parent))
        return proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            self._kill()

    def score(self, item: ItemRef, answer: str) -> Verdict:
        if len(answer) > MAX_ANSWER_CHARS:
            return Verdict(0.0, "answer_too_long", f"{len(answer)} characters > {MAX_ANSWER_CHARS}")
        with self._lock:
            first = self._proc is None
            if first:
                self._proc = self._start()
            proc = self._proc
            nonce = secrets.token_hex(16)
            req = {"nonce": nonce, "dataset": item.dataset, "seed": item.seed, "size": item.size,
                   "entry": item.entry_json, "answer": answer, "timeout_s": self.timeout_s}
            # The first request also waits for the worker to import reasoning-gym.
            # The worker enforces timeout_s on the scorer; this deadline covers building the dataset and,
            # on the first request, the worker's import of reasoning-gym.
            deadline = time.monotonic() + 2 * self.timeout_s + 5.0 + (self.start_timeout_s if first else 0.0)
            try:
                proc.stdin.write((json.dumps(req) + "\n").encode("ascii"))
            except OSError as e:
                self._kill()
                self.restarts += 1
                return Verdict(0.0, "judge_crash", f"writing to the worker failed: {e}")
            reply = self._read_reply(proc, nonce, deadline)
            if reply is None:
                crashed = proc.poll() is not None
                self._kill()
                self.restarts += 1
                if crashed:
                    return Verdict(0.0, "judge_crash", "the worker died while scoring")
                return Verdict(0.0, "judge_timeout", f"no verdict within {self.timeout_s} s")
        if "score" in reply:
            s = float(reply["score"])
            return Verdict(0.0 if math.isnan(s) else min(1.0, max(0.0, s)))
        kind, detail = reply.get("kind"), str(reply.get("error", ""))[:300]
        if kind == "generator":
            raise JudgeError(f"{item.dataset} (seed {item.seed}): {detail}")
        outcome = {"timeout": "judge_timeout", "crash": "judge_crash"}.get(kind, "scorer_error")
        return Verdict(0.0, outcome, detail)

    @staticmethod
    def _read_reply(proc: subprocess.Popen, nonce: str, deadline: float) -> dict | None:
        """The next line carrying `nonce`; lines without it (forged or stray) are skipped. Reads the
        pipe unbuffered, so a line already received is never left waiting behind `select`."""
        import selectors

        fd = proc.stdout.fileno()
        buf = b""
        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        try:
            while True:
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(msg, dict) and msg.get("nonce") == nonce:
                        return msg
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(timeout=left):
                    return None
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return None
                buf += chunk
                if len(buf) > 1 << 20:  # a worker flooding its reply channel is broken
                    return None
        finally:
            sel.close()


_SHARED: Judge | None = None
_SHARED_LOCK = threading.Lock()


def shared_judge() -> Judge:
    """The process-wide judge (one worker per env process)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = Judge()
        return _SHARED
