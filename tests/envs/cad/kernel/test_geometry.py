"""cad-v0 geometry and families, in-process (no sandbox): every family's reference and alternative
constructions give the same solid (score 1), with the volume and bounding box written from the
family's formula, and the through-hole count it declares; the Euler-Poincare genus on hand-made
solids; IoU against the box-overlap formula; and wrong parts (shifted, mis-scaled, hole-less, too
thick) scoring clearly lower, with the numbers."""
from __future__ import annotations

import math
import random

import pytest

cq = pytest.importorskip("cadquery")

from envs.cad.families import FAMILIES  # noqa: E402
from envs.cad.kernel import geometry as G  # noqa: E402
from envs.cad.tasks import split_variants  # noqa: E402


def build(code: str):
    ns: dict = {}
    exec(code, ns)  # noqa: S102 - the families' own trusted code
    return G.to_shape(ns["result"])


# --- slow, obvious references written from each family's description -------------------------------
def expected_volume(name: str, p: dict) -> float:
    pi = math.pi
    if name == "plate_holes":
        return p["L"] * p["W"] * p["T"] - 4 * pi * (p["d"] / 2) ** 2 * p["T"]
    if name == "l_bracket":
        return (p["L"] * p["T"] + (p["H"] - p["T"]) * p["T"]) * p["W"] - 2 * pi * (p["d"] / 2) ** 2 * p["T"]
    if name == "flange":
        return (pi * (p["D"] / 2) ** 2 * p["T"] + pi * (p["Dh"] / 2) ** 2 * p["Hh"]
                - pi * (p["d"] / 2) ** 2 * (p["T"] + p["Hh"]) - p["n"] * pi * (p["h"] / 2) ** 2 * p["T"])
    if name == "stepped_shaft":
        return sum(pi * (p[f"d{i}"] / 2) ** 2 * p[f"l{i}"] for i in (1, 2, 3))
    if name == "washer":
        return pi * ((p["OD"] / 2) ** 2 - (p["ID"] / 2) ** 2) * p["T"]
    if name == "pocketed_box":
        return p["L"] * p["W"] * p["H"] - (p["L"] - 2 * p["wall"]) * (p["W"] - 2 * p["wall"]) * p["depth"]
    if name == "slot_plate":
        return (p["L"] * p["W"] - (p["s"] * p["w"] + pi * (p["w"] / 2) ** 2)) * p["T"]
    if name == "hex_nut":
        return (math.sqrt(3) / 2 * p["F"] ** 2 - pi * (p["d"] / 2) ** 2) * p["T"]
    if name == "u_channel":
        return (p["W"] * p["H"] - (p["W"] - 2 * p["t"]) * (p["H"] - p["tb"])) * p["L"]
    raise KeyError(name)


def expected_bbox(name: str, p: dict) -> tuple[float, ...]:
    if name in ("plate_holes", "slot_plate"):
        return (-p["L"] / 2, -p["W"] / 2, 0, p["L"] / 2, p["W"] / 2, p["T"])
    if name == "l_bracket":
        return (0, -p["W"] / 2, 0, p["L"], p["W"] / 2, p["H"])
    if name == "flange":
        return (-p["D"] / 2, -p["D"] / 2, 0, p["D"] / 2, p["D"] / 2, p["T"] + p["Hh"])
    if name == "stepped_shaft":
        r = p["d1"] / 2
        return (-r, -r, 0, r, r, p["l1"] + p["l2"] + p["l3"])
    if name == "washer":
        return (-p["OD"] / 2, -p["OD"] / 2, 0, p["OD"] / 2, p["OD"] / 2, p["T"])
    if name == "pocketed_box":
        return (-p["L"] / 2, -p["W"] / 2, 0, p["L"] / 2, p["W"] / 2, p["H"])
    if name == "hex_nut":
        R = p["F"] / math.sqrt(3)  # corners on the X axis
        return (-R, -p["F"] / 2, 0, R, p["F"] / 2, p["T"])
    if name == "u_channel":
        return (-p["L"] / 2, -p["W"] / 2, 0, p["L"] / 2, p["W"] / 2, p["H"])
    raise KeyError(name)


def sample_params(name: str, k: int = 2, seed: int = 0) -> list[dict]:
    fam = FAMILIES[name]
    rng = random.Random(f"{name}:{seed}")
    return [fam.params(v) for v in rng.sample(fam.variants(), k)]


def test_at_least_eight_families_with_enough_variants():
    assert len(FAMILIES) >= 8
    for fam in FAMILIES.values():
        sp = split_variants(fam)
        assert len(sp["train"]) >= 40 and len(sp["heldout"]) >= 10, fam.name
        assert not set(sp["train"]) & set(sp["heldout"]), fam.name


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_reference_matches_formula_and_alternative_scores_one(name):
    fam = FAMILIES[name]
    for p in sample_params(name):
        ref, alt = build(fam.reference(p)), build(fam.alternative(p))
        rs = G.summarize(ref)
        assert rs.valid and rs.solids == 1
        assert rs.volume == pytest.approx(expected_volume(name, p), rel=1e-9)
        assert rs.bbox == pytest.approx(expected_bbox(name, p), abs=1e-7)
        assert rs.holes == fam.holes(p)
        c = G.compare(alt, ref, rs)
        assert c.iou == pytest.approx(1.0, abs=1e-9)
        assert (c.holes_ok, c.faces_ok, c.bbox_ok) == (1.0, 1.0, 1.0), c
        assert c.score == 1.0


def test_genus_of_hand_made_solids():
    box = cq.Workplane().box(30, 30, 30)
    hole_x = cq.Workplane("YZ").circle(4).extrude(20, both=True)
    hole_y = cq.Workplane("XZ").circle(4).extrude(20, both=True)
    hole_z = cq.Workplane("XY").circle(4).extrude(20, both=True)
    cases = {
        "cube": (box, 0),
        "one hole": (box.cut(hole_z), 1),
        "two crossing holes (4 openings)": (box.cut(hole_x).cut(hole_y), 3),
        "three crossing holes (6 openings)": (box.cut(hole_x).cut(hole_y).cut(hole_z), 5),
        "blind pocket": (box.faces(">Z").workplane().rect(10, 10).cutBlind(-5), 0),
        "two separate holes": (box.faces(">Z").workplane().pushPoints([(-7, 0), (7, 0)]).hole(4), 2),
    }
    for what, (wp, genus) in cases.items():
        assert G.through_holes(G.to_shape(wp)) == genus, what
    # An enclosed void: two shells, still no handle (S enters the formula).
    void = cq.Solid.makeBox(30, 30, 30).cut(cq.Solid.makeBox(10, 10, 10, cq.Vector(10, 10, 10)))
    v, e, f, loops, s = G.euler_counts(void)
    assert s == 2 and G.through_holes(void) == 0


def box_iou_reference(a: tuple, b: tuple) -> float:
    """Two axis-aligned boxes (x0, y0, z0, x1, y1, z1): overlap product over the three axes."""
    inter = 1.0
    for k in range(3):
        inter *= max(0.0, min(a[k + 3], b[k + 3]) - max(a[k], b[k]))
    va = math.prod(a[k + 3] - a[k] for k in range(3))
    vb = math.prod(b[k + 3] - b[k] for k in range(3))
    return inter / (va + vb - inter)


def test_iou_matches_box_overlap_formula():
    rng = random.Random(3)
    for _ in range(6):
        a = [rng.uniform(-10, 0) for _ in range(3)]
        a += [a[k] + rng.uniform(5, 20) for k in range(3)]
        b = [rng.uniform(-10, 5) for _ in range(3)]
        b += [b[k] + rng.uniform(5, 20) for k in range(3)]
        sa = cq.Solid.makeBox(a[3] - a[0], a[4] - a[1], a[5] - a[2], cq.Vector(*a[:3]))
        sb = cq.Solid.makeBox(b[3] - b[0], b[4] - b[1], b[5] - b[2], cq.Vector(*b[:3]))
        value, va, vb, vi = G.iou(sa, sb)
        assert value == pytest.approx(box_iou_reference(tuple(a), tuple(b)), rel=1e-9, abs=1e-12)
    # A cylinder inside a box: IoU = V(cyl) / V(box).
    cyl = cq.Solid.makeCylinder(3, 10)
    outer = cq.Solid.makeBox(10, 10, 10, cq.Vector(-5, -5, 0))
    assert G.iou(cyl, outer)[0] == pytest.approx(math.pi * 9 * 10 / 1000, rel=1e-9)


def test_wrong_parts_score_clearly_lower():
    """The FACTS.md plate (80 x 50 x 6, four 8 mm holes): IoU alone barely punishes missing holes."""
    p = {"L": 80, "W": 50, "T": 6, "d": 8, "e": 8}
    fam = FAMILIES["plate_holes"]
    ref = build(fam.reference(p))
    rs = G.summarize(ref)
    variants = {
        "reference": build(fam.reference(p)),
        "shifted 5 mm in X": build(fam.reference(p)).translate(cq.Vector(5, 0, 0)),
        "scaled 2x": build(fam.reference(p)).scale(2.0),
        "no holes": build("import cadquery as cq\nresult = cq.Workplane().box(80, 50, 6, centered=(True, True, False))"),
        "8 mm thick": build(fam.reference({**p, "T": 8})),
        "10 mm holes": build(fam.reference({**p, "d": 10})),
    }
    got = {k: G.compare(v, ref, rs) for k, v in variants.items()}
    scores = {k: c.score for k, c in got.items()}
    assert scores["reference"] == 1.0
    # IoU alone stays high for the hole-less plate (FACTS: 0.95); the feature term pulls it down.
    assert got["no holes"].iou > 0.9 and scores["no holes"] < 0.35
    assert got["no holes"].holes_ok == 0 and got["no holes"].faces_ok == 0 and got["no holes"].bbox_ok == 1
    assert scores["shifted 5 mm in X"] < 0.6 and got["shifted 5 mm in X"].bbox_ok == 0
    assert scores["scaled 2x"] < 0.1
    assert scores["8 mm thick"] < 0.55
    # Wrong hole size keeps every count and the box: only IoU (0.97 in FACTS) marks it.
    assert 0.9 < scores["10 mm holes"] < 1.0
    assert max(v for k, v in scores.items() if k != "reference") < 0.99


def test_to_shape_refuses_results_without_solids():
    with pytest.raises(G.NoSolidError, match="no solid"):
        G.to_shape(cq.Workplane().rect(10, 10).val())
    with pytest.raises(G.NoSolidError, match=r"found: Wire\)"):
        G.to_shape(cq.Workplane().rect(10, 10))
    with pytest.raises(G.NoSolidError, match="found: nothing"):
        G.to_shape(cq.Workplane())
    with pytest.raises(G.NoSolidError):
        G.load_brep(b"this is not a BREP file")


def test_overlapping_solids_are_fused_not_double_counted():
    a = cq.Solid.makeBox(10, 10, 10)
    b = cq.Solid.makeBox(10, 10, 10, cq.Vector(5, 0, 0))
    s = G.to_shape([a, b])
    assert s.Volume() == pytest.approx(1500.0, rel=1e-9)
    assert G.summarize(s).faces == 6  # the fused block is one box after same-domain merging
