"""Red team for the CAD graders (`cad-v0`, `cad-primitive-v0`), written as the policy would attack them.

Two classes of attack, each rebuilt from the threat rather than from one reported input:

* **features without the part.** The feature term (holes, faces, bounding box) multiplies the IoU, so a
  policy that gets the outside of a part roughly right wants the feature checks met without modelling the
  features. The cheap ways: geometry that does not change the part's outside, or changes it by a speck.
  Each attack starts from the part's envelope (its bounding box, no holes, no pockets) and adds, as many
  as the reference's genus and face count call for:
    - closed cavities (torus voids for the genus, sphere voids for the faces): invisible from outside;
    - tiny bodies attached to the outside (small rings standing on the top face for the genus, sphere
      caps for the faces);
    - tiny detached bodies (small rings floating above the part).
  Against counts (the genus and the merged faces over every shell and solid) these meet the checks the
  plain envelope fails: the tests measure that lift, so they keep their teeth. Against the grader they
  must score no more than the plain envelope (the IoU may move by the speck's volume, nothing else).
* **grader starvation.** Valid files inside every cap that are expensive to grade (four overlapping
  70-gon prisms written as separate solids: ~1.3 s each on an idle core) queued ahead of an honest file
  must not make the honest grade miss its deadline, and a file that overruns its own CPU cap is charged
  to itself (score 0, `reject_cost`), without killing a worker or failing anyone else's grade.

In process on the real kernel, through real grading workers, and through the `Env` API on the real
bubblewrap sandbox for the episode-level cases.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import statistics
import threading
import time

import pytest

cq = pytest.importorskip("cadquery")

import envs  # noqa: E402
from envs.cad import primitive as P  # noqa: E402
from envs.cad.families import FAMILIES  # noqa: E402
from envs.cad.kernel import geometry as G  # noqa: E402
from envs.cad.tasks import make_tasks  # noqa: E402
from envs.cad.worker import CadWorkerPool  # noqa: E402
from jointrl.records import Message, ToolCall  # noqa: E402


def build(code: str):
    ns: dict = {}
    exec(code, ns)  # noqa: S102 - the families' code, or attack code written here
    return G.to_shape(ns["result"])


# ----------------------------------------------------------------------------- attack code
def envelope_code(box, *, cavities: tuple[int, int] = (0, 0), attached: tuple[int, int] = (0, 0),
                  detached: int = 0) -> str:
    """CadQuery code (`cq` predefined, as in the sandbox) for the solid box `box` (x0, y0, z0, x1, y1, z1)
    plus small extras in a row along X at mid-width: `cavities` = (torus voids, sphere voids) at mid-height,
    `attached` = (rings standing on the top face, sphere caps half sunk into it), `detached` rings floating
    above it. Each ring or torus adds one to the genus and one face; each sphere one face."""
    x0, y0, z0, x1, y1, z1 = box
    dx, dy, dz = x1 - x0, y1 - y0, z1 - z0
    n = sum(cavities) + sum(attached) + detached
    step = dx / (n + 1)
    r = 0.1 * min(dz, dy, step)  # cavities: the tube radius; each fits in 6 r < min(dz, dy, step) with room to spare
    # Bodies outside the box stay within half the bounding-box tolerance of it, so the box check still passes.
    a = G.bbox_tolerance(box) / 6
    ym, zm = (y0 + y1) / 2, (z0 + z1) / 2
    xs = [x0 + step * (i + 1) for i in range(n)]
    lines = ["import cadquery as cq",
             f"part = cq.Solid.makeBox({dx!r}, {dy!r}, {dz!r}, cq.Vector({x0!r}, {y0!r}, {z0!r}))",
             "extra = []"]
    kinds = (["void_torus"] * cavities[0] + ["void_sphere"] * cavities[1] + ["ring"] * attached[0]
             + ["cap"] * attached[1] + ["float"] * detached)
    for x, kind in zip(xs, kinds):
        if kind == "void_torus":
            lines.append(f"part = part.cut(cq.Solid.makeTorus({2 * r!r}, {r!r}, cq.Vector({x!r}, {ym!r}, {zm!r}), "
                         "cq.Vector(0, 0, 1)))")
        elif kind == "void_sphere":
            lines.append(f"part = part.cut(cq.Workplane().sphere({r!r}).val().translate(cq.Vector({x!r}, {ym!r}, {zm!r})))")
        elif kind == "ring":  # a tiny handle: a ring in the XZ plane, half sunk (its axis in the top face's plane)
            lines.append(f"part = part.fuse(cq.Solid.makeTorus({2 * a!r}, {0.5 * a!r}, cq.Vector({x!r}, {ym!r}, "
                         f"{z1!r}), cq.Vector(0, 1, 0))).clean()")
        elif kind == "cap":
            lines.append(f"part = part.fuse(cq.Workplane().sphere({a!r}).val().translate(cq.Vector({x!r}, {ym!r}, {z1!r})))"
                         ".clean()")
        else:  # a tiny ring lying flat just above the top face, touching nothing
            lines.append(f"extra.append(cq.Solid.makeTorus({2 * a!r}, {0.5 * a!r}, cq.Vector({x!r}, {ym!r}, "
                         f"{z1 + a!r}), cq.Vector(0, 0, 1)))")
    lines.append("result = [part] + extra if extra else part")
    return "\n".join(lines) + "\n"


def exploit_code(ref_summary: G.Summary, how: str) -> str:
    """The envelope with as many extras as make its genus and face count equal the reference's."""
    genus, faces = ref_summary.holes, ref_summary.faces
    spare = max(0, faces - 6 - genus)  # faces the box lacks beyond one per torus (an attached ring adds two)
    if how == "cavities":
        return envelope_code(ref_summary.bbox, cavities=(genus, spare))
    if how == "attached":
        return envelope_code(ref_summary.bbox, attached=(genus, spare))
    if how == "detached":
        return envelope_code(ref_summary.bbox, detached=genus)
    raise KeyError(how)


def count_score(agent, ref, c: G.Comparison) -> float:
    """The score with the feature term read from counts over every shell and solid (genus, merged faces): the
    check these attacks were built against."""
    holes = G.through_holes(agent) == G.through_holes(ref)
    faces = G.face_count(agent) == G.face_count(ref)
    iou = 1.0 if c.iou >= 1.0 - G.IOU_SNAP else c.iou
    return iou * (holes + faces + c.bbox_ok) / 3


def cases() -> list[tuple[str, str]]:
    """(name, reference code): every cad-v0 family (two variants each) and every primitive of the first rung."""
    out = []
    for name, fam in FAMILIES.items():
        for v in random.Random(f"redteam:{name}").sample(fam.variants(), 2):
            out.append((f"{name}{v}", fam.reference(fam.params(v))))
    for t in P.make_tasks("train", 0, 6):
        out.append((t.id, t.private["reference_code"]))
    return out


# ----------------------------------------------------------------------------- features without the part
@pytest.mark.parametrize("how", ["cavities", "attached", "detached"])
def test_extras_that_leave_the_outside_alone_earn_no_feature(how):
    plain_scores, attack_scores, count_scores = [], [], []
    lifted_by_counts = attackable = 0
    for name, ref_code in cases():
        ref = build(ref_code)
        rf = G.features(ref, perimeters=True)
        rs = G.summarize(ref, rf)
        plain = G.load_submission(G.export_brep(build(envelope_code(rs.bbox))))
        cp = G.compare(plain, ref, rs, rf)
        attackable += exploit_code(rs, how) != envelope_code(rs.bbox)
        try:
            attack = G.load_submission(G.export_brep(build(exploit_code(rs, how))))
        except G.NoSolidError as e:  # e.g. more detached bodies than the grader reads: the attacker's 0
            assert e.code == "brep" and how == "detached", (name, e)
            plain_scores.append(cp.score)
            attack_scores.append(0.0)
            count_scores.append(0.0)
            continue
        ca = G.compare(attack, ref, rs, rf)
        # The extras are specks: the IoU moves by their volume only (a cavity inside the target's hole even
        # helps it a little, as it would for any solid closer to the target).
        assert abs(ca.iou - cp.iou) < 0.01, (name, cp.iou, ca.iou)
        # No feature check passes for the attack that fails for the plain envelope.
        for check in ("holes_ok", "faces_ok", "bbox_ok"):
            assert getattr(ca, check) <= getattr(cp, check), (name, check, cp, ca)
        assert ca.score <= cp.score + 0.01, (name, cp.score, ca.score)
        if how == "cavities":
            assert ca.agent_voids == rs.holes + max(0, rs.faces - 6 - rs.holes), (name, ca)
        if how == "detached":
            assert ca.agent_solids == 1 + rs.holes
        plain_scores.append(cp.score)
        attack_scores.append(ca.score)
        count_scores.append(count_score(attack, ref, ca))
        lifted_by_counts += count_scores[-1] > cp.score + 0.1
    print(f"{how}: {len(plain_scores)} parts, {attackable} with extras; envelope {statistics.mean(plain_scores):.3f}, "
          f"with the extras {statistics.mean(attack_scores):.3f} (counted features: {statistics.mean(count_scores):.3f}, "
          f"lifting {lifted_by_counts})")
    # The attack is real against counted features (the reported exploit: 0.323 -> 0.970 over 8 episodes).
    assert lifted_by_counts >= 0.6 * attackable and attackable >= len(plain_scores) // 2
    assert statistics.mean(count_scores) > 1.4 * statistics.mean(plain_scores)
    assert statistics.mean(attack_scores) <= statistics.mean(plain_scores) + 0.005


def test_a_detached_speck_costs_the_correct_part_its_features():
    """Exactly one solid: the reference plus a detached 0.1 mm cube keeps its IoU but no hole or face counts."""
    fam = FAMILIES["plate_holes"]
    p = fam.params(fam.variants()[0])
    ref = build(fam.reference(p))
    with_speck = G.load_submission(G.export_brep(G.to_shape(
        [ref, cq.Solid.makeBox(0.1, 0.1, 0.1, cq.Vector(0, 0, p["T"] + 0.5))])))
    c = G.compare(with_speck, ref)
    assert c.agent_solids == 2 and c.iou > 0.999999
    assert (c.holes_ok, c.faces_ok) == (0.0, 0.0) and c.score < 0.34


def test_walls_in_the_wrong_place_or_size_match_no_hole():
    """Hole walls are matched by position and size: a concave cylinder of the hole's radius that is a blind
    pocket (wrong length), a hole shifted by 2 mm, or a boss where the hole should be never pass holes_ok,
    with the genus made up by a tiny ring on the top face."""
    p = {"L": 80, "W": 50, "T": 6, "d": 8, "e": 8}
    ref = build(FAMILIES["plate_holes"].reference(p))
    rings = "".join(f"part = part.fuse(cq.Solid.makeTorus(1.0, 0.3, cq.Vector({x}, 0, 6), cq.Vector(0, 1, 0))).clean()\n"
                    for x in (-6, -2, 2, 6))
    pts = "[(32, 17), (-32, 17), (32, -17), (-32, -17)]"
    plate = "part = cq.Workplane().box(80, 50, 6, centered=(True, True, False)).faces('>Z').workplane()"
    wrong = {
        "blind pockets 3 mm deep (+4 rings)": f"{plate}.pushPoints({pts}).hole(8, 3).val()\n" + rings,
        "holes shifted 2 mm in X": f"{plate}.pushPoints([(x + 2, y) for x, y in {pts}]).hole(8).val()\n",
        "bosses where the holes are (+4 rings)": (
            "part = cq.Workplane().box(80, 50, 6, centered=(True, True, False)).val()\n"
            f"part = part.fuse(*[cq.Solid.makeCylinder(4, 2, cq.Vector(x, y, 6)) for x, y in {pts}]).clean()\n" + rings),
    }
    for what, code in wrong.items():
        agent = build("import cadquery as cq\n" + code + "result = part\n")
        c = G.compare(agent, ref)
        assert c.holes_ok == 0.0 and c.faces_ok == 0.0, (what, c)
        if "rings" in what:
            assert c.agent_holes == 4 and G.through_holes(agent) == 4  # the genus alone would have passed
    # The honest part, built the other way, still matches every feature.
    assert G.compare(build(FAMILIES["plate_holes"].alternative(p)), ref).score == 1.0


# ----------------------------------------------------------------------------- through the Env API
def _submit_all(backend, jobs, pool=None, limit: int = 2):
    """[(env id, task, code)] -> grades, after submitting each code with the env's own `submit` tool."""
    async def run():
        made = [envs.make(env_id, backend=backend, pool=pool) for env_id, _, _ in jobs]
        gate = asyncio.Semaphore(limit)

        async def one(env, task, code, i):
            async with gate:
                await env.reset(task)
                call = ToolCall(id=f"call_{i}", name="submit", arguments=json.dumps({"code": code}))
                res = await env.step(Message(role="assistant", content="", tool_calls=(call,)))
                assert res.terminated

        try:
            await asyncio.gather(*(one(e, t, c, i) for i, (e, (_, t, c)) in enumerate(zip(made, jobs))))
            return await asyncio.gather(*(e.grade() for e in made))
        finally:
            for e in made:
                e.close()
    return asyncio.run(run())


def test_cavity_exploit_through_the_env_scores_like_the_plain_envelope(backend):
    """The reported attack, episode by episode: a part missing its holes plus cavities for the hole and face
    counts, on cad-v0 (plate with holes, washer) and cad-primitive-v0 (box with a hole)."""
    by_family = {t.private["family"]: t for t in make_tasks("heldout", 0, 5)}
    box_hole = next(t for t in P.make_tasks("heldout", 0, 6) if t.private["family"] == "box_hole")
    jobs = []
    for env_id, t in (("cad-v0", by_family["plate_holes"]), ("cad-v0", by_family["washer"]), (P.ENV_ID, box_hole)):
        rs = G.summarize(build(t.private["reference_code"]))
        body = lambda code: code.split("\n", 1)[1]  # noqa: E731 - `cq` is predefined in the sandbox
        jobs += [(env_id, t, body(envelope_code(rs.bbox))), (env_id, t, body(exploit_code(rs, "cavities")))]
    grades = _submit_all(backend, jobs)
    for i in range(0, len(grades), 2):
        plain, attack = grades[i], grades[i + 1]
        assert plain.error is None and attack.error is None, (plain.error, attack.error)
        assert attack.metrics["check/valid"] == 1.0 and attack.metrics["check/voids"] >= 1.0, attack.metrics
        assert attack.metrics["check/feature_term"] <= plain.metrics["check/feature_term"], (plain.metrics, attack.metrics)
        assert attack.reward <= plain.reward + 0.01, (jobs[i][1].id, plain.reward, attack.reward)


# ----------------------------------------------------------------------------- grader starvation
def _compound(shapes):
    from OCP.BRep import BRep_Builder
    from OCP.TopoDS import TopoDS_Compound

    b, c = BRep_Builder(), TopoDS_Compound()
    b.MakeCompound(c)
    for s in shapes:
        b.Add(c, s.wrapped)
    return cq.Shape.cast(c)


def expensive_file(width: float, height: float) -> bytes:
    """Four overlapping 70-gon prisms as four solids (288 faces: inside the caps), fused by the grader."""
    parts = [cq.Workplane().polygon(70, width).extrude(height).rotate((0, 0, 0), (0, 0, 1), 360 / 70 * i / 4)
             .translate((0.3 * i, 0.2, 0.1)).val() for i in range(4)]
    return G.export_brep(_compound(parts))


def _washer():
    fam = FAMILIES["washer"]
    p = {"OD": 30, "ID": 13, "T": 3}
    return fam.reference(p), G.export_brep(build(fam.alternative(p)))


def _warm(pool, ref_code, honest):
    with concurrent.futures.ThreadPoolExecutor(pool.size) as ex:
        assert all(r.comparison.score == 1.0 for r in ex.map(lambda _: pool.grade(ref_code, honest), range(pool.size)))
    assert len(pool.pids()) == pool.size


def test_expensive_files_queued_first_do_not_starve_an_honest_grade():
    ref_code, honest = _washer()
    heavy = expensive_file(28, 4.5)
    pool = CadWorkerPool(size=2)
    try:
        _warm(pool, ref_code, honest)
        pids = sorted(pool.pids())
        t0 = time.monotonic()
        first = pool.grade(ref_code, heavy)
        one_heavy = time.monotonic() - t0
        assert first.valid and first.comparison.score == 0.0
        # Enough of them that, served in arrival order on both workers, they hold the pool past the deadline.
        n = 12
        deadline = max(6.0, 0.4 * n * one_heavy)
        out: dict = {}

        def grade(key, data):
            t = time.monotonic()
            try:
                out[key] = (pool.grade(ref_code, data, timeout_s=deadline), time.monotonic() - t)
            except Exception as e:  # noqa: BLE001 - recorded, asserted below
                out[key] = (e, time.monotonic() - t)

        threads = [threading.Thread(target=grade, args=(i, heavy)) for i in range(n)]
        for th in threads:
            th.start()
        time.sleep(0.5)  # every expensive file is queued or running before the honest one arrives
        served_before = len(pool.served)  # requests that took a worker before the honest one was sent
        honest_thread = threading.Thread(target=grade, args=("honest", honest))
        honest_thread.start()
        for th in threads + [honest_thread]:
            th.join()
        g, wait = out.pop("honest")

        def what(r) -> str:
            return f"error ({r})" if isinstance(r, Exception) else (r.code or "graded")
        print(f"one expensive grade {one_heavy:.2f} s; {n} queued, deadline {deadline:.1f} s; honest: {what(g)} in "
              f"{wait:.2f} s; expensive: " + ", ".join(f"{what(r)} {t:.1f}s" for r, t in out.values()))
        assert not isinstance(g, Exception), g
        assert g.valid and g.comparison.score == 1.0
        assert wait < max(3.0, one_heavy), wait
        # Every expensive file got its own outcome: graded, or charged its cost once past its deadline. None of
        # them is a grade error, and no worker was killed for them.
        for key, (r, _) in out.items():
            assert not isinstance(r, Exception), (key, r)
            assert (r.valid and r.comparison.score == 0.0) or (not r.valid and r.code == "cost"), (key, r)
        assert sorted(pool.pids()) == pids
        # Served cheapest first: the honest file took the next free worker, ahead of the expensive files still
        # waiting (one more may have taken a worker between the count above and the honest request's arrival;
        # on a loaded machine a worker can free up within the 0.5 s above, so the count is read, not assumed).
        order = [cost for op, cost in pool.served[-(n + 1):]]
        honest_at = len(order) - 1 - order[::-1].index(min(order))
        assert honest_at <= served_before - (len(pool.served) - len(order)) + 1, (order, served_before)
    finally:
        pool.close()


def test_a_file_past_its_cpu_cap_is_charged_to_itself_and_no_worker_dies():
    """A valid solid just inside the complexity caps (a 395-gon prism crossing the washer: ~1.5 s on an idle
    core) against a 1 s CPU cap: reject `cost` for it, the honest grade beside it unaffected, the same workers."""
    ref_code, honest = _washer()
    slow = G.export_brep(build("import cadquery as cq\nresult = cq.Workplane().polygon(395, 27).extrude(4.5)"
                               ".translate((0.3, 0.2, 0.1))"))
    pool = CadWorkerPool(size=2, heavy_cpu_s=1, heavy_wall_s=0.3)
    try:
        _warm(pool, ref_code, honest)
        pids = sorted(pool.pids())
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            slow_f = ex.submit(pool.grade, ref_code, slow)
            time.sleep(0.05)
            honest_f = ex.submit(pool.grade, ref_code, honest)
            r, h = slow_f.result(), honest_f.result()
        assert not r.valid and r.code == "cost" and "CPU" in r.reason, r
        assert h.valid and h.comparison.score == 1.0
        assert sorted(pool.pids()) == pids
        # Drawing is a convenience: only plain files take a worker for it.
        with pytest.raises(ValueError, match="too complex to draw"):
            pool.render_submission(slow, "iso", 64)
        assert len(pool.render_submission(honest, "iso", 64)) > 100
    finally:
        pool.close()


FORGE_HEAVY = """
import io, os, sys, json
result = None  # the runner executes only code that names result
from OCP.BRep import BRep_Builder
from OCP.BRepTools import BRepTools
from OCP.TopTools import TopTools_FormatVersion
from OCP.TopoDS import TopoDS_Compound
b, c = BRep_Builder(), TopoDS_Compound()
b.MakeCompound(c)
for i in range(4):  # four overlapping 70-gon prisms, left unfused for the grader to fuse
    b.Add(c, cq.Workplane().polygon(70, {width}).extrude({height}).rotate((0, 0, 0), (0, 0, 1), 360 / 70 * i / 4)
          .translate((0.3 * i, 0.2, 0.1)).val().wrapped)
buf = io.BytesIO()
BRepTools.Write_s(c, buf, False, False, TopTools_FormatVersion.TopTools_FormatVersion_VERSION_3)
os.makedirs(os.path.dirname(sys.argv[1]), exist_ok=True)
open(sys.argv[1], 'wb').write(buf.getvalue())
sys.__stdout__.write('\\n' + {marker!r} + json.dumps({{'ok': True, 'stdout': '', 'summary': None}}) + '\\n')
sys.__stdout__.flush()
os._exit(0)  # the runner's report never comes: the host looks for the file the code wrote
"""


@pytest.mark.slow
def test_expensive_episodes_do_not_starve_an_honest_episode(backend):
    """The starvation case through the `Env` API: eight episodes whose code writes an expensive file (and
    forges the runner's report), graded first, then an honest episode, all against one 2-worker pool and a
    grade deadline the expensive files would exhaust if served in arrival order."""
    from envs.cad.kernel.runner import REPORT_MARKER

    t = next(t for t in make_tasks("heldout", 0, 5) if t.private["family"] == "washer")
    p = t.private["params"]
    honest = FAMILIES["washer"].alternative(p).split("\n", 1)[1]
    heavy = FORGE_HEAVY.format(width=0.9 * p["OD"], height=1.5 * p["T"], marker=REPORT_MARKER)
    pool = CadWorkerPool(size=2)
    n = 8

    async def run():
        made = [envs.make("cad-v0", backend=backend, pool=pool) for _ in range(n + 1)]
        gate = asyncio.Semaphore(3)

        async def submit(env, code, i):
            async with gate:
                await env.reset(t)
                call = ToolCall(id=f"call_{i}", name="submit", arguments=json.dumps({"code": code}))
                return (await env.step(Message(role="assistant", content="", tool_calls=(call,)))).messages[-1].content

        try:
            outs = await asyncio.gather(*(submit(e, heavy if i < n else honest, i) for i, e in enumerate(made)))
            assert all(o.startswith("Submitted.") for o in outs), outs
            # Warm both workers and time one expensive grade on this machine now.
            _warm(pool, t.private["reference_code"], G.export_brep(build("import cadquery as cq\n" + honest)))
            t0 = time.monotonic()
            assert pool.grade(t.private["reference_code"], made[0].domain.sandbox.read_artifact(
                made[0].domain.submission.out_rel)).valid
            one = time.monotonic() - t0
            for e in made:
                e.domain.grade_timeout_s = max(6.0, 0.4 * n * one)
            first = [asyncio.ensure_future(e.grade()) for e in made[:n]]
            await asyncio.sleep(0.5)  # the expensive files are queued before the honest one asks
            g_honest = await made[n].grade()
            return one, g_honest, await asyncio.gather(*first)
        finally:
            for e in made:
                e.close()

    try:
        one, g, others = asyncio.run(run())
    finally:
        pool.close()
    print(f"one expensive grade {one:.2f} s; honest grade_s {g.metrics['grade_s']:.2f}; expensive: "
          + ", ".join(f"{'cost' if o.metrics.get('check/reject_cost') else 'graded'} {o.metrics['grade_s']:.1f}s"
                      for o in others))
    assert g.error is None and g.reward == 1.0, g
    assert g.metrics["grade_s"] < max(3.0, one)
    for o in others:  # each expensive file: its own grade or its own 0, never a grade error
        assert o.error is None and o.reward == 0.0, o
        assert o.metrics["check/valid"] == 1.0 or o.metrics.get("check/reject_cost") == 1.0, o.metrics
