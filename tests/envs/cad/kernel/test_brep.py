"""The static BREP scan (envs/cad/kernel/brep.py), in-process: every family's reference and alternative
and a set of agent-style constructions pass, fast; each way of making OpenCascade's reader or the
grader's booleans work without bound is refused in milliseconds, with a reason: forged header and
inner counts, instancing bombs, many solids, forward references, deep nesting, huge location powers,
long tokens, non-finite numbers, meshes, trailing data, wrong hierarchy."""
from __future__ import annotations

import random
import re
import time

import pytest

cq = pytest.importorskip("cadquery")

from envs.cad.families import FAMILIES  # noqa: E402
from envs.cad.kernel import brep  # noqa: E402
from envs.cad.kernel import geometry as G  # noqa: E402


def build(code: str):
    ns: dict = {}
    exec(code, ns)  # noqa: S102 - the families' own trusted code
    return G.to_shape(ns["result"])


def compound(shapes):
    from OCP.BRep import BRep_Builder
    from OCP.TopoDS import TopoDS_Compound

    b = BRep_Builder()
    c = TopoDS_Compound()
    b.MakeCompound(c)
    for s in shapes:
        b.Add(c, s.wrapped if hasattr(s, "wrapped") else s)
    return c


def export(shape) -> bytes:
    return G.export_brep(shape if hasattr(shape, "wrapped") else cq.Shape.cast(shape))


@pytest.fixture(scope="module")
def washer() -> bytes:
    fam = FAMILIES["washer"]
    return export(build(fam.reference(fam.params(fam.variants()[0]))))


@pytest.fixture(scope="module")
def spline_part() -> bytes:
    return export(cq.Workplane("XY").circle(2).sweep(cq.Workplane("XZ").spline([(0, 0), (5, 5), (10, 3)])).val())


def rejected(data: bytes, match: str) -> str:
    t0 = time.monotonic()
    with pytest.raises(brep.BrepRejected, match=match) as e:
        brep.scan(data)
    assert time.monotonic() - t0 < 2.0
    return str(e.value)


def test_every_family_and_agent_style_parts_pass_quickly():
    t_max = 0.0
    for name, fam in FAMILIES.items():
        for v in random.Random(name).sample(fam.variants(), 2):
            p = fam.params(v)
            for code in (fam.reference(p), fam.alternative(p)):
                data = export(build(code))
                t0 = time.perf_counter()
                st = brep.scan(data)
                t_max = max(t_max, time.perf_counter() - t0)
                assert st.solids == 1 and 4 <= st.faces <= 30, (name, st)
    assert t_max < 0.5  # ~1.5 ms idle; the bound only catches an order-of-magnitude regression
    extra = [
        cq.Workplane().box(20, 20, 10).edges("|Z").fillet(3).faces(">Z").workplane().hole(5),
        cq.Workplane().box(20, 20, 10).edges().chamfer(1),
        cq.Workplane().rect(10, 10).workplane(offset=10).circle(4).loft(),
        cq.Workplane("XZ").polyline([(0, 0), (10, 0), (8, 5), (0, 5)]).close().revolve(),
        cq.Workplane().box(20, 20, 20).cut(cq.Workplane().sphere(12)),
        cq.Workplane().circle(20).extrude(5).faces(">Z").workplane().polarArray(12, 0, 360, 8).hole(3),
        cq.Workplane().box(5, 5, 5).val().moved(cq.Location(cq.Vector(1, 2, 3), cq.Vector(0, 0, 1), 30)),
        [cq.Solid.makeBox(5, 5, 5), cq.Solid.makeBox(5, 5, 5, cq.Vector(10, 0, 0))],
    ]
    for r in extra:
        assert brep.scan(export(G.to_shape(r))).solids >= 1


def test_forged_header_counts_are_checked_against_the_file(washer):
    # The input: one header line edited to an absurd count made OCCT spin ~48 s.
    why = rejected(washer.replace(b"Curves 6\n", b"Curves 999999999\n"), "Curves = 999999999")
    assert "rest of the file" in why
    rejected(washer.replace(b"TShapes 22\n", b"TShapes 2000000\n"), "TShapes")
    rejected(washer.replace(b"Curve2ds 12\n", b"Curve2ds 13\n"), "curve type")  # one more: reads the next header
    rejected(washer.replace(b"Surfaces 4\n", b"Surfaces 3\n"), "Triangulations")  # one fewer: a record is left


def test_forged_inner_counts_and_degrees(spline_part):
    # A BSpline curve record: 7 rational periodic  degree nbpoles nbknots  poles...
    m = re.search(rb"\n7 ([01]) ([01])  (\d+) (\d+) (\d+)  ", spline_part)
    assert m, "the sweep should hold a BSpline curve"
    flags, (deg, poles, knots) = m.group(1) + b" " + m.group(2), m.group(3, 4, 5)
    rejected(spline_part.replace(m.group(0), b"\n7 %s  %s 99999999 %s  " % (flags, deg, knots), 1), "poles")
    rejected(spline_part.replace(m.group(0), b"\n7 %s  99 %s %s  " % (flags, poles, knots), 1), "degree")


def test_instancing_bomb_is_counted_as_what_it_expands_to():
    box = cq.Solid.makeBox(1, 1, 1)
    level = box.wrapped
    for k in range(6):  # 10 located copies of the previous level: 10**6 solids in a few KB
        level = compound([level.Moved(cq.Location(cq.Vector(0.01 * i, 0, 0)).wrapped) for i in range(10)])
    data = export(level)
    assert len(data) < 20_000
    rejected(data, r"1000000 solids")


def test_many_solids_and_faces_are_capped():
    boxes = [cq.Solid.makeBox(10, 10, 10, cq.Vector(0.01 * i, 0, 0)) for i in range(40)]
    rejected(export(compound(boxes)), "40 solids")
    rejected(export(compound([cq.Workplane().polygon(40, 20 + i).extrude(5).val() for i in range(8)])),
             "several solids")
    rejected(export(cq.Workplane().polygon(700, 40).extrude(10).val()), "faces")
    rejected(export(cq.Workplane().polygon(500, 40).extrude(10).val()), "edge uses")


def test_size_cap_and_bytes(washer):
    rejected(washer + b" " * (5 << 20), "bytes")
    rejected(washer.replace(b"\n", b"\r\n"), "printable ASCII")
    rejected(washer.replace(b"Curves", b"Curv\xe9s"), "printable ASCII")
    rejected(b"", "header")
    rejected(washer[:200], "rest of the file")
    rejected(washer[:-8], "end of file")
    rejected(washer + b"+1 0\n", "after the root")


def test_references_must_name_earlier_shapes(washer):
    # The solid record is last ("+1" is the root); make its shell reference a shape not written yet.
    i = washer.rindex(b"So\n")
    forged = washer[:i] + washer[i:].replace(b"-2 0 *", b"-1 0 *", 1)
    rejected(forged, "does not name a shape written before it")
    rejected(washer.replace(b"\n+1 0", b"\n+99 0"), "root shape")
    # A shell that holds a vertex (shape 22, the first written) instead of a face.
    assert b"+16 0 -9 0 +6 0 -3 0 *" in washer
    rejected(washer.replace(b"+16 0 -9 0 +6 0 -3 0 *", b"+22 0 -9 0 +6 0 -3 0 *"), "a shell cannot contain a vertex")


def test_nesting_powers_tokens_and_numbers(washer):
    # A 3D curve wrapped in 1000 trimmed curves: OCCT's reader recurses once per wrapper.
    nested = b"8 0 1 " * 1000 + b"1 0 0 0 0 0 1 \n"
    head = b"Curves 6\n"
    rejected(washer.replace(head, head + nested, 1).replace(head, b"Curves 7\n", 1), "nested too deeply")
    # A composite location raised to the 10**9-th power (TopLoc_Location::Powered recurses that deep).
    locs = b"Locations 2\n1\n 1 0 0 1 \n 0 1 0 0 \n 0 0 1 0 \n2  1 1000000000 0\n"
    rejected(washer.replace(b"Locations 0\n", locs), "location power")
    # A keyword longer than OCCT's 255-byte buffer.
    rejected(washer.replace(b"TShapes", b"T" * 300), "token of 300")
    rejected(washer.replace(b"1e-07", b"nan", 1), "not a number")
    rejected(washer.replace(b"1e-07", b"-5", 1), "tolerance")
    rejected(washer.replace(b"1e-07", b"1e+999", 1), "not a number|out of range")
    rejected(washer.replace(b"0101101", b"0101101" + b"1" * 300, 1), "token")
    # A shear instead of a rigid motion.
    shear = b"Locations 1\n1\n 1 5 0 1 \n 0 1 0 0 \n 0 0 1 0 \n"
    rejected(washer.replace(b"Locations 0\n", shear), "rigid motion")


def test_meshes_and_triangulated_faces_are_refused(washer):
    rejected(washer.replace(b"Triangulations 0", b"Triangulations 1"), "Triangulations")
    rejected(washer.replace(b"Polygon3D 0", b"Polygon3D 5"), "Polygon3D")
    i = washer.index(b"Fa\n")
    j = washer.index(b"\n\n", i)
    rejected(washer[:j + 1] + b"2  1" + washer[j + 1:], "end of the line")
    rejected(washer[:j + 1] + b" " * 300 + washer[j + 1:], "256-byte")  # a blank line OCCT's getline fails on


def test_location_simulation_matches_the_reader_on_honest_composites():
    # Parts moved twice carry composite locations ("2  1 1 2 -1 0"); references into them must pass.
    wp = cq.Workplane().box(20, 20, 5).faces(">Z").workplane().pushPoints([(-5, -5), (5, 5)]).hole(2)
    part = wp.val().moved(cq.Location(cq.Vector(3, 0, 0))).moved(cq.Location(cq.Vector(0, 0, 1), cq.Vector(0, 0, 1), 45))
    data = export(part)
    st = brep.scan(data)
    assert st.solids == 1
    assert brep._loc_mul(((1, 1),), ((1, -1),)) == ()
    assert brep._loc_pow(((1, 1), (2, 1)), -1) == ((2, -1), (1, -1))
