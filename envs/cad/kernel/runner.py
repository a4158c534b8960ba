"""Runs the agent's CadQuery code inside its sandbox and reports on the agent's own solid.

Invoked by the cad-v0 domain as `python -I runner.py OUT_PATH` (`-`: measure only, write nothing)
with the code on stdin, inside the bubblewrap sandbox (the venv and this directory are read-only
mounts). It:
  1. imports cadquery, compiles and executes the code with `cq` predefined and the code's own
     stdout/stderr captured (capped);
  2. takes the variable `result` (a Workplane, Shape or list of them), checks each solid and fuses
     them (geometry.to_shape: the grader's own checks, so an inside-out or open solid is reported
     here rather than silently scoring 0), and measures it with geometry.summarize (volume,
     bounding box, faces, through-holes, validity);
  3. exports the solid as BREP text and runs the grader's static scan on it (brep.scan: too many
     solids or faces is reported here too), writes it to OUT_PATH (the host reads it back with
     `read_artifact`, as data, and the trusted grader checks and loads it in its own process) and
     prints one report line: REPORT_MARKER + JSON.
It never sees the target: nothing here compares with a reference. Time and memory limits are the
sandbox's (a hung kernel is killed by the wall clock, a memory bomb by RLIMIT_AS / the cgroup).
The agent's code runs in this process and can replace any of it, print a forged report or write
any file: whatever this script prints or writes is untrusted by the host beyond being shown back
to the agent; the grader re-checks the file from scratch.
"""
from __future__ import annotations

import contextlib
import io
import json
import linecache
import os
import sys
import traceback

REPORT_MARKER = "\x1eJOINTRL_CAD_REPORT "
MAX_CAPTURED_CHARS = 4000
CODE_FILENAME = "<your code>"


class _CappedIO(io.StringIO):
    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap
        self.dropped = 0

    def write(self, s: str) -> int:
        room = self.cap - self.tell()
        if room > 0:
            super().write(s[:room])
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)


def _user_traceback(exc: BaseException) -> str:
    """The traceback restricted to frames of the agent's code (plus the exception line)."""
    tb = exc.__traceback__
    frames = [f for f in traceback.extract_tb(tb) if f.filename == CODE_FILENAME]
    lines = ["Traceback (your code):\n"] + traceback.format_list(frames) if frames else []
    lines += traceback.format_exception_only(type(exc), exc)
    return "".join(lines)


def _may_name_result(code) -> bool:
    """Whether the compiled module, or any function or class body in it, names `result` or holds a string
    containing it (what `globals()["result"] = ...` or an exec would need)."""
    stack = [code]
    while stack:
        c = stack.pop()
        if "result" in c.co_names or "result" in c.co_varnames:
            return True
        for k in c.co_consts:
            if isinstance(k, str) and "result" in k:
                return True
            if hasattr(k, "co_names"):
                stack.append(k)
    return False


def run(code: str, out_path: str) -> dict:
    report: dict = {"ok": False, "error": None, "stdout": "", "summary": None}
    # Cheap failures first: the cadquery import costs seconds.
    if not code.strip():
        report["error"] = "the code is empty: write CadQuery code that assigns the part to `result`"
        return report
    try:
        compiled = compile(code, CODE_FILENAME, "exec")
    except (SyntaxError, ValueError) as e:  # ValueError: NUL bytes in the source
        report["error"] = "".join(traceback.format_exception_only(type(e), e))
        return report
    if not _may_name_result(compiled):
        # No statement of the code names `result` and no string in it holds the word: it cannot assign the part
        # (constant answers such as "0" or "yes" end here, without the seconds of the cadquery import).
        report["error"] = "your code never assigns `result`: assign the finished part to it (`result = ...`)"
        return report
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import brep  # noqa: E402 - next to this file, importable once `here` is on the path
    import cadquery as cq
    import geometry  # noqa: E402

    # Register the source so tracebacks show the offending lines.
    linecache.cache[CODE_FILENAME] = (len(code), None, code.splitlines(True), CODE_FILENAME)
    ns = {"__name__": "__main__", "cq": cq, "cadquery": cq}
    out = _CappedIO(MAX_CAPTURED_CHARS)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(compiled, ns)  # noqa: S102 - the agent's code, inside its sandbox
    except BaseException as e:  # noqa: BLE001 - SystemExit / MemoryError included: all are the code's failures
        ns.clear()  # after a MemoryError, free what the code allocated before formatting anything
        report["stdout"] = out.getvalue()
        report["error"] = _user_traceback(e)
        return report
    report["stdout"] = out.getvalue() + (f"\n[{out.dropped} characters of output dropped]" if out.dropped else "")
    if "result" not in ns:
        report["error"] = "your code did not define `result`: assign the finished part to a variable named `result`"
        return report
    try:
        shape = geometry.to_shape(ns["result"])
        summary = geometry.summarize(shape)
    except geometry.NoSolidError as e:
        report["error"] = str(e)
        return report
    except Exception as e:  # noqa: BLE001 - the kernel failed on the agent's shape
        report["error"] = f"could not measure `result`: {type(e).__name__}: {e}"
        return report
    report["summary"] = summary.to_dict()
    if not summary.valid:
        report["error"] = "`result` is not a valid solid (the B-rep check failed); it would score 0"
        return report
    if summary.volume <= 0:
        report["error"] = f"`result` has volume {summary.volume:.6g} (not positive): it is not a closed, outward-facing solid"
        return report
    data = geometry.export_brep(shape)
    try:
        brep.scan(data)
    except brep.BrepRejected as e:
        report["error"] = f"the grader would refuse this solid: {e}"
        return report
    report["ok"] = True
    if out_path == "-":  # run_cad: measure only, nothing to hand to the grader
        return report
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    tmp = out_path + ".part"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out_path)
    return report


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: runner.py OUT_PATH  (code on stdin)", file=sys.stderr)
        return 2
    code = sys.stdin.read()
    report = run(code, argv[1])
    sys.stdout.write("\n" + REPORT_MARKER + json.dumps(report) + "\n")
    sys.stdout.flush()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    # os._exit: threads the agent's code (or the kernel) left running must not hold the process
    # open until the wall-clock kill once the report is out.
    rc = main(sys.argv)
    sys.stderr.flush()
    os._exit(rc)
