"""Benchmark of cad-v0's moving parts, printed side by side in one run.

    .venv/bin/python scripts/bench_cad.py [--repeats 5]

Measures (median wall seconds):
  * grading one submission in a warm worker vs in a fresh process that must import cadquery
    first (what the warm pool saves);
  * the exact-IoU comparison alone (in process);
  * one `run_cad` call in the bubblewrap sandbox (python start + cadquery import + build + measure);
  * rendering one task picture (mesh + four views + PNG) in a warm worker;
  * generating tasks (pictures included) per second.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def median_time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from envs.cad.families import FAMILIES
    from envs.cad.kernel import geometry as G
    from envs.cad.worker import CadWorkerPool

    fam = FAMILIES["flange"]
    p = fam.params(fam.variants()[0])
    ref_code, alt_code = fam.reference(p), fam.alternative(p)

    t0 = time.perf_counter()
    pool = CadWorkerPool(size=1)
    pool.render(ref_code)  # starts the worker and caches the reference
    worker_start = time.perf_counter() - t0

    ns: dict = {}
    exec(alt_code, ns)  # noqa: S102 - trusted family code
    agent = G.to_shape(ns["result"])
    brep = G.export_brep(agent)
    ns = {}
    exec(ref_code, ns)  # noqa: S102
    ref = G.to_shape(ns["result"])

    warm = median_time(lambda: pool.grade(ref_code, brep), args.repeats)
    iou_only = median_time(lambda: G.iou(agent, ref), args.repeats)
    cold_script = ("import sys, io; from envs.cad.kernel import geometry as G\n"
                   f"ns = {{}}; exec({ref_code!r}, ns); ref = G.to_shape(ns['result'])\n"
                   "agent = G.load_brep(sys.stdin.buffer.read()); print(G.compare(agent, ref).score)\n")
    repo = str(Path(__file__).resolve().parents[1])
    cold = median_time(lambda: subprocess.run([sys.executable, "-c", cold_script], input=brep, check=True,
                                              capture_output=True, cwd=repo), max(1, args.repeats // 2))
    render_t = median_time(lambda: pool.render(ref_code + f"\n# {time.perf_counter()}\n"), args.repeats)

    sandbox_t = float("nan")
    try:
        from envs.cad.domain import CadDomain
        from envs.cad.tasks import make_tasks

        task = make_tasks("train", 0, 3, pool=pool)[2]
        dom = CadDomain(pool=pool)
        dom.setup(task)
        try:
            sandbox_t = median_time(lambda: dom._run(alt_code, 120.0, export=True), max(1, args.repeats // 2))
        finally:
            dom.teardown()
    except Exception as e:  # noqa: BLE001 - no sandbox on this host: report the rest
        print(f"(sandbox run skipped: {type(e).__name__}: {e})")

    from envs.cad import tasks as T

    T._PICTURES.clear()
    t0 = time.perf_counter()
    n = 18
    T.make_tasks("heldout", 7, n, pool=pool)
    gen_rate = n / (time.perf_counter() - t0)
    pool.close()

    print(f"worker start (import cadquery + first reference): {worker_start:8.3f} s")
    print(f"grade, warm worker:                               {warm:8.3f} s")
    print(f"grade, fresh process (import + build + compare):  {cold:8.3f} s   = {cold / warm:6.1f} x the warm worker")
    print(f"exact IoU alone (in process):                     {iou_only:8.3f} s   = {iou_only / warm:6.2f} of a warm grade")
    print(f"run_cad in the sandbox (import + build + measure): {sandbox_t:7.3f} s   = {sandbox_t / warm:6.1f} x a warm grade")
    print(f"render one task picture (warm worker):            {render_t:8.3f} s")
    print(f"task generation, 1 worker, pictures included:     {gen_rate:8.2f} tasks/s")


if __name__ == "__main__":
    main()
