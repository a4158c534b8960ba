"""Attacks on the cad-v0 grader through the public `Env` API (envs.make, reset / step / grade), each
submitted with the agent's own `submit` tool exactly as a policy would.

What the grader trusts (docs/cad.md, "What the grader trusts"): the task's private record (the
family's reference code) and nothing the sandbox produced. The runner's report only decides what
the agent is shown and whether a file is looked for; the BREP file is agent-made data, scanned
before OpenCascade parses it and checked as a solid before it is measured. Each attack below tries
to score without building the part, or to make the grader work for other episodes' time, and must
get 0, including a file that overruns its own time cap (its `cost`, charged to it, never to others):
- generic patches: the reported exploit (a slab at a fraction of the part's thickness, no holes, plus
  inside-out tori placed for the hole count) submitted plainly, from a forged file, and through a
  runner whose checks the agent's code has replaced;
- forged outputs: an "ok" report printed in the runner's format with a file the agent wrote itself;
- degenerate artifacts: empty, garbage and header-only files, a lone face, a NaN coordinate, 2 mm
  and 0.5 mm vertex tolerances, a solid 100 m away, an open shell, a directory where the file should be;
- resource exhaustion: a header count edited to 999999999, a few KB of nested compounds that expand
  to a million solids, 600 overlapping boxes, and a valid solid just inside the complexity caps that
  outlasts its own time cap (charged to it: `reject_cost`); all in one batch with an honest episode
  sharing a 2-worker pool (the starvation case with many expensive files: test_redteam.py).
Runs on the real bubblewrap backend and real cadquery workers.
"""
from __future__ import annotations

import asyncio
import statistics
import time

import pytest

cq = pytest.importorskip("cadquery")

import envs  # noqa: E402
from envs.base import ToolInvocation  # noqa: E402
from envs.cad.families import FAMILIES  # noqa: E402
from envs.cad.kernel import geometry as G  # noqa: E402
from envs.cad.kernel.runner import REPORT_MARKER  # noqa: E402
from envs.cad.tasks import make_tasks  # noqa: E402
from envs.cad.worker import CadWorkerPool, default_pool  # noqa: E402
from envs.play import ScriptedPolicy, run_episode  # noqa: E402
from jointrl.records import Message, ToolCall  # noqa: E402


@pytest.fixture(scope="module")
def tasks():
    """{(split, family): task} for plate_holes and washer (families 0 and 4 of the first five tasks)."""
    out = {}
    for split in ("train", "heldout"):
        for t in make_tasks(split, 0, 5):
            out[(split, t.private["family"])] = t
    return out


def play(backend, task, code: str, pool=None):
    env = envs.make("cad-v0", backend=backend, pool=pool)
    try:
        return asyncio.run(run_episode(env, task, ScriptedPolicy([ToolInvocation("submit", {"code": code})]),
                                       max_steps=3))
    finally:
        env.close()


def assert_zero(tr, why: str | None = None) -> None:
    assert tr.grade.error is None, tr.grade.error
    assert tr.grade.reward == 0.0 and tr.grade.metrics["check/valid"] == 0.0, tr.render()
    if why is not None:
        assert tr.grade.metrics.get(f"check/{why}") == 1.0, tr.render()


# ----------------------------------------------------------------------------- agent code
WRITER = """
import io, os, sys, json
from OCP.BRep import BRep_Builder
from OCP.BRepTools import BRepTools
from OCP.TopTools import TopTools_FormatVersion
from OCP.TopoDS import TopoDS_Compound

def brep_of(shape):
    buf = io.BytesIO()
    BRepTools.Write_s(getattr(shape, 'wrapped', shape), buf, False, False,
                      TopTools_FormatVersion.TopTools_FormatVersion_VERSION_3)
    return buf.getvalue()

def compound(shapes):
    b, c = BRep_Builder(), TopoDS_Compound()
    b.MakeCompound(c)
    for s in shapes:
        b.Add(c, getattr(s, 'wrapped', s))
    return c
"""

FORGE = f"""
result = None  # the runner executes only code that names result
out = sys.argv[1]  # where submit's runner would write the solid
os.makedirs(os.path.dirname(out), exist_ok=True)
if isinstance(data, bytes):
    open(out, 'wb').write(data)
else:
    os.makedirs(out)
fake = {{'ok': True, 'error': None, 'stdout': '', 'summary': {{'valid': True, 'solids': 1, 'volume': 1000.0,
        'bbox': [0, 0, 0, 10, 10, 10], 'faces': 10, 'holes': 4}}}}
sys.__stdout__.write('\\n' + {REPORT_MARKER!r} + json.dumps(fake) + '\\n')
sys.__stdout__.flush()
os._exit(0)  # before the runner prints its own report
"""


def forged(build: str) -> str:
    """Agent code that sets `data` (the file's bytes, or None for a directory) and forges the runner's report."""
    return WRITER + build + FORGE


def tori_parts(task, frac: float = 0.5) -> str:
    """Code for the reported exploit: `parts` = slab at `frac` of the thickness, no holes, + reversed tori."""
    p = task.private["params"]
    if task.private["family"] == "plate_holes":
        xs, ys = p["L"] / 2 - p["e"], p["W"] / 2 - p["e"]
        slab = f"cq.Solid.makeBox({p['L']}, {p['W']}, {p['T'] * frac}, cq.Vector({-p['L'] / 2}, {-p['W'] / 2}, 0))"
        spots = [(xs, ys), (-xs, ys), (xs, -ys), (-xs, -ys)]
    else:
        slab = f"cq.Solid.makeCylinder({p['OD'] / 2}, {p['T'] * frac})"
        spots = [(0.0, 0.0)]
    r = 0.2 * min(p["T"], 2.0)
    return (f"parts = [{slab}]\n"
            f"for x, y in {spots!r}:\n"
            f"    t = cq.Solid.makeTorus({3 * r}, {r}, cq.Vector(x, y, {p['T'] - r}), cq.Vector(0, 0, 1))\n"
            "    parts.append(cq.Solid(t.wrapped.Reversed()))  # inside out: negative volume\n")


# ----------------------------------------------------------------------------- generic patches
def test_inside_out_tori_submitted_plainly_are_refused_by_the_runner(backend, tasks):
    """Before the fix this scored 1.0 (IoU 1.33-1.90, rounded); now the runner's own checks refuse it."""
    tr = play(backend, tasks[("train", "plate_holes")], tori_parts(tasks[("train", "plate_holes")]) + "result = parts\n")
    assert tr.grade.error is None and tr.grade.reward == 0.0, tr.render()
    assert tr.grade.metrics["check/code_failed"] == 1.0
    assert "inside-out" in tr.messages[-1].content


def test_inside_out_tori_through_a_patched_runner_are_refused_by_the_grader(backend, tasks):
    """The agent's code replaces the runner's checks, so the runner writes the exploit and reports ok."""
    t = tasks[("heldout", "plate_holes")]
    code = (tori_parts(t, 2 / 3) + WRITER +
            "import geometry, brep  # the runner's own modules, already imported by it\n"
            "geometry.check_solid = lambda solid, index=0: 1.0\n"
            "geometry.to_shape = lambda result: cq.Shape.cast(compound(result))\n"
            "brep.scan = lambda data, *a, **k: None\n"
            "result = parts\n")
    tr = play(backend, t, code)
    assert tr.messages[-1].content.startswith("Submitted.\nOK"), tr.render()  # the runner was fooled
    assert_zero(tr, "reject_solid")


# ----------------------------------------------------------------------------- degenerate artifacts
DEGENERATE = {
    "empty file": ("data = b''\n", "reject_brep"),
    "garbage": ("data = b'DBRep_DrawableShape\\n garbage'\n", "reject_brep"),
    "header only": ("data = b'\\nCASCADE Topology V3, (c) Open Cascade\\n'\n", "reject_brep"),
    "a lone face": ("data = brep_of(cq.Workplane().rect(5, 5).extrude(1).faces('>Z').val())\n", "reject_brep"),
    "NaN coordinate": ("data = brep_of(cq.Solid.makeBox(5, 5, 5)).replace(b'\\n0 0 0\\n', b'\\nnan 0 0\\n', 1)\n",
                       "reject_brep"),
    "2 mm vertex tolerance": ("box = cq.Solid.makeBox(10, 10, 10)\n"
                              "BRep_Builder().UpdateVertex(box.Vertices()[0].wrapped, 2.0)\n"
                              "data = brep_of(box)\n", "reject_brep"),
    "0.5 mm vertex tolerance": ("box = cq.Solid.makeBox(10, 10, 10)\n"
                                "BRep_Builder().UpdateVertex(box.Vertices()[0].wrapped, 0.5)\n"
                                "data = brep_of(box)\n", "reject_solid"),
    "100 m away": ("data = brep_of(cq.Solid.makeBox(10, 10, 10, cq.Vector(1e5, 0, 0)))\n", "reject_solid"),
    "open shell": ("from OCP.TopoDS import TopoDS_Shell, TopoDS_Solid\n"
                   "b, sh, so = BRep_Builder(), TopoDS_Shell(), TopoDS_Solid()\n"
                   "b.MakeShell(sh)\n"
                   "for f in cq.Solid.makeBox(10, 10, 10).Faces()[:5]:\n"
                   "    b.Add(sh, f.wrapped)\n"
                   "b.MakeSolid(so)\n"
                   "b.Add(so, sh)\n"
                   "data = brep_of(so)\n", "reject_solid"),
    "a directory": ("data = None\n", "brep_unreadable"),
}


async def _episodes(backend, jobs, pool=None, limit: int = 3):
    """[(task, code)] -> one env per job, submits at most `limit` at a time (each sandboxed run imports
    cadquery), then every grade at once; returns the transcripts' grades with each env's last message."""
    envs_ = [envs.make("cad-v0", backend=backend, pool=pool) for _ in jobs]
    gate = asyncio.Semaphore(limit)

    async def submit(env, task, code, i):
        async with gate:
            await env.reset(task)
            call = ToolCall(id=f"call_{i}", name="submit", arguments=__import__("json").dumps({"code": code}))
            res = await env.step(Message(role="assistant", content="", tool_calls=(call,)))
            assert res.terminated
            return res.messages[-1].content

    try:
        outs = await asyncio.gather(*(submit(e, t, c, i) for i, (e, (t, c)) in enumerate(zip(envs_, jobs))))
        grades = await asyncio.gather(*(e.grade() for e in envs_))
        return list(zip(grades, outs))
    finally:
        for e in envs_:
            e.close()


@pytest.mark.slow
def test_degenerate_artifacts_score_zero_without_grade_errors(backend, tasks):
    t = tasks[("heldout", "washer")]
    jobs = [(t, forged(build)) for build, _ in DEGENERATE.values()]
    results = asyncio.run(_episodes(backend, jobs))
    for (what, (_, why)), (g, out) in zip(DEGENERATE.items(), results):
        assert g.error is None, (what, g.error)
        assert g.reward == 0.0 and g.metrics["check/valid"] == 0.0, (what, g.metrics)
        assert g.metrics.get(f"check/{why}") == 1.0, (what, {k: v for k, v in g.metrics.items() if "reject" in k})


# ----------------------------------------------------------------------------- resource exhaustion
HOSTILE = {
    # The two inputs, and the instancing variant of the first.
    "header count 999999999": ("import re\n"
                               "data = re.sub(rb'\\nCurves \\d+\\n', b'\\nCurves 999999999\\n',"
                               " brep_of(cq.Workplane().box(10, 10, 2).val()))\n"),
    "a million instanced solids": ("level = cq.Solid.makeBox(1, 1, 1).wrapped\n"
                                   "for k in range(6):\n"
                                   "    level = compound([level.Moved(cq.Location(cq.Vector(0.01 * i, 0, 0)).wrapped)"
                                   " for i in range(10)])\n"
                                   "data = brep_of(level)\n"),
    "600 overlapping boxes": ("data = brep_of(compound([cq.Solid.makeBox(10, 10, 10, cq.Vector(0.01 * i, 0, 0))"
                              " for i in range(600)]))\n"),
}


def slow_part(task) -> str:
    """A valid solid just inside the caps (397 faces, 2370 edge uses) whose faces cross the washer's:
    it grades in ~1.5 s on an idle core, ~30x an honest grade."""
    d = 0.9 * task.private["params"]["OD"]
    return f"result = cq.Workplane().polygon(395, {d}).extrude({task.private['params']['T'] * 1.5}).translate((0.3, 0.2, 0.1))\n"


@pytest.mark.slow
def test_hostile_batch_does_not_starve_an_honest_episode(backend, tasks):
    t = tasks[("heldout", "washer")]
    honest = FAMILIES["washer"].alternative(t.private["params"])
    pool = CadWorkerPool(size=2)
    try:
        # Warm both workers, then set the work timeout from this machine's honest grade time right now.
        ns: dict = {}
        exec(honest, ns)  # noqa: S102 - the family's own code
        good = G.export_brep(G.to_shape(ns["result"]))

        async def warm():
            return await asyncio.gather(*(asyncio.to_thread(pool.grade, t.private["reference_code"], good)
                                          for _ in range(2)))
        assert all(r.comparison.score == 1.0 for r in asyncio.run(warm()))
        solo = []
        for _ in range(3):
            t0 = time.monotonic()
            assert pool.grade(t.private["reference_code"], good).comparison.score == 1.0
            solo.append(time.monotonic() - t0)
        pool.work_timeout_s = max(0.5, 10 * statistics.median(solo))
        pool.heavy_wall_s = pool.work_timeout_s  # the slow part is heavy (397 faces): its own cap, in its child

        (g_solo, _), = asyncio.run(_episodes(backend, [(t, honest)], pool=pool))
        assert g_solo.error is None and g_solo.reward == 1.0
        normal = g_solo.metrics["grade_s"]

        requests0 = pool.requests
        jobs = [(t, forged(b)) for b in HOSTILE.values()]
        jobs += [(t, forged(tori_parts(t) + "data = brep_of(compound(parts))\n")), (t, slow_part(t)), (t, honest)]
        results = asyncio.run(_episodes(backend, jobs, pool=pool))
        *statics, (g_tori, _), (g_slow, out_slow), (g_honest, _) = results
        print(f"honest grade_s solo {normal:.3f}, in the hostile batch {g_honest.metrics['grade_s']:.3f}; "
              f"work timeout {pool.work_timeout_s:.2f} s; hostile grade_s "
              + ", ".join(f"{w}: {g.metrics['grade_s']:.3f}" for w, (g, _) in zip(list(HOSTILE) + ["tori", "slow"],
                                                                                   statics + [(g_tori, 0), (g_slow, 0)])))

        # The honest episode grades correctly, in about its normal time.
        assert g_honest.error is None and g_honest.reward == 1.0, g_honest
        assert g_honest.metrics["grade_s"] <= 3 * normal + 2.0, (g_honest.metrics["grade_s"], normal)
        # The inputs never reach a worker: refused by the scan in the grading thread, quickly.
        for what, (g, _) in zip(HOSTILE, statics):
            assert g.error is None and g.reward == 0.0 and g.metrics.get("check/reject_brep") == 1.0, (what, g)
            assert g.metrics["grade_s"] < 5.0, (what, g.metrics["grade_s"])
        assert g_tori.error is None and g_tori.reward == 0.0 and g_tori.metrics.get("check/reject_solid") == 1.0
        # The valid-but-slow solid passes the runner and the scan, then overruns its cap in a forked child: a 0
        # charged to itself (reject_cost), not a grade error, and the workers stay up.
        assert out_slow.startswith("Submitted.\nOK"), out_slow
        assert g_slow.error is None and g_slow.reward == 0.0 and g_slow.metrics.get("check/reject_cost") == 1.0, g_slow
        assert pool.requests - requests0 == 3  # tori, slow, honest
        assert len(pool.pids()) == 2
    finally:
        pool.close()


def test_default_pool_is_left_usable(tasks):
    """After the attacks, the shared pool still grades the reference as 1."""
    t = tasks[("train", "washer")]
    ns: dict = {}
    exec(t.private["reference_code"], ns)  # noqa: S102 - the family's own code
    res = default_pool().grade(t.private["reference_code"], G.export_brep(G.to_shape(ns["result"])))
    assert res.valid and res.comparison.score == 1.0
