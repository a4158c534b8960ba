"""Geometry of solids for cad-v0: solid checks, summaries, through-hole count, exact volume IoU, feature checks.

Used both inside the agent's sandbox (by `runner.py`, to describe the agent's own solid) and by the
trusted grading workers (to compare the agent's solid with the reference). It depends only on
numpy and cadquery/OCP so that it runs from a read-only mount without the rest of the repo.

Definitions (the same on both sides, so what `run_cad` reports is what the grader measures):

* **through-holes** = the genus of the solid's boundary, from the Euler-Poincare formula for
  B-reps (Mantyla, "An Introduction to Solid Modeling", 1988, ch. 3):
      V - E + F - (L - F) = 2 (S - G)   =>   G = S - (V - E + 2F - L) / 2
  with V, E, F the distinct vertices, edges and faces, L the face loops (wires) and S the shells,
  summed over solids. It counts handles (a plate with 4 drilled holes has G = 4, a slot is 1, a
  blind pocket is 0) and does not depend on how the part was built (an OCC seam edge or a circle
  split into two arcs adds as many vertices as edges).
* **faces** = faces after merging faces that lie on the same surface (OCC's
  `ShapeUpgrade_UnifySameDomain`, what cadquery's `clean()` runs), so two constructions of one
  part give the same faces.
* **features** (what the grader's feature checks read, `features` / `compare`): the genus and the faces
  of each solid's *outer* shell only. A closed cavity (an inner shell) cannot be seen or reached from
  outside the part, so it is no feature: it costs the IoU its volume and nothing else. Features are
  matched where they lie, not counted: every face has a signature (surface type, area, centroid,
  normal or axis, radii, and for a curved surface of revolution whether the material is outside it,
  as around a hole: `FaceSig`), and two faces match when those agree within the bounding-box
  tolerance. `faces_ok` needs as many solids as the reference and a one-to-one matching of all faces;
  `holes_ok` needs as many solids, the same genus and a one-to-one matching of the concave curved
  faces (the walls of round holes and slot ends). So a handle made elsewhere (a tiny ring attached to
  the part, a torus-shaped cavity) or a wall of the wrong radius or length never stands in for a hole,
  and a detached body never adds a feature. Families whose holes had no curved wall would have them
  checked by the genus and the full face matching only.
* **bounding box** = the tight box (`BRepBndLib.AddOptimal`), in absolute coordinates.
* **IoU** = V(A & B) / (V(A & B) + V(A - B) + V(B - A)), with V(A & B) and V(A - B) from one
  exact B-rep general fuse (`BOPAlgo_PaveFiller`, then `BRepAlgoAPI_Common` / `BRepAlgoAPI_Cut`
  on it), V(B - A) = V(B) - V(A & B) from the trusted reference's volume, and volumes from
  `BRepGProp` (no voxels, no scale normalisation). It equals the textbook
  V(A & B) / (V(A) + V(B) - V(A & B)) when the agent's solid is consistent, and by construction
  it lies in [0, 1].

What the grader trusts about the agent's solid, and why (the solid is agent-made data; see
docs/cad.md): nothing it states about itself. A B-rep carries its own orientation, so BRepGProp's
volume is a signed surface integral: an inside-out solid has negative volume, and the boolean
kernel treats it as the complement of its interior. `to_shape` therefore checks every solid on its
own before anything is fused (B-rep valid, finite box, kernel tolerances <= MAX_TOLERANCE_MM,
volume > 0) and checks the fuse against the union bounds max V_i <= V(fused) <= sum V_i;
`compare` checks the measure identity V(A) = V(A & B) + V(A - B) between the agent's own
integral and the boolean kernel's cells (they agree to ~1e-15 relative on analytic parts and
~1e-5 on BSpline-bounded ones, where BRepGProp integrates numerically; a boundary that is
inside-out, self-overlapping or open in places makes them disagree by the volume it misstates),
and V(A & B) <= min(V(A), V(B)). Any failure is `NoSolidError`: an invalid submission, score 0.

What it does not do: run agent code (runner.py), parse-check BREP text (brep.py, run before
`load_brep` hands the file to OCCT), manage processes (worker.py) or draw (render.py).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

if __package__:
    from . import brep
else:  # inside the sandbox this directory is on sys.path by itself (runner.py)
    import brep

# IoU values within this distance of 1 count as 1: volumes of the same solid built two ways
# differ by kernel round-off (~1e-12 relative), never by a real modelling difference. Values above
# 1 + IOU_SNAP cannot come from two consistent solids: they make the submission invalid.
IOU_SNAP = 1e-6
# The agent's own volume integral and the boolean kernel's cells must agree to this, relative to the
# larger volume. Measured: <= 3e-15 over every family's reference, alternative and wrong parts; up to
# 6e-6 on a thickened BSpline surface (Gauss integration of BSpline faces). A misstatement hidden below
# it moves the IoU by at most about this much, so it buys an attacker nothing that matters.
VOLUME_CONSISTENCY = 1e-3
# Kernel tolerances (vertex / edge / face) above this make booleans fuzzy at the scale of the
# features graded (honest parts here: <= 1.5e-7 mm; fillets and sweeps stay well under 1e-3 mm).
MAX_TOLERANCE_MM = 0.01
# Every solid must lie within this cube (mm): the parts are < 300 mm; far-away or astronomically large
# coordinates only serve to overflow volumes or slow the kernel down.
MAX_COORD_MM = 10_000.0
# Bounding-box check: every coordinate of the agent's box within this of the reference's.
BBOX_ABS_TOL_MM = 0.05
BBOX_REL_TOL = 0.002  # x the reference box diagonal
# Face matching (`match_faces`): positions, radii and axis offsets within the bounding-box tolerance above;
# an area within that tolerance times the reference face's perimeter (a boundary moved by `tol` changes the
# area by about that); directions within this angle (rad).
ANGLE_TOL = 2e-3


class NoSolidError(ValueError):
    """The agent's result holds no usable solid (the message is shown to the agent).

    `code` names the class of failure for the grader's metrics: "brep" (the file failed the static
    scan), "no_solid", "solid" (a solid failed its own checks), "inconsistent" (volumes that
    contradict each other), "kernel" (OCCT raised on the agent's shape).
    """

    def __init__(self, message: str, code: str = "no_solid") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Summary:
    """What `run_cad` reports about the agent's own solid (never anything about the target)."""

    valid: bool
    solids: int
    volume: float
    bbox: tuple[float, float, float, float, float, float]  # xmin, ymin, zmin, xmax, ymax, zmax
    faces: int
    holes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FaceSig:
    """Where one face of a part's outer boundary lies and how big it is, for matching faces between two parts.

    `kind`: the surface type ("plane", "cylinder", "cone", "sphere", "torus", or "other" for BSpline and other
    free-form surfaces). `axis`: a plane's outward unit normal; the unit axis of a cylinder, cone or torus (its
    sign is arbitrary); zeros otherwise. `origin`: a point on that axis (a sphere's or torus's centre, a
    cone's apex); zeros for planes and free-form faces. `radius`: cylinder, sphere, torus (major); `radius2`:
    torus (minor), cone (|semi-angle|, rad). `concave`: a curved surface of revolution whose outward normal points
    toward its axis (or centre): the material is outside it, as around a drilled hole's wall.
    """

    kind: str
    area: float
    centroid: tuple[float, float, float]
    axis: tuple[float, float, float]
    origin: tuple[float, float, float]
    radius: float
    radius2: float
    concave: bool


@dataclass(frozen=True)
class Features:
    """The features the grader compares, read from a part's outside only (module docstring, "features").

    `solids`: separate solids; `voids`: closed inner shells (cavities), which are left out of everything else
    here; `holes`: the genus of the outer shells; `faces`: their faces after same-surface merging; `perimeters`:
    each face's boundary length (mm, used for the area tolerance; computed for references only, else empty).
    """

    solids: int
    voids: int
    holes: int
    faces: tuple[FaceSig, ...]
    perimeters: tuple[float, ...] = ()

    @property
    def hole_walls(self) -> tuple[int, ...]:
        """Indices of the concave curved faces: the walls of round holes and slot ends."""
        return tuple(i for i, f in enumerate(self.faces) if f.concave)


@dataclass(frozen=True)
class Comparison:
    """The grader's comparison of an agent solid with the reference (all checks 0/1 floats)."""

    iou: float
    v_agent: float
    v_ref: float
    v_common: float
    holes_ok: float
    faces_ok: float
    bbox_ok: float
    agent_holes: int
    ref_holes: int
    agent_faces: int
    ref_faces: int
    bbox_err_mm: float  # largest |coordinate difference| of the two boxes
    v_agent_only: float  # V(A - B)
    v_ref_only: float  # V(B - A)
    agent_solids: int = 1  # separate solids after the fuse (the references have one)
    agent_voids: int = 0  # closed cavities (inner shells), left out of the feature checks

    @property
    def feature_term(self) -> float:
        return (self.holes_ok + self.faces_ok + self.bbox_ok) / 3.0

    @property
    def score(self) -> float:
        # Snap only kernel round-off just below 1; anything outside [0, 1 + IOU_SNAP] (or NaN) is not
        # an IoU of two solids and scores nothing (compare() refuses it before it gets here).
        if not 0.0 <= self.iou <= 1.0 + IOU_SNAP:
            return 0.0
        iou = 1.0 if self.iou >= 1.0 - IOU_SNAP else self.iou
        return iou * self.feature_term

    def check(self) -> None:
        """Raise ValueError unless the numbers are those of two consistent solids (used on a worker's reply)."""
        vols = (self.v_agent, self.v_ref, self.v_common, self.v_agent_only, self.v_ref_only)
        if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in vols + (self.iou, self.bbox_err_mm)):
            raise ValueError("non-finite number in a comparison")
        if self.v_agent <= 0 or self.v_ref <= 0:
            raise ValueError("a solid without positive volume in a comparison")
        tol = VOLUME_CONSISTENCY * max(self.v_agent, self.v_ref)
        if min(self.v_common, self.v_agent_only, self.v_ref_only) < -tol:
            raise ValueError("a negative boolean cell in a comparison")
        if (abs(self.v_common + self.v_agent_only - self.v_agent) > tol
                or abs(self.v_common + self.v_ref_only - self.v_ref) > tol):
            raise ValueError("boolean cells that do not add up to the volumes")
        union = self.v_common + self.v_agent_only + self.v_ref_only
        if not 0.0 <= self.iou <= 1.0 + IOU_SNAP or abs(self.iou - self.v_common / union) > 1e-9:
            raise ValueError(f"IoU {self.iou!r} does not follow from the volumes")
        if any(x not in (0.0, 1.0) for x in (self.holes_ok, self.faces_ok, self.bbox_ok)):
            raise ValueError("a feature check that is not 0 or 1")


# ----------------------------------------------------------------------------- shapes from results
def to_shape(result: Any):
    """The agent's `result` (a Workplane, a Shape, or a list of them) -> one cadquery Shape of its solids.

    Every solid is checked on its own first (`check_solid`), then overlapping solids are fused so the
    volume is not counted twice, and the fuse is checked against the bounds a union's volume obeys.
    Raises NoSolidError with a message the agent can act on.
    """
    solids = _solids(result)
    vols = [check_solid(s, i) for i, s in enumerate(solids)]
    if len(solids) == 1:
        return solids[0]
    fused = solids[0].fuse(*solids[1:]).clean()
    v = volume(fused)
    tol = VOLUME_CONSISTENCY * sum(vols)
    if not fused.isValid() or not max(vols) - tol <= v <= sum(vols) + tol:
        raise NoSolidError(f"fusing the {len(solids)} solids of `result` gave an inconsistent solid (volume {v:.6g}; "
                           f"the solids have {max(vols):.6g} to {sum(vols):.6g} between them)", "inconsistent")
    return fused


def check_solid(solid, index: int = 0) -> float:
    """One solid's own checks (module docstring); returns its volume or raises NoSolidError."""
    from OCP.Bnd import Bnd_Box
    from OCP.BRepBndLib import BRepBndLib
    from OCP.BRepCheck import BRepCheck_Analyzer
    from OCP.ShapeAnalysis import ShapeAnalysis_ShapeTolerance

    which = f"solid {index + 1} of `result`"
    if not BRepCheck_Analyzer(solid.wrapped).IsValid():
        raise NoSolidError(f"{which} fails the B-rep validity check (open, self-inconsistent or badly built)", "solid")
    tol = ShapeAnalysis_ShapeTolerance().Tolerance(solid.wrapped, 1)  # 1: the largest tolerance in the shape
    if not tol <= MAX_TOLERANCE_MM:
        raise NoSolidError(f"{which} has a kernel tolerance of {tol:.3g} mm (at most {MAX_TOLERANCE_MM} accepted)", "solid")
    box = Bnd_Box()
    BRepBndLib.Add_s(solid.wrapped, box, False)
    if box.IsVoid() or not all(math.isfinite(x) and abs(x) <= MAX_COORD_MM for x in box.Get()):
        raise NoSolidError(f"{which} is not inside the {MAX_COORD_MM:g} mm working volume", "solid")
    v = volume(solid)
    if not math.isfinite(v) or v <= 0:
        raise NoSolidError(f"{which} has volume {v:.6g}: it is inside-out or not closed (a solid's faces must face "
                           "outward)", "solid")
    return v


def _solids(result: Any) -> list:
    import cadquery as cq

    items: list[Any]
    if isinstance(result, cq.Workplane):
        items = list(result.vals())
    elif isinstance(result, cq.Assembly):
        items = [result.toCompound()]
    elif isinstance(result, (list, tuple)):
        items = list(result)
    else:
        items = [result]
    solids = []
    kinds = []
    for it in items:
        if isinstance(it, cq.Workplane):
            it = it.val() if len(it.vals()) == 1 else cq.Compound.makeCompound([v for v in it.vals() if isinstance(v, cq.Shape)])
        if isinstance(it, cq.Shape):
            found = it.Solids()
            solids.extend(found)
            if not found:
                kinds.append(type(it).__name__)
        else:
            kinds.append(type(it).__name__)
    if not solids:
        got = ", ".join(sorted(set(kinds))) or "nothing"
        raise NoSolidError(f"`result` contains no solid (found: {got}); build a 3D solid, e.g. extrude a sketch")
    return solids


def load_brep(data: bytes, limits: brep.BrepLimits = brep.BrepLimits()):
    """BREP text (as written by `export_brep`) -> Shape. Raises NoSolidError if it is not one the grader reads.

    The text is scanned (brep.scan) before OCCT's reader sees it: the reader trusts every count and
    index in the file.
    """
    import io

    import cadquery as cq

    try:
        brep.scan(data, limits)
    except brep.BrepRejected as e:
        raise NoSolidError(str(e), "brep") from None
    try:
        return cq.Shape.importBrep(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - OCC raises assorted types on malformed input
        raise NoSolidError(f"not a readable BREP file: {type(e).__name__}: {e}", "brep") from None


def load_submission(data: bytes):
    """The agent's BREP file -> its checked, fused solid (`to_shape` of the file's solids). Raises NoSolidError."""
    shape = load_brep(data)
    solids = shape.Solids()
    if not solids:
        raise NoSolidError("the file holds no solid")
    return to_shape(solids)


def export_brep(shape) -> bytes:
    """BREP text in format V3 without meshes (the grader's scan accepts exactly this subset)."""
    import io

    from OCP.BRepTools import BRepTools
    from OCP.TopTools import TopTools_FormatVersion

    buf = io.BytesIO()
    BRepTools.Write_s(shape.wrapped, buf, False, False, TopTools_FormatVersion.TopTools_FormatVersion_VERSION_3)
    return buf.getvalue()


# ----------------------------------------------------------------------------- measurements
def _count(shape_wrapped, kind) -> int:
    from OCP.TopExp import TopExp
    from OCP.TopTools import TopTools_IndexedMapOfShape

    m = TopTools_IndexedMapOfShape()
    TopExp.MapShapes_s(shape_wrapped, kind, m)
    return m.Extent()


def euler_counts(shape) -> tuple[int, int, int, int, int]:
    """(V, E, F, L, S): distinct vertices, edges, faces; face loops; shells.

    E leaves out degenerated edges (the zero-length edge OCC puts at a sphere's pole or a cone's apex to close
    the face's parameter rectangle): it is no edge of the boundary, and counting it makes the sum odd."""
    from OCP.BRep import BRep_Tool
    from OCP.TopAbs import TopAbs_EDGE, TopAbs_FACE, TopAbs_SHELL, TopAbs_VERTEX, TopAbs_WIRE
    from OCP.TopExp import TopExp, TopExp_Explorer
    from OCP.TopoDS import TopoDS
    from OCP.TopTools import TopTools_IndexedMapOfShape

    w = shape.wrapped
    edges = TopTools_IndexedMapOfShape()
    TopExp.MapShapes_s(w, TopAbs_EDGE, edges)
    n_edges = sum(not BRep_Tool.Degenerated_s(TopoDS.Edge_s(edges.FindKey(i))) for i in range(1, edges.Extent() + 1))
    faces = TopTools_IndexedMapOfShape()
    TopExp.MapShapes_s(w, TopAbs_FACE, faces)
    loops = 0
    for i in range(1, faces.Extent() + 1):
        ex = TopExp_Explorer(faces.FindKey(i), TopAbs_WIRE)
        while ex.More():
            loops += 1
            ex.Next()
    return (_count(w, TopAbs_VERTEX), n_edges, faces.Extent(), loops, _count(w, TopAbs_SHELL))


def through_holes(shape) -> int:
    """Genus of the boundary (see the module docstring), summed over the solids of `shape`."""
    total = 0
    for solid in shape.Solids():
        v, e, f, loops, s = euler_counts(solid)
        chi2 = v - e + 2 * f - loops  # = 2 (S - G)
        if chi2 % 2:
            raise ValueError(f"Euler-Poincare sum V-E+2F-L={chi2} is odd: the solid's topology is inconsistent")
        total += s - chi2 // 2
    return total


def face_count(shape) -> int:
    """Faces after merging same-surface faces (so the count does not depend on the construction)."""
    return len(shape.clean().Faces())


def bbox(shape) -> tuple[float, float, float, float, float, float]:
    from OCP.Bnd import Bnd_Box
    from OCP.BRepBndLib import BRepBndLib

    box = Bnd_Box()
    BRepBndLib.AddOptimal_s(shape.wrapped, box, False, False)  # exact geometry, no triangulation, no gap
    xmin, ymin, zmin, xmax, ymax, zmax = box.Get()
    return (xmin, ymin, zmin, xmax, ymax, zmax)


def volume(shape) -> float:
    return float(shape.Volume())


def summarize(shape, feats: "Features | None" = None) -> Summary:
    """What `run_cad` shows the agent; `faces` and `holes` are read from the outer shells, as the grader reads them."""
    f = feats if feats is not None else features(shape)
    return Summary(valid=bool(shape.isValid()), solids=len(shape.Solids()), volume=volume(shape), bbox=bbox(shape),
                   faces=len(f.faces), holes=f.holes)


# ----------------------------------------------------------------------------- features of the outside
def outer_part(shape):
    """(the solids of `shape` bounded by their outer shells only, number of inner shells left out).

    An inner shell of a solid bounds a closed cavity: nothing outside the part can reach it, so it is no
    feature of the part's outside and the feature checks never see it (it still costs the IoU its volume).
    """
    import cadquery as cq
    from OCP.BRep import BRep_Builder
    from OCP.BRepClass3d import BRepClass3d
    from OCP.TopoDS import TopoDS_Solid

    out, voids = [], 0
    for solid in shape.Solids():
        shells = solid.Shells()
        if len(shells) == 1:
            out.append(solid)
            continue
        voids += len(shells) - 1
        b, outer = BRep_Builder(), TopoDS_Solid()
        b.MakeSolid(outer)
        b.Add(outer, BRepClass3d.OuterShell_s(solid.wrapped))
        out.append(cq.Solid(outer))
    return out, voids


_KINDS = {"GeomAbs_Plane": "plane", "GeomAbs_Cylinder": "cylinder", "GeomAbs_Cone": "cone",
          "GeomAbs_Sphere": "sphere", "GeomAbs_Torus": "torus"}


def _xyz(p) -> tuple[float, float, float]:
    return (p.X(), p.Y(), p.Z())


def face_sig(face) -> FaceSig:
    """The face's `FaceSig`: its surface from the kernel's adaptor (placed in absolute coordinates), area and
    centroid from BRepGProp, and the outward normal at the middle of its parameter range (the face's
    orientation in its solid flips the surface's own normal)."""
    from OCP.BRepAdaptor import BRepAdaptor_Surface
    from OCP.BRepGProp import BRepGProp
    from OCP.GProp import GProp_GProps
    from OCP.gp import gp_Pnt, gp_Vec
    from OCP.TopAbs import TopAbs_REVERSED

    props = GProp_GProps()
    BRepGProp.SurfaceProperties_s(face, props)
    ad = BRepAdaptor_Surface(face, True)
    kind = _KINDS.get(ad.GetType().name, "other")
    u = 0.5 * (ad.FirstUParameter() + ad.LastUParameter())
    v = 0.5 * (ad.FirstVParameter() + ad.LastVParameter())
    p, du, dv = gp_Pnt(), gp_Vec(), gp_Vec()
    ad.D1(u, v, p, du, dv)
    n = du.Crossed(dv)
    if face.Orientation() == TopAbs_REVERSED:
        n.Reverse()
    zero = (0.0, 0.0, 0.0)
    axis, origin, r1, r2, concave = zero, zero, 0.0, 0.0, False
    if kind == "plane":
        mag = n.Magnitude()
        axis = (n.X() / mag, n.Y() / mag, n.Z() / mag) if mag > 0 else zero
    elif kind != "other":
        if kind == "cylinder":
            g = ad.Cylinder()
            ax, r1 = g.Axis(), g.Radius()
        elif kind == "cone":  # placed by its apex: a cone's reference radius depends on where its frame sits
            g = ad.Cone()
            ax, r2 = g.Axis(), abs(g.SemiAngle())
        elif kind == "torus":
            g = ad.Torus()
            ax, r1, r2 = g.Axis(), g.MajorRadius(), g.MinorRadius()
        else:
            g = ad.Sphere()
            ax, r1 = g.Position().Axis(), g.Radius()
        o, d = np.array(_xyz(ax.Location())), np.array(_xyz(ax.Direction()))
        if kind == "cone":
            o = np.array(_xyz(g.Apex()))
        q = np.array(_xyz(p))
        foot = o if kind == "sphere" else o + np.dot(q - o, d) * d  # nearest point of the axis (the centre)
        if kind == "torus":  # nearest point of the torus's core circle
            radial = q - foot
            foot = foot + r1 * radial / max(np.linalg.norm(radial), 1e-300)
        concave = float(np.dot(np.array(_xyz(n)), q - foot)) < 0.0
        axis, origin = tuple(float(x) for x in d), tuple(float(x) for x in o)
    return FaceSig(kind=kind, area=float(props.Mass()), centroid=_xyz(props.CentreOfMass()), axis=axis,
                   origin=origin, radius=float(r1), radius2=float(r2), concave=bool(concave))


def features(shape, perimeters: bool = False) -> Features:
    """`Features` of `shape` (see the class); `perimeters` for a reference, whose faces set the tolerances."""
    from OCP.BRepGProp import BRepGProp
    from OCP.GProp import GProp_GProps

    solids, voids = outer_part(shape)
    sigs: list[FaceSig] = []
    per: list[float] = []
    genus = 0
    for solid in solids:
        merged = solid.clean()
        genus += through_holes(merged)
        for f in merged.Faces():
            sigs.append(face_sig(f.wrapped))
            if perimeters:
                props = GProp_GProps()
                BRepGProp.LinearProperties_s(f.wrapped, props)
                per.append(float(props.Mass()))
    return Features(solids=len(solids), voids=voids, holes=genus, faces=tuple(sigs), perimeters=tuple(per))


def _same_face(a: FaceSig, b: FaceSig, tol: float, area_tol: float) -> bool:
    """`a` (the agent's) lies where `b` (the reference's) does, within `tol` mm: same surface, same side out."""
    if a.kind != b.kind or abs(a.area - b.area) > area_tol or math.dist(a.centroid, b.centroid) > tol:
        return False
    if a.kind == "other":
        return True
    dot = sum(x * y for x, y in zip(a.axis, b.axis))
    if a.kind == "plane":
        return dot >= 1.0 - ANGLE_TOL ** 2 / 2  # normals: the same direction, the material on the same side
    if a.concave != b.concave or abs(a.radius - b.radius) > tol:
        return False
    if abs(a.radius2 - b.radius2) > (ANGLE_TOL if a.kind == "cone" else tol):
        return False
    if a.kind in ("sphere", "cone"):  # the centre; the apex
        if math.dist(a.origin, b.origin) > tol:
            return False
        if a.kind == "sphere":
            return True
    if abs(dot) < 1.0 - ANGLE_TOL ** 2 / 2:
        return False
    # The two axes are one line: the agent's axis point lies on the reference's axis (cones: the same apex side
    # follows from the centroid and radius checks).
    rel = [x - y for x, y in zip(a.origin, b.origin)]
    along = sum(x * y for x, y in zip(rel, b.axis))
    return math.sqrt(max(0.0, sum(x * x for x in rel) - along * along)) <= tol and (
        a.kind != "torus" or abs(along) <= tol)


def match_faces(agent: tuple[FaceSig, ...], ref: tuple[FaceSig, ...], ref_perimeters: tuple[float, ...],
                tol: float) -> int:
    """The largest number of reference faces that can each be paired with a different agent face lying where it
    does (`_same_face`): a maximum bipartite matching (augmenting paths, Kuhn 1955)."""
    if not agent or not ref:
        return 0
    ca = np.array([f.centroid for f in agent])
    aa = np.array([f.area for f in agent])
    cand: list[list[int]] = []
    for j, r in enumerate(ref):
        area_tol = tol * ref_perimeters[j] + 1e-6 * r.area
        near = np.nonzero((np.abs(aa - r.area) <= area_tol)
                          & (np.linalg.norm(ca - np.array(r.centroid), axis=1) <= tol))[0]
        cand.append([int(i) for i in near if _same_face(agent[i], r, tol, area_tol)])
    owner: dict[int, int] = {}

    def augment(j: int, seen: set[int]) -> bool:
        for i in cand[j]:
            if i in seen:
                continue
            seen.add(i)
            if i not in owner or augment(owner[i], seen):
                owner[i] = j
                return True
        return False

    return sum(augment(j, set()) for j in range(len(ref)))


def boolean_cells(a, b) -> tuple[float, float]:
    """(V(A & B), V(A - B)) from one general fuse of A and B (the intersections are computed once and
    shared by both operations). Raises RuntimeError if the kernel reports failure."""
    from OCP.BOPAlgo import BOPAlgo_PaveFiller
    from OCP.BRepAlgoAPI import BRepAlgoAPI_Common, BRepAlgoAPI_Cut
    from OCP.BRepGProp import BRepGProp
    from OCP.GProp import GProp_GProps
    from OCP.TopTools import TopTools_ListOfShape

    args = TopTools_ListOfShape()
    args.Append(a.wrapped)
    args.Append(b.wrapped)
    pf = BOPAlgo_PaveFiller()
    pf.SetArguments(args)
    pf.Perform()
    if pf.HasErrors():
        raise RuntimeError("the B-rep intersection of the two solids (BOPAlgo_PaveFiller) failed")
    out = []
    for op in (BRepAlgoAPI_Common(a.wrapped, b.wrapped, pf), BRepAlgoAPI_Cut(a.wrapped, b.wrapped, pf)):
        if not op.IsDone():
            raise RuntimeError("a B-rep boolean on the two solids failed")
        props = GProp_GProps()
        BRepGProp.VolumeProperties_s(op.Shape(), props)
        out.append(float(props.Mass()))
    return out[0], out[1]


def common_volume(a, b) -> float:
    """V(A & B) by the exact boolean. Raises if the kernel reports failure."""
    return boolean_cells(a, b)[0]


def iou(a, b) -> tuple[float, float, float, float]:
    """(IoU, V(A), V(B), V(A & B)); the formula in the module docstring (no consistency checks: see compare)."""
    va, vb = volume(a), volume(b)
    vi, da = boolean_cells(a, b)
    union = vb + da
    return (vi / union if union > 0 else 0.0), va, vb, vi


def bbox_tolerance(ref_box: tuple[float, ...]) -> float:
    diag = math.dist(ref_box[:3], ref_box[3:])
    return BBOX_ABS_TOL_MM + BBOX_REL_TOL * diag


def compare(agent, ref, ref_summary: Summary | None = None, ref_features: Features | None = None) -> Comparison:
    """Compare the agent's solid (already through `to_shape`) with the reference in absolute coordinates.

    Raises NoSolidError when the volumes contradict each other (module docstring) or when the kernel
    fails on the agent's shape.
    """
    rf = ref_features or features(ref, perimeters=True)
    rs = ref_summary or summarize(ref, rf)
    try:
        va, vb = volume(agent), rs.volume
        vi, da = boolean_cells(agent, ref)
        abox = bbox(agent)
        af = features(agent)
    except Exception as e:  # noqa: BLE001 - OCC (or the Euler check) failing on agent-made geometry
        raise NoSolidError(f"the kernel could not measure the solid ({type(e).__name__}: {e})", "kernel") from None
    # V(B) is the trusted reference's own volume, so V(B - A) = V(B) - V(A & B); what needs checking is
    # that the kernel's cells of A add up to A's own integral and that the common part fits in both.
    tol = VOLUME_CONSISTENCY * max(va, vb)
    if not all(math.isfinite(x) for x in (va, vi, da)) or min(vi, da) < -tol or va <= 0:
        raise NoSolidError(f"the solid's boolean cells with the target are not volumes ({vi:.6g}, {da:.6g})",
                           "inconsistent")
    if abs(vi + da - va) > tol:
        raise NoSolidError(f"the solid's own volume ({va:.6g}) disagrees with the boolean kernel's view of it "
                           f"({vi + da:.6g}): its boundary is not that of a consistent solid", "inconsistent")
    if vi > min(va, vb) + tol:
        raise NoSolidError(f"the solid's common volume with the target ({vi:.6g}) exceeds the smaller of the two "
                           f"volumes ({min(va, vb):.6g})", "inconsistent")
    db = max(0.0, vb - vi)
    value = vi / (vi + da + db)
    if not 0.0 <= value <= 1.0 + IOU_SNAP:
        raise NoSolidError(f"IoU {value:.6g} is not that of two solids", "inconsistent")
    err = max(abs(x - y) for x, y in zip(abox, rs.bbox))
    len_tol = bbox_tolerance(rs.bbox)
    holes_ok = faces_ok = False
    if af.solids == rf.solids:  # one solid for one: a detached body is never a feature
        if len(af.faces) == len(rf.faces):
            faces_ok = match_faces(af.faces, rf.faces, rf.perimeters, len_tol) == len(rf.faces)
        walls_a, walls_r = af.hole_walls, rf.hole_walls
        if af.holes == rf.holes and len(walls_a) == len(walls_r):
            holes_ok = match_faces(tuple(af.faces[i] for i in walls_a), tuple(rf.faces[j] for j in walls_r),
                                   tuple(rf.perimeters[j] for j in walls_r), len_tol) == len(walls_r)
    return Comparison(iou=value, v_agent=va, v_ref=vb, v_common=vi, holes_ok=float(holes_ok),
                      faces_ok=float(faces_ok), bbox_ok=float(err <= len_tol),
                      agent_holes=af.holes, ref_holes=rf.holes, agent_faces=len(af.faces), ref_faces=len(rf.faces),
                      bbox_err_mm=err, v_agent_only=da, v_ref_only=db, agent_solids=af.solids, agent_voids=af.voids)


# ----------------------------------------------------------------------------- meshes for pictures
def mesh(shape, tolerance: float = 0.2, angular: float = 0.3) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(vertices_N3 float64, triangles_M3 int64, edge polylines [P_i x 3]) for rendering."""
    verts, tris = shape.tessellate(tolerance, angular)
    v_N3 = np.array([(p.x, p.y, p.z) for p in verts], dtype=np.float64).reshape(-1, 3)
    t_M3 = np.array(tris, dtype=np.int64).reshape(-1, 3)
    lines = []
    for edge in shape.Edges():
        if edge.geomType() == "LINE":
            n = 2
        else:
            n = max(8, min(96, int(edge.Length() / max(tolerance, 1e-3))))
        ts = np.linspace(0.0, 1.0, n)
        pts = edge.positions(ts.tolist())
        lines.append(np.array([(p.x, p.y, p.z) for p in pts], dtype=np.float64))
    return v_N3, t_M3, lines
