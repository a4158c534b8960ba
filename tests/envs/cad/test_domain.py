"""cad-v0 end to end on the real bubblewrap sandbox and the warm grading workers: the conformance
checker passes; every family's reference and alternative construction are graded 1 by the workers;
the same part built differently scores 1 through the tools, a hole-less part clearly less; code that
loops forever or allocates without bound is killed within its budget and scores 0; a forged report
or a planted symlink gets nothing; `run_cad` reports on the agent's own solid only; a caller waiting
for a busy pool gives up at its deadline; a grading worker that overruns is killed and replaced in
the background. Attacks on the grader itself: test_adversarial.py."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import random
import time

import pytest

cq = pytest.importorskip("cadquery")

import envs  # noqa: E402
from envs.base import ToolInvocation  # noqa: E402
from envs.cad.families import FAMILIES  # noqa: E402
from envs.cad.kernel import geometry as G  # noqa: E402
from envs.cad.kernel.runner import REPORT_MARKER  # noqa: E402
from envs.cad.tasks import make_tasks  # noqa: E402
from envs.cad.worker import CadWorkerError, CadWorkerPool, default_pool  # noqa: E402
from envs.check import check_env  # noqa: E402
from envs.play import ScriptedPolicy, run_episode  # noqa: E402
from envs.sandbox import hostctl  # noqa: E402

FAMILY_NAMES = list(FAMILIES)


@pytest.fixture(scope="module")
def tasks():
    # One train task per family (task i uses family i mod F).
    return {t.private["family"]: t for t in make_tasks("train", 0, len(FAMILY_NAMES))}


def play(backend, task, invocations, *, limits=None):
    """One episode; returns (transcript, sandbox uid, wall seconds)."""
    kw = {"backend": backend}
    if limits is not None:
        kw["limits"] = limits
    env = envs.make("cad-v0", **kw)
    seen = {}

    async def go():
        orig = env.domain.setup

        def setup(t):
            orig(t)
            seen["uid"] = env.domain.sandbox.uid
        env.domain.setup = setup
        return await run_episode(env, task, ScriptedPolicy(invocations), max_steps=20)

    t0 = time.monotonic()
    try:
        tr = asyncio.run(go())
    finally:
        env.close()
    return tr, seen.get("uid"), time.monotonic() - t0


def brep_of(code: str) -> bytes:
    ns: dict = {}
    exec(code, ns)  # noqa: S102 - the families' own trusted code
    return G.export_brep(G.to_shape(ns["result"]))


def test_check_env_passes(backend):
    report = check_env("cad-v0", n_tasks=2, n_generate=8, env_kwargs={"backend": backend})
    assert report.passed, report.render()


def test_tasks_carry_a_picture_and_the_reference_summary(tasks):
    import base64

    for name, t in tasks.items():
        png = base64.b64decode(t.public["image_png_b64"])
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 500, name
        assert "pixels per mm" in t.public["image_views"]
        ref = t.private["reference"]
        assert ref["holes"] == FAMILIES[name].holes(t.private["params"])
        # Nothing private leaks into what the agent sees.
        seen = json.dumps([m.to_openai() for m in t.prompt]) + json.dumps(dict(t.public))
        assert "result = " not in seen and f"{ref['volume']:.6g}" not in seen


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_workers_grade_reference_and_alternative_one(name):
    fam = FAMILIES[name]
    p = fam.params(random.Random(name).choice(fam.variants()))
    pool = default_pool()
    for code in (fam.reference(p), fam.alternative(p)):
        res = pool.grade(fam.reference(p), brep_of(code))
        assert res.valid and res.comparison is not None
        assert res.comparison.score == 1.0, res.comparison


def test_workers_report_invalid_files_as_no_solid():
    fam = FAMILIES["washer"]
    ref = fam.reference(fam.params(fam.variants()[0]))
    assert default_pool().grade(ref, b"DBRep_DrawableShape\n garbage").valid is False
    face_only = G.export_brep(cq.Workplane().rect(5, 5).extrude(1).faces(">Z").val())
    r = default_pool().grade(ref, face_only)
    assert r.valid is False and "no solid" in r.reason


def test_grading_worker_overrun_is_killed_and_replaced():
    pool = CadWorkerPool(size=1)
    try:
        fam = FAMILIES["washer"]
        ref = fam.reference(fam.params(fam.variants()[0]))
        good = brep_of(ref)
        assert pool.grade(ref, good).comparison.score == 1.0
        (pid,) = pool.pids()
        # While the only worker is busy, another caller waits until its own deadline, then gets an error.
        slow_ref = "import time\ntime.sleep(4)\n" + ref
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            busy = ex.submit(pool.grade, slow_ref, good)
            time.sleep(0.5)
            t0 = time.monotonic()
            with pytest.raises(CadWorkerError, match="no CAD worker became free"):
                pool.grade(ref, good, timeout_s=1.0)
            assert time.monotonic() - t0 < 3.0
            assert busy.result().comparison.score == 1.0
        t0 = time.monotonic()
        with pytest.raises(CadWorkerError, match="exceeded"):
            pool.grade("while True:\n    pass\n", good, timeout_s=2.0)
        assert time.monotonic() - t0 < 6.0
        assert pid not in pool.pids()
        # A replacement starts in the background, before anyone asks for one.
        deadline = time.monotonic() + 120
        while not pool.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pool.pids() and pool.pids() != [pid]
        assert pool.grade(ref, good).comparison.score == 1.0
    finally:
        pool.close()


def test_same_part_built_differently_scores_one_and_holeless_part_lower(backend, tasks):
    t = tasks["plate_holes"]
    p = t.private["params"]
    fam = FAMILIES["plate_holes"]
    tr, _, _ = play(backend, t, [ToolInvocation("submit", {"code": fam.alternative(p)})])
    assert tr.grade.error is None and tr.grade.reward == 1.0, tr.render()
    holeless = f"result = cq.Workplane().box({p['L']}, {p['W']}, {p['T']}, centered=(True, True, False))"
    tr, _, _ = play(backend, t, [ToolInvocation("submit", {"code": holeless})])
    m = tr.grade.metrics
    assert tr.grade.error is None
    assert m["check/iou"] > 0.85 and m["check/holes_ok"] == 0 and m["check/faces_ok"] == 0 and m["check/bbox_ok"] == 1
    assert tr.grade.reward == pytest.approx(m["check/iou"] / 3) and tr.grade.reward < 0.34


def _assert_uid_clean(uid):
    deadline = time.monotonic() + 5
    while hostctl.pids_of_uid(uid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert hostctl.pids_of_uid(uid) == []


def test_infinite_loop_is_killed_within_budget_and_scores_zero(backend, tasks):
    t = tasks["washer"]
    limits = dataclasses.replace(t.limits, tool_timeout_s=15.0)
    code = "import cadquery as cq\nresult = cq.Workplane().box(1, 1, 1)\nwhile True:\n    pass\n"
    tr, uid, wall = play(backend, t, [ToolInvocation("submit", {"code": code})], limits=limits)
    assert wall < 15.0 + 10.0, f"episode took {wall:.1f} s"
    assert tr.grade.error is None and tr.grade.reward == 0.0
    assert tr.grade.metrics["check/timed_out"] == 1.0 and tr.grade.metrics["check/valid"] == 0.0
    assert "time limit" in tr.messages[-1].content
    _assert_uid_clean(uid)


def test_unbounded_allocation_is_stopped_and_scores_zero(backend, tasks):
    t = tasks["washer"]
    limits = dataclasses.replace(t.limits, tool_timeout_s=30.0)
    code = "import cadquery as cq\nresult = cq.Workplane().box(1, 1, 1)\nhog = []\nwhile True:\n    hog.append(bytearray(50_000_000))\n"
    tr, uid, wall = play(backend, t, [ToolInvocation("submit", {"code": code})], limits=limits)
    assert wall < 30.0 + 10.0, f"episode took {wall:.1f} s"
    assert tr.grade.error is None and tr.grade.reward == 0.0
    assert tr.grade.metrics["check/valid"] == 0.0
    out = tr.messages[-1].content
    assert "MemoryError" in out or "killed" in out, out
    _assert_uid_clean(uid)


def test_leftover_thread_does_not_hold_the_run_open(backend, tasks):
    t = tasks["washer"]
    p = t.private["params"]
    code = ("import threading, time\n"
            "threading.Thread(target=lambda: time.sleep(1000)).start()\n"
            + FAMILIES["washer"].reference(p))
    limits = dataclasses.replace(t.limits, tool_timeout_s=40.0)
    tr, _, wall = play(backend, t, [ToolInvocation("submit", {"code": code})], limits=limits)
    assert tr.grade.error is None and tr.grade.reward == 1.0, tr.render()
    assert tr.grade.metrics["check/timed_out"] == 0.0


def test_forged_report_and_planted_symlink_get_nothing(backend, tasks):
    t = tasks["washer"]
    fake = {"ok": True, "error": None, "stdout": "", "summary": {"valid": True, "solids": 1, "volume": 1.0,
                                                                 "bbox": [0, 0, 0, 1, 1, 1], "faces": 4, "holes": 1}}
    code = ("import os, sys\n"
            "result = None  # the runner executes only code that names result\n"
            "out = sys.argv[1]\n"
            "os.makedirs(os.path.dirname(out), exist_ok=True)\n"
            "os.symlink('/etc/passwd', out)\n"
            f"sys.__stdout__.write('\\n' + {REPORT_MARKER!r} + {json.dumps(json.dumps(fake))} + '\\n')\n"
            "sys.__stdout__.flush()\n"
            "os._exit(0)\n")
    tr, uid, _ = play(backend, t, [ToolInvocation("submit", {"code": code})])
    assert tr.grade.error is None and tr.grade.reward == 0.0, tr.render()
    assert tr.grade.metrics["check/brep_unreadable"] == 1.0


def test_run_cad_reports_the_agents_own_solid_and_errors(backend, tasks):
    t = tasks["plate_holes"]
    calls = [
        ToolInvocation("run_cad", {"code": "result = cq.Workplane().box(10, 20, 30)\nprint('hello from the part')"}),
        ToolInvocation("run_cad", {"code": "result = cq.Workplane(.box(1, 2, 3)"}),
        ToolInvocation("run_cad", {"code": "part = cq.Workplane().box(1, 2, 3)"}),
        ToolInvocation("submit", {"code": ""}),
    ]
    tr, _, _ = play(backend, t, calls)
    outs = [m.content for m in tr.messages if m.role == "tool"]
    assert "volume: 6000 mm^3" in outs[0] and "through-holes: 0" in outs[0] and "hello from the part" in outs[0]
    assert "x [-5, 5]" in outs[0] and "faces: 6" in outs[0]
    ref = t.private["reference"]
    for text in outs:  # never a comparison with the target
        assert "iou" not in text.lower() and f"{ref['volume']:.6g}" not in text
    assert "SyntaxError" in outs[1]
    assert "`result`" in outs[2]
    assert tr.grade.reward == 0.0 and tr.grade.metrics["check/code_failed"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_every_family_reference_and_alternative_score_one_in_the_sandbox(backend, tasks, name):
    t = tasks[name]
    for code in (t.private["reference_code"], FAMILIES[name].alternative(t.private["params"])):
        tr, _, _ = play(backend, t, [ToolInvocation("submit", {"code": code})])
        assert tr.grade.error is None and tr.grade.reward == 1.0, tr.render()


def test_render_view_draws_the_agents_current_solid(backend, tasks):
    from model.vision import VisionSpec, decode_image

    t = tasks["plate_holes"]
    calls = [
        ToolInvocation("render_view", {"view": "iso"}),  # nothing built yet
        ToolInvocation("run_cad", {"code": "result = cq.Workplane().box(10, 20, 30)"}),
        ToolInvocation("render_view", {"view": "top"}),
        ToolInvocation("render_view", {"view": "iso"}),
        ToolInvocation("render_view", {"view": "sideways"}),
        ToolInvocation("run_cad", {"code": "result = 1 / 0"}),  # a failed run leaves the current solid as it was
        ToolInvocation("render_view", {"view": "top"}),
        ToolInvocation("submit", {"code": ""}),
    ]
    tr, _, _ = play(backend, t, calls)
    outs = [m for m in tr.messages if m.role == "tool"]
    assert "no solid yet" in outs[0].content and outs[0].images == ()
    spec = VisionSpec(image_token_id=10, patch_size=16, channels=3)
    top, iso = (decode_image(outs[i].images[0], spec) for i in (2, 3))
    assert (top.width, top.height) == (iso.width, iso.height) == (128, 128)
    assert "top view" in outs[2].content and outs[2].images != outs[3].images
    # the 10 x 20 box seen from the top is a 1:2 (x:y) rectangle of shaded part colour
    import numpy as np

    px = top.pixels_HWC.astype(int)
    part = px[..., 2] - px[..., 0] > 15  # the shaded part colour is bluish; white, edges and the X / Y axes are not
    rows, cols = part.any(1).nonzero()[0], part.any(0).nonzero()[0]
    assert 1.7 < (np.ptp(rows) + 1) / (np.ptp(cols) + 1) < 2.3
    assert "view must be one of top, front, right, iso" in outs[4].content
    assert outs[6].images == outs[2].images
    assert tr.grade.metrics["malformed_calls"] == 1.0  # the unknown view, counted like any bad argument
