"""Geometry of solids for cad-v0: summaries, through-hole count, exact volume IoU, feature checks.

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
  part give the same count.
* **bounding box** = the tight box (`BRepBndLib.AddOptimal`), in absolute coordinates.
* **IoU** = V(A & B) / (V(A) + V(B) - V(A & B)) with V(A & B) from the exact B-rep boolean
  (`BRepAlgoAPI_Common`) and volumes from `BRepGProp` (no voxels, no scale normalisation).

What it does not do: run agent code (runner.py), manage processes (worker.py) or draw (render.py).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# IoU values within this distance of 1 count as 1: volumes of the same solid built two ways
# differ by kernel round-off (~1e-12 relative), never by a real modelling difference.
IOU_SNAP = 1e-6
# Bounding-box check: every coordinate of the agent's box within this of the reference's.
BBOX_ABS_TOL_MM = 0.05
BBOX_REL_TOL = 0.002  # x the reference box diagonal


class NoSolidError(ValueError):
    """The agent's result holds no usable solid (the message is shown to the agent)."""


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

    @property
    def feature_term(self) -> float:
        return (self.holes_ok + self.faces_ok + self.bbox_ok) / 3.0

    @property
    def score(self) -> float:
        iou = 1.0 if self.iou >= 1.0 - IOU_SNAP else self.iou
        return iou * self.feature_term


# ----------------------------------------------------------------------------- shapes from results
def to_shape(result: Any):
    """The agent's `result` (a Workplane, a Shape, or a list of them) -> one cadquery Shape of its solids.

    Overlapping solids are fused so the volume is not counted twice. Raises NoSolidError with a
    message the agent can act on.
    """
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
    if len(solids) == 1:
        return solids[0]
    fused = solids[0].fuse(*solids[1:]).clean()
    return fused


def load_brep(data: bytes):
    """BREP text (as written by `export_brep`) -> Shape. Raises NoSolidError if it is not a shape."""
    import io

    import cadquery as cq

    try:
        return cq.Shape.importBrep(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - OCC raises assorted types on malformed input
        raise NoSolidError(f"not a readable BREP file: {type(e).__name__}: {e}") from None


def export_brep(shape) -> bytes:
    import io

    buf = io.BytesIO()
    shape.exportBrep(buf)
    return buf.getvalue()


# ----------------------------------------------------------------------------- measurements
def _count(shape_wrapped, kind) -> int:
    from OCP.TopExp import TopExp
    from OCP.TopTools import TopTools_IndexedMapOfShape

    m = TopTools_IndexedMapOfShape()
    TopExp.MapShapes_s(shape_wrapped, kind, m)
    return m.Extent()


def euler_counts(shape) -> tuple[int, int, int, int, int]:
    """(V, E, F, L, S): distinct vertices, edges, faces; face loops; shells."""
    from OCP.TopAbs import TopAbs_EDGE, TopAbs_FACE, TopAbs_SHELL, TopAbs_VERTEX, TopAbs_WIRE
    from OCP.TopExp import TopExp, TopExp_Explorer
    from OCP.TopTools import TopTools_IndexedMapOfShape

    w = shape.wrapped
    faces = TopTools_IndexedMapOfShape()
    TopExp.MapShapes_s(w, TopAbs_FACE, faces)
    loops = 0
    for i in range(1, faces.Extent() + 1):
        ex = TopExp_Explorer(faces.FindKey(i), TopAbs_WIRE)
        while ex.More():
            loops += 1
            ex.Next()
    return (_count(w, TopAbs_VERTEX), _count(w, TopAbs_EDGE), faces.Extent(), loops, _count(w, TopAbs_SHELL))


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


def summarize(shape) -> Summary:
    return Summary(valid=bool(shape.isValid()), solids=len(shape.Solids()), volume=volume(shape), bbox=bbox(shape),
                   faces=face_count(shape), holes=through_holes(shape))


def common_volume(a, b) -> float:
    """V(A & B) by the exact boolean. Raises if the kernel reports failure."""
    from OCP.BRepAlgoAPI import BRepAlgoAPI_Common

    op = BRepAlgoAPI_Common(a.wrapped, b.wrapped)
    if not op.IsDone():
        raise RuntimeError("the B-rep intersection (BRepAlgoAPI_Common) failed")
    import cadquery as cq

    return float(cq.Shape.cast(op.Shape()).Volume())


def iou(a, b) -> tuple[float, float, float, float]:
    """(IoU, V(A), V(B), V(A & B)); the formula in the module docstring."""
    va, vb = volume(a), volume(b)
    vi = common_volume(a, b)
    union = va + vb - vi
    return (vi / union if union > 0 else 0.0), va, vb, vi


def bbox_tolerance(ref_box: tuple[float, ...]) -> float:
    diag = math.dist(ref_box[:3], ref_box[3:])
    return BBOX_ABS_TOL_MM + BBOX_REL_TOL * diag


def compare(agent, ref, ref_summary: Summary | None = None) -> Comparison:
    """Compare the agent's solid with the reference in absolute coordinates."""
    rs = ref_summary or summarize(ref)
    value, va, vb, vi = iou(agent, ref)
    abox = bbox(agent)
    err = max(abs(x - y) for x, y in zip(abox, rs.bbox))
    ah, af = through_holes(agent), face_count(agent)
    return Comparison(iou=value, v_agent=va, v_ref=vb, v_common=vi, holes_ok=float(ah == rs.holes),
                      faces_ok=float(af == rs.faces), bbox_ok=float(err <= bbox_tolerance(rs.bbox)),
                      agent_holes=ah, ref_holes=rs.holes, agent_faces=af, ref_faces=rs.faces, bbox_err_mm=err)


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
