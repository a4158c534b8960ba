"""swe-v0 timings side by side: each library's suite run locally vs in a grading sandbox, and an episode's set-up.

    .venv/bin/python scripts/bench_swe.py [--repeats 3]

Per library (pristine source): the suite's CPU and wall time in a plain subprocess (what the
build measures against the 10 s budget), the wall time of the same suite in a fresh pristine
bubblewrap sandbox (what grading costs), and their ratio. Then, for one small-set task: `reset`
(sandbox + repository + git commit) and a whole reference episode including grading.
Needs the sdists in the cache (downloads them otherwise) and root for the sandbox.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envs.swe import grader as G  # noqa: E402
from envs.swe import libraries as L  # noqa: E402
from envs.swe.runner import run_suite_local  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from envs.sandbox.bwrap import BwrapBackend

    backend = BwrapBackend()
    runtime, python = L.ensure_runtime(), L.interpreter()
    print(f"{'library':<22}{'tests':>6}{'local cpu s':>13}{'local wall s':>14}{'sandbox wall s':>16}{'sandbox/local':>15}")
    for name in L.LIBRARIES:
        lib = L.get_library(name)
        files = L.grading_files(lib, L.source_files(lib))
        cpu, wall, box = [], [], []
        n = 0
        for _ in range(a.repeats):
            with tempfile.TemporaryDirectory() as td:
                for rel, data in files.items():
                    (Path(td) / rel).parent.mkdir(parents=True, exist_ok=True)
                    (Path(td) / rel).write_bytes(data)
                r = run_suite_local(lib, Path(td), runtime, python)
            cpu.append(r.cpu_s)
            wall.append(r.duration_s)
            n = len(r.passed())
            t0 = time.monotonic()
            rs = G.run_in_sandbox(backend, lib, files)
            box.append(time.monotonic() - t0)
            assert rs.ok and rs.passed() == r.passed(), f"{name}: sandbox and local outcomes differ"
        med = statistics.median
        print(f"{lib.key:<22}{n:>6}{med(cpu):>13.2f}{med(wall):>14.2f}{med(box):>16.2f}{med(box) / med(wall):>15.2f}")

    import envs
    from envs.play import ScriptedPolicy, run_episode
    from envs.swe.tasks import make_tasks

    task = make_tasks("train", 0, 1)[0]
    resets, episodes = [], []
    for _ in range(a.repeats):
        env = envs.make("swe-v0", backend=backend)
        t0 = time.monotonic()
        asyncio.run(env.reset(task))
        resets.append(time.monotonic() - t0)
        env.close()
        env = envs.make("swe-v0", backend=backend)
        t0 = time.monotonic()
        tr = asyncio.run(run_episode(env, task, ScriptedPolicy(env.reference(task))))
        episodes.append(time.monotonic() - t0)
        env.close()
        assert tr.grade.reward == 1.0, tr.grade
    print(f"\nepisode on {task.id}:")
    print(f"  reset (sandbox + repo + git commit): {statistics.median(resets):.2f} s")
    print(f"  reference episode incl. grading:     {statistics.median(episodes):.2f} s "
          f"({statistics.median(episodes) / statistics.median(resets):.1f}x reset)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
