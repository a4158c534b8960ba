"""cad-primitive-v0, the first rung of the CAD curriculum (envs/cad/primitive.py).

Pure Python: registration next to cad-v0 with one tool, deterministic splits whose held-out dimension
tuples and task ids never occur in train, prompts that state every dimension and never the code,
clear errors on bad arguments, each domain refusing the other's tasks. In process, on the kernel the
grader uses: every reference solid measures what its prompt's words say, another construction of the
same part compares as 1, and a constant answer solves no held-out task.

Through the `Env` API on the real bubblewrap sandbox and grading workers (one batch of episodes, two
at a time; each submit imports cadquery in its sandbox): the conformance checker; the reference
scores 1 on train and held-out tasks of every family; wrong, empty and zero-volume answers score
below 1 or 0; and the policy's attempts to cheat get nothing: a huge box around the target, several
overlapping solids, an inside-out solid slipped past the runner by replacing its checks, and code
that looks for the task data on the host and tries to write into the grader's modules.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import re
import sys
from pathlib import Path

import pytest

import envs
from envs.base import EnvSetupError, ToolInvocation
from envs.cad import primitive as P
from envs.cad.families import _g
from envs.play import ScriptedPolicy, run_episode
from envs.registry import generate_tasks, list_envs
from envs.splits import variant_key as envs_variant_key
from jointrl import paths

cq = pytest.importorskip("cadquery")

from envs.cad.kernel import geometry as G  # noqa: E402
from envs.check import check_env  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


# ----------------------------------------------------------------------------- tasks and splits
def test_registered_next_to_cad_v0_with_only_the_submit_tool(backend):
    specs = {s.env_id: s for s in list_envs()}
    assert "cad-v0" in specs and P.ENV_ID in specs
    assert "rung" in specs[P.ENV_ID].description
    env = envs.make(P.ENV_ID, backend=backend)
    full = envs.make("cad-v0", backend=backend)
    try:
        assert [s["function"]["name"] for s in env.tool_schemas] == ["submit"]
        assert sorted(s["function"]["name"] for s in full.tool_schemas) == ["render_view", "run_cad", "submit"]
        assert env.domain.rubric is full.domain.rubric
    finally:
        env.close()
        full.close()
    t = generate_tasks(P.ENV_ID, "train", 0, 1)[0]
    assert t.domain == "cad" and t.split == "train" and t.limits == P.LIMITS


def test_splits_are_deterministic_sized_and_heldout_disjoint_from_train():
    train = {s: P.make_tasks("train", s) for s in (0, 1)}
    held = {s: P.make_tasks("heldout", s) for s in (0, 1)}
    assert len(train[0]) == P.DEFAULT_N["train"] >= 300 and len(held[0]) == P.DEFAULT_N["heldout"] >= 240
    assert [t.to_row() for t in P.make_tasks("train", 0)] == [t.to_row() for t in train[0]]
    assert [t.private["variant"] for t in train[0]] != [t.private["variant"] for t in train[1]]
    train_ids = {t.id for ts in train.values() for t in ts}
    train_keys = {t.private["variant"] for ts in train.values() for t in ts}
    for ts in held.values():
        assert not {t.id for t in ts} & train_ids
        assert not {t.private["variant"] for t in ts} & train_keys
    # The split is by the dimension tuple alone, the same for every seed (envs/splits.py).
    for fam in P.PRIMITIVES.values():
        sp = P.split_variants(fam)
        assert not set(sp["heldout"]) & set(sp["train"]) and len(sp["heldout"]) + len(sp["train"]) == len(fam.grid)
        for split, tasks in (("heldout", held[0] + held[1]), ("train", train[0] + train[1])):
            keys = {envs_variant_key(fam.name, v) for v in sp[split]}
            assert all(t.private["variant"] in keys for t in tasks if t.private["family"] == fam.name)
    counts = {f: sum(t.private["family"] == f for t in held[0]) for f in P.PRIMITIVES}
    assert min(counts.values()) == P.DEFAULT_N["heldout"] // 3, counts
    # Enough distinct held-out parts that the evaluation is not a few repeated ones.
    assert len({(t.private["variant"], json.dumps(t.private["pose"])) for t in held[0]}) >= 140


def test_prompt_states_every_dimension_and_never_the_code():
    for t in P.make_tasks("heldout", 0) + P.make_tasks("train", 0, 30):
        user = t.prompt[1].content
        for k, v in t.private["params"].items():
            assert re.search(rf"(?<![\d.]){re.escape(_g(v))} mm", user), (k, v, user)
        seen = json.dumps([m.to_openai() for m in t.prompt]) + json.dumps(dict(t.public))
        assert "result" not in user and "Workplane" not in seen and t.private["reference_code"] not in seen
        axis = "XYZ"[P.Pose(t.private["pose"]["plane"], t.private["pose"]["on_floor"]).axis]
        if t.private["family"] == "cylinder":
            assert f"axis along {axis}" in user
        assert ("z = 0" in user) == t.private["pose"]["on_floor"]


def test_bad_arguments_get_clear_errors():
    with pytest.raises(ValueError, match="unknown split"):
        P.make_tasks("test")
    with pytest.raises(ValueError, match="n must be >= 0"):
        P.make_tasks("train", 0, -1)
    with pytest.raises(ValueError, match="does not have 3 values"):
        P.BOX.params((10, 20))


def test_each_domain_refuses_the_others_tasks(backend):
    """The family set CadDomain is built with decides which tasks it sets up (before any sandbox opens)."""
    rung_task = P.make_tasks("train", 0, 1)[0]
    full_task = dataclasses.replace(rung_task, private={**rung_task.private, "family": "washer"})  # a cad-v0 family
    for env_id, task in ((P.ENV_ID, full_task), ("cad-v0", rung_task)):
        env = envs.make(env_id, backend=backend)
        try:
            with pytest.raises(EnvSetupError, match="unknown CAD family"):
                asyncio.run(env.reset(task))
        finally:
            env.close()


# ----------------------------------------------------------------------------- in process, on the grader's kernel
def _shape(code: str):
    ns = {"cq": cq}
    exec(code, ns)  # noqa: S102 - the rung's own trusted code
    return G.to_shape(ns["result"])


NUM = r"(\d+(?:\.\d+)?)"


def read_prompt(text: str) -> tuple[list[float], bool, float, int, int]:
    """What a prompt asks for, read back from its words: (size along X, Y, Z), base on z = 0 (else
    centred at the origin), volume, through-holes, faces."""
    on_floor = "z = 0" in text
    if text.startswith("A cylinder"):
        h, r, axis = re.search(rf"height {NUM} mm and radius {NUM} mm, its axis along ([XYZ])", text).groups()
        h, r = float(h), float(r)
        size = [2 * r] * 3
        size["XYZ".index(axis)] = h
        return size, on_floor, math.pi * r * r * h, 0, 3
    dims = re.search(rf"box {NUM} mm along X, {NUM} mm along Y and {NUM} mm along Z", text).groups()
    x, y, z = (float(v) for v in dims)
    hole = re.search(rf"through-hole of diameter {NUM} mm along Z through its centre", text)
    d = float(hole.group(1)) if hole else 0.0
    return [x, y, z], on_floor, x * y * z - math.pi * (d / 2) ** 2 * z, int(bool(hole)), 6 + int(bool(hole))


def test_reference_builds_what_the_prompt_says_and_another_construction_compares_as_one():
    """Slow obvious reference: the kernel's measures of each reference solid equal what its prompt's
    words give (sizes, placement, volume, holes, faces) and the task's recorded summary; the same part
    built another way compares as 1, so the grade follows the solid, not the code."""
    tasks = P.make_tasks("train", 0, 24) + P.make_tasks("heldout", 0, 24)
    seen = set()
    for t in tasks:
        fam = P.PRIMITIVES[t.private["family"]]
        pose = P.Pose(**t.private["pose"])
        seen.add((fam.name, pose))
        ref = _shape(t.private["reference_code"])
        s = G.summarize(ref)
        size, on_floor, vol, holes, faces = read_prompt(t.prompt[1].content)
        lo, hi = s.bbox[:3], s.bbox[3:]
        assert s.valid and s.solids == 1 and (s.holes, s.faces) == (holes, faces), t.id
        assert [b - a for a, b in zip(lo, hi)] == pytest.approx(size, abs=1e-6), t.id
        centre = [(a + b) / 2 for a, b in zip(lo, hi)]
        assert centre[:2] == pytest.approx([0, 0], abs=1e-6)
        assert (lo[2] if on_floor else centre[2]) == pytest.approx(0, abs=1e-6), t.id
        assert s.volume == pytest.approx(vol, rel=1e-9)
        want = t.private["reference"]
        assert (s.volume, s.bbox, s.faces, s.holes) == (pytest.approx(want["volume"], rel=1e-9),
                                                          pytest.approx(tuple(want["bbox"]), abs=1e-6), want["faces"], want["holes"])
        c = G.compare(_shape(fam.alternative(t.private["params"], pose)), ref)
        assert c.score == 1.0, (t.id, c)
    assert seen == {(f.name, pose) for f in P.PRIMITIVES.values() for pose in f.poses}


def test_a_constant_answer_solves_no_heldout_task():
    """The trivial policy that always submits one train task's part: success 0 on the held-out set
    (the grader's compare, in process; the env adds only the sandboxed run of the same code)."""
    refs = [_shape(t.private["reference_code"]) for t in P.make_tasks("heldout", 0, 30)]
    for const in P.make_tasks("train", 0, 3):
        answer = _shape(const.private["reference_code"])
        scores = [G.compare(answer, ref).score for ref in refs]
        assert sum(s == 1.0 for s in scores) == 0
        assert sum(scores) / len(scores) < 0.3, (const.id, sum(scores) / len(scores))


# ----------------------------------------------------------------------------- through the Env API, real sandbox
def test_check_env_passes(backend):
    report = check_env(P.ENV_ID, n_tasks=1, n_generate=16, env_kwargs={"backend": backend})
    assert report.passed, report.render()


CAD_MOD = Path(sys.prefix).resolve() / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
    "site-packages" / "cadquery" / "__init__.py"
JSON_MOD = Path(json.__file__).resolve()  # the base interpreter's stdlib, mounted at its own path
GRADER_FILES = (REPO / "envs" / "cad" / "kernel" / "geometry.py", CAD_MOD, JSON_MOD)


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def snoop_code(host_tmp: Path) -> str:
    """Look for the task's data where the host keeps it, try to write into what the grader imports
    (the kernel and venv as mounted in the sandbox, the host's stdlib at its own path) and into a host
    directory; build the part only from leaked data, so without a leak there is no `result`."""
    inside_cad = f"/opt/jointrl-cad/venv/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages/cadquery/__init__.py"
    reads = [str(REPO / "envs" / "cad" / "primitive.py"), str(paths.cache_root() / "envs"), str(REPO / ".git" / "HEAD")]
    writes = ["/opt/jointrl-cad/kernel/geometry.py", inside_cad, str(JSON_MOD), str(host_tmp / "pwned.py")]
    return ("import json, os\n"
            f"found, wrote = {{}}, []\n"
            f"for p in {reads!r}:\n"
            "    try:\n"
            "        found[p] = os.listdir(p)[:3] if os.path.isdir(p) else open(p).read(200)\n"
            "    except OSError:\n"
            "        pass\n"
            f"for p in {writes!r}:\n"
            "    try:\n"
            "        with open(p, 'a') as f:\n"
            "            f.write('\\nraise SystemExit(0)\\n')\n"
            "        wrote.append(p)\n"
            "    except OSError:\n"
            "        pass\n"
            "print('SNOOP ' + json.dumps({'found': sorted(found), 'wrote': wrote}))\n"
            "if found:\n"
            "    result = cq.Workplane('XY').box(1, 1, 1)\n")


def patched_runner_code(task) -> str:
    """The part itself, turned inside out, with the runner's own checks replaced so it exports the
    solid and reports success: only the grader, in its own process, stands between it and a score."""
    fam = P.PRIMITIVES[task.private["family"]]
    return (fam.alternative(task.private["params"], P.Pose(**task.private["pose"])) + "\n"
            "import dataclasses, geometry, brep  # the runner's modules, already imported by it\n"
            "result = cq.Solid(result.wrapped.Reversed())\n"
            "_summarize = geometry.summarize\n"
            "geometry.check_solid = lambda solid, index=0: 1.0\n"
            "geometry.to_shape = lambda r: r\n"
            "geometry.summarize = lambda s: dataclasses.replace(_summarize(s), valid=True, volume=abs(_summarize(s).volume))\n"
            "brep.scan = lambda data, *a, **k: None\n")


def _other_axis(task) -> str:
    p = task.private["params"]
    plane = {"XY": "YZ", "YZ": "XZ", "XZ": "XY"}[task.private["pose"]["plane"]]
    return f"result = cq.Workplane('{plane}').cylinder({_g(p['H'])}, {_g(p['R'])})"


@pytest.fixture(scope="module")
def batch(backend, tmp_path_factory):
    """Every episode of the sandbox tests, run two at a time; {name: Transcript}, plus the host's state."""
    train, held = P.make_tasks("train", 0, 3), P.make_tasks("heldout", 0, 3)
    box, cyl, hole = held  # task i is family i mod 3
    assert [t.private["family"] for t in held] == ["box", "cylinder", "box_hole"]
    host_tmp = tmp_path_factory.mktemp("host")
    p = hole.private["params"]
    pose = P.Pose(**hole.private["pose"])
    wrong_hole = dict(p, D=p["D"] + 2)
    bp = box.private["params"]
    part = P.BOX.alternative(bp, P.Pose(**box.private["pose"]))
    jobs = {
        **{f"reference {t.id}": (t, t.private["reference_code"]) for t in train[2:] + held},
        "wrong hole diameter": (hole, P.BOX_HOLE.reference(wrong_hole, pose)),
        "wrong axis": (cyl, _other_axis(cyl)),
        "empty": (box, ""),
        "zero height": (box, f"result = cq.Workplane('XY').box({_g(bp['L'])}, {_g(bp['W'])}, 0)"),
        "huge box": (box, "result = cq.Workplane('XY').box(1000, 1000, 1000)"),
        "several solids": (box, part + "\nresult = [result, result.translate(cq.Vector(2, 0, 0)),"
                                       " cq.Solid.makeBox(5, 5, 5, cq.Vector(200, 0, 0))]\n"),
        "inside out, patched runner": (box, patched_runner_code(box)),
        "snoop and write outside": (box, snoop_code(host_tmp)),
    }
    before = {f: _digest(f) for f in GRADER_FILES}
    gate = asyncio.Semaphore(2)

    async def one(task, code):
        async with gate:
            env = envs.make(P.ENV_ID, backend=backend)
            try:
                return await run_episode(env, task, ScriptedPolicy([ToolInvocation("submit", {"code": code})]), max_steps=3)
            finally:
                env.close()

    async def run_all():
        return await asyncio.gather(*(one(t, c) for t, c in jobs.values()))

    out = dict(zip(jobs, asyncio.run(run_all())))
    for name, tr in out.items():
        assert tr.grade.error is None, (name, tr.grade.error)
        assert tr.terminated and tr.turns == 1, (name, tr.render())
    return {"tr": out, "before": before, "host_tmp": host_tmp}


def _m(tr, key: str) -> float:
    return tr.grade.metrics[f"check/{key}"]


def test_reference_scores_one_on_train_and_heldout_tasks(batch):
    refs = {k: tr for k, tr in batch["tr"].items() if k.startswith("reference ")}
    assert {tr.task.split for tr in refs.values()} == {"train", "heldout"}
    assert {tr.task.private["family"] for tr in refs.values() if tr.task.split == "heldout"} == set(P.PRIMITIVES)
    for name, tr in refs.items():
        assert tr.grade.reward == 1.0 and _m(tr, "iou") == 1.0, (name, tr.render())


def test_wrong_answers_score_below_one(batch):
    tr = batch["tr"]["wrong hole diameter"]  # a hole 2 mm wider is another hole: only the box is right
    assert 0.9 < _m(tr, "iou") < 1.0 and (_m(tr, "holes_ok"), _m(tr, "faces_ok"), _m(tr, "bbox_ok")) == (0, 0, 1), \
        tr.render()
    assert tr.grade.reward == pytest.approx(_m(tr, "iou") / 3), tr.render()
    tr = batch["tr"]["wrong axis"]
    assert tr.grade.reward < 1.0 and _m(tr, "iou") < 0.99, tr.render()


def test_empty_and_zero_volume_answers_score_zero(batch):
    for name in ("empty", "zero height"):
        tr = batch["tr"][name]
        assert tr.grade.reward == 0.0 and _m(tr, "valid") == 0.0 and _m(tr, "code_failed") == 1.0, (name, tr.render())


def test_adversarial_huge_box_around_the_target_scores_nothing(batch):
    tr = batch["tr"]["huge box"]
    assert _m(tr, "valid") == 1.0 and _m(tr, "iou") < 1e-3 and _m(tr, "bbox_ok") == 0.0, tr.render()
    assert tr.grade.reward < 1e-3


def test_adversarial_several_overlapping_solids_are_fused_and_scored_as_one(batch):
    tr = batch["tr"]["several solids"]
    assert "solids: 2" in tr.messages[-1].content, tr.render()  # the copies fused, the far cube apart
    assert _m(tr, "valid") == 1.0 and _m(tr, "iou") < 0.99 and _m(tr, "bbox_ok") == 0.0, tr.render()
    assert tr.grade.reward < 0.7


def test_adversarial_inside_out_solid_past_a_patched_runner_is_refused_by_the_grader(batch):
    tr = batch["tr"]["inside out, patched runner"]
    assert tr.messages[-1].content.startswith("Submitted.\nOK"), tr.render()  # the runner was fooled
    assert tr.grade.reward == 0.0 and _m(tr, "valid") == 0.0 and _m(tr, "reject_solid") == 1.0, tr.render()


def test_adversarial_snooping_and_writing_outside_the_sandbox_get_nothing(batch):
    tr = batch["tr"]["snoop and write outside"]
    out = tr.messages[-1].content
    line = next(ln for ln in out.splitlines() if ln.startswith("SNOOP "))
    assert json.loads(line[len("SNOOP "):]) == {"found": [], "wrote": []}, out
    assert tr.grade.reward == 0.0 and _m(tr, "code_failed") == 1.0
    assert {f: _digest(f) for f in GRADER_FILES} == batch["before"]
    assert list(batch["host_tmp"].iterdir()) == []
