"""Benchmark of cad-v0's moving parts, printed side by side in one run.

    .venv/bin/python scripts/bench_cad.py [--repeats 5]

Measures (median wall seconds):
  * the grading work for honest submissions (every family's alternative construction, graded
    against its reference in process) with the hardened path (static BREP scan in the host and
    again in the worker, per-solid checks, one general fuse for the three boolean cells, the
    consistency checks) vs the path before it (parse, fuse, one validity check, BRepAlgoAPI_Common),
    interleaved in one run; the defence's budget is 1.5x;
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


def legacy_grade(data: bytes, ref, rs) -> float:
    """The grading work as it was before the hardening (no scan, no per-solid or consistency checks,
    IoU from BRepAlgoAPI_Common and signed volumes). Kept here only to measure what the defence costs."""
    import io

    import cadquery as cq
    from OCP.BRepAlgoAPI import BRepAlgoAPI_Common

    from envs.cad.kernel import geometry as G

    shape = cq.Shape.importBrep(io.BytesIO(data))
    solids = shape.Solids()
    agent = solids[0] if len(solids) == 1 else solids[0].fuse(*solids[1:]).clean()
    if not agent.isValid() or agent.Volume() <= 0:
        return 0.0
    va, vb = agent.Volume(), ref.Volume()
    vi = cq.Shape.cast(BRepAlgoAPI_Common(agent.wrapped, ref.wrapped).Shape()).Volume()
    iou = vi / (va + vb - vi)
    abox = G.bbox(agent)
    err = max(abs(x - y) for x, y in zip(abox, rs.bbox))
    ok = (G.through_holes(agent) == rs.holes) + (G.face_count(agent) == rs.faces) + (err <= G.bbox_tolerance(rs.bbox))
    return (1.0 if iou >= 1 - G.IOU_SNAP else iou) * ok / 3


def count_features_grade(data: bytes, ref, rs, rf) -> float:
    """The hardened grade with the feature term read from counts over every shell (genus, merged faces), as it
    was before the features came from the outer shell and were matched by position and size (the cavity and
    tiny-body exploits of issue 40). Kept here only to measure what the matching costs."""
    from envs.cad.kernel import brep
    from envs.cad.kernel import geometry as G

    brep.scan(data)
    agent = G.load_submission(data)
    va, vb = G.volume(agent), rs.volume
    vi, da = G.boolean_cells(agent, ref)
    tol = G.VOLUME_CONSISTENCY * max(va, vb)
    if abs(vi + da - va) > tol or vi > min(va, vb) + tol:
        return 0.0
    iou = vi / (vi + da + max(0.0, vb - vi))
    err = max(abs(x - y) for x, y in zip(G.bbox(agent), rs.bbox))
    ok = (G.through_holes(agent) == rs.holes) + (G.face_count(agent) == rs.faces) + (err <= G.bbox_tolerance(rs.bbox))
    return (1.0 if iou >= 1 - G.IOU_SNAP else iou) * ok / 3


def hardened_grade(data: bytes, ref, rs, rf) -> float:
    """What the host (scan) and the worker (scan, load, checks, compare with the reference's cached features)
    do for one submission."""
    from envs.cad.kernel import brep
    from envs.cad.kernel import geometry as G

    brep.scan(data)
    return G.compare(G.load_submission(data), ref, rs, rf).score


def bench_defence(repeats: int) -> tuple[float, float, float, int]:
    """(legacy s, count-features s, hardened s, submissions): summed over honest submissions, median over
    repeats, interleaved."""
    import random

    from envs.cad.families import FAMILIES
    from envs.cad.kernel import geometry as G

    cases = []
    for name, fam in FAMILIES.items():
        for v in random.Random(name).sample(fam.variants(), 2):
            p = fam.params(v)
            ns: dict = {}
            exec(fam.reference(p), ns)  # noqa: S102 - trusted family code
            ref = G.to_shape(ns["result"])
            ns = {}
            exec(fam.alternative(p), ns)  # noqa: S102
            rf = G.features(ref, perimeters=True)
            cases.append((G.export_brep(G.to_shape(ns["result"])), ref, G.summarize(ref, rf), rf))
    old, counts, new = [], [], []
    for _ in range(repeats):
        for fn, out in ((legacy_grade, old), (count_features_grade, counts), (hardened_grade, new)):
            t0 = time.perf_counter()
            for data, ref, rs, rf in cases:
                assert (fn(data, ref, rs) if fn is legacy_grade else fn(data, ref, rs, rf)) == 1.0
            out.append(time.perf_counter() - t0)
    return statistics.median(old), statistics.median(counts), statistics.median(new), len(cases)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--defence-only", action="store_true", help="only the hardened-vs-before grading comparison")
    args = ap.parse_args()

    old_s, count_s, new_s, n_cases = bench_defence(args.repeats)
    print(f"grading work, {n_cases} honest submissions (every family x 2), in process:")
    print(f"  before the hardening:                           {old_s / n_cases * 1e3:8.1f} ms each")
    print(f"  hardened, features from counts:                 {count_s / n_cases * 1e3:8.1f} ms each"
          f"   = {count_s / old_s:5.2f} x the first")
    print(f"  hardened, outer-shell features matched:         {new_s / n_cases * 1e3:8.1f} ms each"
          f"   = {new_s / count_s:5.2f} x the counts (budget 1.5 x)")
    if args.defence_only:
        return

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
