"""Static check of an agent's BREP text before OpenCascade parses it.

OpenCascade's text reader (BRepTools::Read, OCCT 7.9) trusts every number in the file: a section
header or an inner count (poles, knots, sub-shape lists) is a loop bound and an allocation size,
a sub-shape reference is an array index, a location power is a recursion depth, a keyword is read
into a fixed 255-byte buffer, and on a malformed token the stream fails while the loops keep
spinning to their bound. One header line edited to 999999999 therefore holds a grading worker
until its timeout, and a few kilobytes of nested compounds that reference the same solid again
and again expand into millions of solids for the fuse.

`scan(data)` walks the whole file with the reader's own grammar (the record layouts below are
transcribed from OCCT's BRepTools_ShapeSet, TopTools_ShapeSet, TopTools_LocationSet and
GeomTools_{Curve2d,Curve,Surface}Set readers) and accepts only what that grammar reads cleanly:

* every count is checked against the tokens left in the file (and against a cap) before anything
  is counted, then every record is read, so the header counts equal what the file holds;
* every token is bounded in length, every real is finite, every integer in range, every index
  points at an entry that exists (sub-shapes: one written earlier, so the shape graph is acyclic);
* only the subset our own writer emits: format V3, no triangulations or polygons, the sub-shape
  types a B-rep hierarchy allows, BSpline degrees <= 25, nesting of trimmed/offset curves <= 4;
* complexity caps on the expanded shape (solid, face, edge occurrences under the root, counted
  through the reference graph, so instancing is counted as what it expands to) and on BSpline
  poles, before any boolean runs.

It returns the counts (`BrepStats`) or raises `BrepRejected` with a reason the agent can read.
It does not check geometry (validity, orientation, volumes): that needs the kernel and happens in
geometry.py after the file has passed this scan. Pure Python, no cadquery: the host runs it
before a grading worker is even taken, the worker runs it again before parsing, and the
in-sandbox runner runs it on its own export so an honest agent learns why a solid is refused.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

HEADER = b"\nCASCADE Topology V3, (c) Open Cascade\n"


class BrepRejected(ValueError):
    """The file is not a BREP the grader will parse (the message says why; shown to the agent)."""


@dataclass(frozen=True)
class BrepLimits:
    """Caps, chosen from what honest parts need and what the kernel then costs (times: one idle core).

    Honest parts here have 4-26 faces, 20-130 edge uses, 0-311 poles and files of 2-20 KB. The
    grade's cost grows faster than linearly: a 500-sided prism (502 faces, ~3000 edge uses) grades
    in 1.5 s, a 660-sided one crossing the target's faces in 4.9 s, a 2000-sided one in 14 s; a solid
    with 2000 BSpline poles in 3.5 s, 8000 in 7.6 s; fusing 8 overlapping 60-gon prisms (496 faces)
    takes 1 s, 16 of them 9 s, 64 overlapping cylinders 48 s.
    """

    max_bytes: int = 2 << 20
    max_solids: int = 8
    max_faces: int = 600
    # Several solids are fused before comparison, and fusing overlapping solids is roughly quadratic in
    # their faces; one honest solid needs no fuse at all.
    max_fuse_faces: int = 300
    max_edges: int = 2400  # edge uses under the root (an edge is used by two faces, a seam twice by one)
    max_poles: int = 2000  # BSpline/Bezier poles over the whole file
    # Table sizes follow from the caps above (an edge has a 3D curve and 1-2 pcurves, a face one
    # surface, a B-rep ~3 shapes per edge); checked at each header, with max_tokens they bound the
    # scan itself to well under a second of Python however the 2 MiB are spent.
    max_locations: int = 256
    max_tokens: int = 150_000  # the 397-face prism just inside the caps has 40k
    max_representations: int = 16  # point / curve representations of one vertex or edge (honest: <= 5)
    max_degree: int = 25  # Geom_BSplineCurve::MaxDegree()
    max_nesting: int = 4  # trimmed / offset / extrusion / revolution wrappers (recursion in the reader)
    max_location_power: int = 8  # TopLoc_Location::Powered recurses |power| times on composite locations
    max_location_items: int = 16
    max_token_chars: int = 64
    max_real_chars: int = 30  # GeomTools::GetReal reads at most 31 characters per real
    max_abs_real: float = 1e101  # admits Precision::Infinite() = 2e100 (written for unbounded trims)


@dataclass(frozen=True)
class BrepStats:
    bytes: int
    tshapes: int
    solids: int  # occurrences under the root, instancing expanded
    faces: int
    edges: int
    poles: int
    locations: int


_ALLOWED = bytes(range(0x21, 0x7F)) + b" \n"
_REAL_CHARS = b"0123456789.eE+-"
_INT_PREFIX = re.compile(rb"[+-]?[0-9]{1,9}")
_FLAGS = re.compile(rb"[01]{7}")
_ORIENTATIONS = (b"+", b"-", b"i", b"e")  # FORWARD, REVERSED, INTERNAL, EXTERNAL
_REGULARITY = {b"C0", b"C1", b"C2", b"C3", b"CN", b"G1", b"G2"}
_BIG = 10 ** 12  # saturation for occurrence counts (instancing can make them astronomically large)

# TShape kinds and the sub-shape kinds each may hold (TopoDS_Builder's hierarchy, restricted to
# what a solid's B-rep uses: no internal faces or free vertices inside solids).
_KINDS = {b"Ve": "vertex", b"Ed": "edge", b"Wi": "wire", b"Fa": "face", b"Sh": "shell", b"So": "solid",
          b"CS": "compsolid", b"Co": "compound"}
_CHILDREN = {"vertex": (), "edge": ("vertex",), "wire": ("edge",), "face": ("wire",), "shell": ("face",),
             "solid": ("shell",), "compsolid": ("solid",),
             "compound": ("vertex", "edge", "wire", "face", "shell", "solid", "compsolid", "compound")}


class _Reader:
    """Reads tokens the way the C++ stream extraction in OCCT's reader does: whitespace-separated,
    an integer may run straight into the next field (a pcurve index and its regularity: "2CN"), and
    only faces look at line ends (the reader uses getline there).

    The file is split once into tokens with their line numbers, so each read is a list step.
    """

    def __init__(self, data: bytes, start: int, limits: BrepLimits) -> None:
        self.toks: list[bytes] = []
        self.line: list[int] = []  # 1-based line of each token
        first_line = data.count(b"\n", 0, start)
        lines = data[start:].split(b"\n")
        self.line_len = [0] * (first_line + 1) + [len(t) for t in lines] + [0]  # by line number
        for no, text in enumerate(lines, first_line + 1):
            parts = text.split()
            if parts:
                self.toks += parts
                self.line += [no] * len(parts)
        self.i = 0
        self.lim = limits
        self.poles = 0
        self.refs = 0

    def fail(self, why: str) -> BrepRejected:
        k = min(self.i, len(self.line) - 1)
        where = f" (line {self.line[k]})" if k >= 0 else ""
        return BrepRejected(f"not a BREP file the grader reads{where}: {why}")

    def left(self) -> int:
        return len(self.toks) - self.i

    def word(self) -> bytes:
        if self.i >= len(self.toks):
            raise self.fail("unexpected end of file")
        tok = self.toks[self.i]
        if len(tok) > self.lim.max_token_chars:
            raise self.fail(f"a token of {len(tok)} characters")
        self.i += 1
        return tok

    def keyword(self, expected: bytes) -> None:
        got = self.word()
        if got != expected:
            raise self.fail(f"expected {expected.decode()!r}, found {got[:20].decode(errors='replace')!r}")

    def int_(self, lo: int, hi: int, what: str, glued: bool = False) -> int:
        i = self.i
        if i >= len(self.toks):
            raise self.fail(f"unexpected end of file (expected {what})")
        tok = self.toks[i]
        if tok.isdigit() and len(tok) <= 9:  # the common case, without a regex
            self.i = i + 1
            v = int(tok)
        else:
            m = _INT_PREFIX.match(tok)
            if m is None or (m.end() < len(tok) and not (glued and tok[m.end():m.end() + 1] in b"CG")):
                raise self.fail(f"expected an integer ({what})")
            if m.end() < len(tok):  # "2CN": the regularity is the next field
                self.toks[i] = tok[m.end():]
            else:
                self.i = i + 1
            v = int(m.group())
        if not lo <= v <= hi:
            raise self.fail(f"{what} = {v} is outside [{lo}, {hi}]")
        return v

    def bool_(self, what: str) -> bool:
        return bool(self.int_(0, 1, what))

    def count(self, what: str, min_tokens_each: int, hi: int = _BIG) -> int:
        """A count read from the file, bounded by what the rest of the file can still hold."""
        n = self.int_(0, 999_999_999, what)
        room = self.left() // max(1, min_tokens_each)
        if n > room:
            raise self.fail(f"{what} = {n}, but the rest of the file ({self.left()} tokens) holds at most {room}")
        if n > hi:
            raise self.fail(f"{what} = {n}, more than the grader accepts ({hi})")
        return n

    def reals(self, n: int) -> None:
        """n reals: strtod syntax, at most max_real_chars, finite and within max_abs_real."""
        seg = self.toks[self.i:self.i + n]
        if len(seg) < n:
            raise self.fail("unexpected end of file (expected a number)")
        big, cap = self.lim.max_abs_real, self.lim.max_real_chars
        for tok in seg:
            if len(tok) > cap or tok.translate(None, _REAL_CHARS):
                raise self.fail(f"not a number: {tok[:32].decode(errors='replace')!r}")
            try:
                v = float(tok)
            except ValueError:
                raise self.fail(f"not a number: {tok.decode()!r}") from None
            if not -big <= v <= big:  # also false for NaN
                raise self.fail(f"number out of range: {tok.decode()}")
        self.i += n

    def real(self) -> None:
        self.reals(1)

    def tolerance(self) -> None:
        """A vertex / edge / face tolerance: a length in [0, 1] mm (honest parts: 1e-7 to 1e-4)."""
        self.reals(1)
        if not 0.0 <= float(self.toks[self.i - 1]) <= 1.0:
            self.i -= 1
            raise self.fail("a tolerance outside [0, 1] mm")

    def add_poles(self, n: int, reals_each: int) -> None:
        if n * reals_each > self.left():
            raise self.fail(f"{n} poles announced, but only {self.left()} tokens follow")
        self.poles += n
        if self.poles > self.lim.max_poles:
            raise self.fail(f"more than {self.lim.max_poles} BSpline/Bezier poles")

    def blank_line_follows(self) -> None:
        """OCCT reads the rest of this line and the next one with getline into 256 bytes: no token may be
        on either, and neither may be longer (a longer line fails the stream, and the reader spins on)."""
        here = self.line[self.i - 1]
        if self.i < len(self.toks) and self.line[self.i] < here + 2:
            raise self.fail("expected the end of the line and a blank line")
        if max(self.line_len[here], self.line_len[here + 1]) > 250:
            raise self.fail("a face record line longer than the reader's 256-byte buffer")


# ----------------------------------------------------------------------------- geometry records
def _degree(r: _Reader) -> int:
    return r.int_(1, r.lim.max_degree, "degree")


def _knots(r: _Reader, n: int, degree: int) -> None:
    for _ in range(n):
        r.real()
        r.int_(1, degree + 1, "knot multiplicity")


def _curve(r: _Reader, dim: int, depth: int = 0) -> None:
    """One 2D (dim=2) or 3D (dim=3) curve record (GeomTools_Curve2dSet / GeomTools_CurveSet::ReadCurve)."""
    if depth > r.lim.max_nesting:
        raise r.fail("curves nested too deeply")
    kind = r.int_(1, 9, "curve type")
    if kind == 1:  # line: point, direction
        r.reals(2 * dim)
    elif kind in (2, 4):  # circle (radius) / parabola (focal): 2D P, XDir, YDir; 3D P, N, XDir, YDir
        r.reals((6 if dim == 2 else 12) + 1)
    elif kind in (3, 5):  # ellipse / hyperbola: two radii
        r.reals((6 if dim == 2 else 12) + 2)
    elif kind == 6:  # Bezier: rational, degree, poles (+ weights)
        rational = r.bool_("rational")
        deg = _degree(r)
        per = dim + rational
        r.add_poles(deg + 1, per)
        r.reals((deg + 1) * per)
    elif kind == 7:  # BSpline: rational, periodic, degree, nbpoles, nbknots, poles (+ weights), knots + mults
        rational = r.bool_("rational")
        r.bool_("periodic")
        deg = _degree(r)
        n_poles = r.count("BSpline poles", dim)
        n_knots = r.count("BSpline knots", 2, hi=n_poles + deg + 1)  # sum of multiplicities = poles + degree + 1
        if n_poles < 2 or n_knots < 2:
            raise r.fail("a BSpline curve needs at least 2 poles and 2 knots")
        per = dim + rational
        r.add_poles(n_poles, per)
        r.reals(n_poles * per)
        _knots(r, n_knots, deg)
    elif kind == 8:  # trimmed: u1, u2, basis
        r.reals(2)
        _curve(r, dim, depth + 1)
    else:  # offset: distance (+ direction in 3D), basis
        r.reals(1 if dim == 2 else 4)
        _curve(r, dim, depth + 1)


def _surface(r: _Reader, depth: int = 0) -> None:
    """One surface record (GeomTools_SurfaceSet::ReadSurface)."""
    if depth > r.lim.max_nesting:
        raise r.fail("surfaces nested too deeply")
    kind = r.int_(1, 11, "surface type")
    if kind == 1:  # plane: gp_Ax3 = P, N, XDir, YDir
        r.reals(12)
    elif kind in (2, 4):  # cylinder / sphere: + radius
        r.reals(13)
    elif kind in (3, 5):  # cone (radius, semi-angle) / torus (major, minor radius)
        r.reals(14)
    elif kind == 6:  # linear extrusion: direction, basis curve
        r.reals(3)
        _curve(r, 3, depth + 1)
    elif kind == 7:  # revolution: axis point, axis direction, basis curve
        r.reals(6)
        _curve(r, 3, depth + 1)
    elif kind == 8:  # Bezier: urational, vrational, udeg, vdeg, poles (+ weights)
        rational = r.bool_("u rational") | r.bool_("v rational")
        ud, vd = _degree(r), _degree(r)
        per = 3 + rational
        r.add_poles((ud + 1) * (vd + 1), per)
        r.reals((ud + 1) * (vd + 1) * per)
    elif kind == 9:  # BSpline: ur, vr, up, vp, udeg, vdeg, nbu, nbv, nbuknots, nbvknots, poles, uknots, vknots
        rational = r.bool_("u rational") | r.bool_("v rational")
        r.bool_("u periodic")
        r.bool_("v periodic")
        ud, vd = _degree(r), _degree(r)
        nu, nv = r.count("BSpline u poles", 3), r.count("BSpline v poles", 3)
        nuk, nvk = r.count("BSpline u knots", 2, hi=nu + ud + 1), r.count("BSpline v knots", 2, hi=nv + vd + 1)
        if min(nu, nv, nuk, nvk) < 2:
            raise r.fail("a BSpline surface needs at least 2 poles and 2 knots in each direction")
        per = 3 + rational
        r.add_poles(nu * nv, per)
        r.reals(nu * nv * per)
        _knots(r, nuk, ud)
        _knots(r, nvk, vd)
    elif kind == 10:  # rectangular trimmed: u1, u2, v1, v2, basis
        r.reals(4)
        _surface(r, depth + 1)
    else:  # offset: distance, basis
        r.reals(1)
        _surface(r, depth + 1)


# ----------------------------------------------------------------------------- locations
def _loc_mul(a: tuple, b: tuple) -> tuple:
    """TopLoc_Location::Multiplied (a * b) on (datum, power) chains, head first, as OCCT computes it."""
    if not a:
        return b
    if not b:
        return a
    result = _loc_mul(a, b[1:])
    datum, p = b[0]
    if result and result[0][0] == datum:
        p += result[0][1]
        result = result[1:]
    return ((datum, p),) + result if p != 0 else result


def _loc_inv(a: tuple) -> tuple:
    return tuple((d, -p) for d, p in reversed(a))


def _loc_pow(a: tuple, p: int) -> tuple:
    """TopLoc_Location::Powered (|p| is bounded by the caller: OCCT recurses |p| times here)."""
    if not a or p == 1:
        return a
    if p == 0:
        return ()
    if len(a) == 1:
        return ((a[0][0], a[0][1] * p),)
    if p > 0:
        return _loc_mul(a, _loc_pow(a, p - 1))
    return _loc_pow(_loc_inv(a), -p)


def _locations(r: _Reader) -> int:
    """TopTools_LocationSet::Read; returns how many entries the reader's map ends up with.

    Elementary locations (type 1) always add an entry (each is a new datum); a composite one (type 2)
    adds one only when the product is neither the identity nor equal to an entry already there, which
    is why the entries are simulated here: a later index into the map must exist.
    """
    r.keyword(b"Locations")
    n = r.count("Locations", 2, hi=r.lim.max_locations)
    entries: list[tuple] = []
    index: dict[tuple, int] = {}
    for k in range(n):
        kind = r.int_(1, 2, "location type")
        if kind == 1:
            r.reals(12)  # rows of the 3x4 matrix: R | t
            m = [float(t) for t in r.toks[r.i - 12:r.i]]
            rot = [m[0:3], m[4:7], m[8:11]]
            for i in range(3):
                for j in range(3):
                    dot = sum(rot[i][c] * rot[j][c] for c in range(3))
                    if abs(dot - (1.0 if i == j else 0.0)) > 1e-6:
                        raise r.fail("a location that is not a rigid motion (rotation + translation)")
            loc: tuple = ((("datum", k), 1),)
        else:
            loc = ()
            for _ in range(r.lim.max_location_items + 1):
                ref = r.int_(0, len(entries), "location reference")
                if ref == 0:
                    break
                p = r.int_(-r.lim.max_location_power, r.lim.max_location_power, "location power")
                loc = _loc_mul(_loc_pow(entries[ref - 1], p), loc)
                if len(loc) > r.lim.max_location_items or any(abs(q) > r.lim.max_location_power for _, q in loc):
                    raise r.fail("a composite location that is too long or too high a power")
            else:
                raise r.fail("a composite location with too many factors")
        if loc and loc not in index:
            index[loc] = len(entries) + 1
            entries.append(loc)
    return len(entries)


# ----------------------------------------------------------------------------- shapes
def _vertex(r: _Reader, n_curves: int, n_curves2d: int, n_surfaces: int, n_locs: int) -> None:
    r.tolerance()
    r.reals(3)  # x, y, z
    for _ in range(r.lim.max_representations + 1):
        r.real()  # parameter
        kind = r.int_(0, 3, "vertex representation")
        if kind == 0:
            return
        if kind == 1:
            r.int_(0, n_curves, "curve index")
        elif kind == 2:
            r.int_(0, n_curves2d, "pcurve index")
            r.int_(0, n_surfaces, "surface index")
        else:
            r.real()
            r.int_(0, n_surfaces, "surface index")
        r.int_(0, n_locs, "location index")
    raise r.fail("too many vertex representations")


def _edge(r: _Reader, n_curves: int, n_curves2d: int, n_surfaces: int, n_locs: int) -> None:
    r.tolerance()
    r.bool_("same parameter")
    r.bool_("same range")
    r.bool_("degenerated")
    for _ in range(r.lim.max_representations + 1):
        kind = r.int_(0, 4, "edge representation")  # 5-7 (polygons, triangulations) are never written by us
        if kind == 0:
            return
        if kind == 1:  # 3D curve, location, range
            r.int_(0, n_curves, "curve index")
            r.int_(0, n_locs, "location index")
            r.reals(2)
        elif kind in (2, 3):  # pcurve(s) [+ regularity], surface, location, range (V3: no UV points)
            r.int_(0, n_curves2d, "pcurve index")
            if kind == 3:
                r.int_(0, n_curves2d, "pcurve index", glued=True)
                if r.word() not in _REGULARITY:
                    raise r.fail("unknown regularity")
            r.int_(0, n_surfaces, "surface index")
            r.int_(0, n_locs, "location index")
            r.reals(2)
        else:  # regularity between two surfaces
            if r.word() not in _REGULARITY:
                raise r.fail("unknown regularity")
            r.int_(0, n_surfaces, "surface index")
            r.int_(0, n_locs, "location index")
            r.int_(0, n_surfaces, "surface index")
            r.int_(0, n_locs, "location index")
    raise r.fail("too many edge representations")


def _face(r: _Reader, n_surfaces: int, n_locs: int) -> None:
    r.int_(0, 1, "natural restriction")  # 2 = triangulation only: never written by us
    r.tolerance()
    r.int_(1, n_surfaces, "surface index")
    r.int_(0, n_locs, "location index")
    # BRepTools_ShapeSet reads the rest of this line and the next one with getline(256); a next line
    # starting with '2' would attach a triangulation. Both must be blank.
    r.blank_line_follows()


def scan(data: bytes, limits: BrepLimits = BrepLimits()) -> BrepStats:
    """Check `data` against the reader's grammar and the complexity caps; raise BrepRejected if not."""
    if len(data) > limits.max_bytes:
        raise BrepRejected(f"the BREP file is {len(data)} bytes; the grader reads at most {limits.max_bytes}")
    if data.translate(None, _ALLOWED):
        raise BrepRejected("the BREP file has bytes other than printable ASCII, spaces and newlines")
    if not data.startswith(HEADER):
        raise BrepRejected("the BREP file does not start with the CASCADE Topology V3 header")
    r = _Reader(data, len(HEADER), limits)
    if len(r.toks) > limits.max_tokens:  # bounds the walk below
        raise BrepRejected(f"the BREP file has {len(r.toks)} tokens; the grader reads at most {limits.max_tokens}")
    n_locs = _locations(r)
    r.keyword(b"Curve2ds")
    n_curves2d = r.count("Curve2ds", 5, hi=2 * limits.max_edges)
    for _ in range(n_curves2d):
        _curve(r, 2)
    r.keyword(b"Curves")
    n_curves = r.count("Curves", 7, hi=limits.max_edges)
    for _ in range(n_curves):
        _curve(r, 3)
    for section in (b"Polygon3D", b"PolygonOnTriangulations"):
        r.keyword(section)
        r.int_(0, 0, f"{section.decode()} count (the grader reads no meshes)")
    r.keyword(b"Surfaces")
    n_surfaces = r.count("Surfaces", 13, hi=2 * limits.max_faces)
    for _ in range(n_surfaces):
        _surface(r)
    r.keyword(b"Triangulations")
    r.int_(0, 0, "Triangulations count (the grader reads no meshes)")

    r.keyword(b"TShapes")
    n = r.count("TShapes", 3, hi=3 * limits.max_edges)
    kinds: list[str] = []
    # Occurrences under each TShape: (solids, faces, edges), saturating, so instancing counts as what it expands to.
    occ: list[tuple[int, int, int]] = []
    for i in range(n):
        tag = r.word()
        kind = _KINDS.get(tag)
        if kind is None:
            raise r.fail(f"unknown shape type {tag[:8].decode(errors='replace')!r}")
        if kind == "vertex":
            _vertex(r, n_curves, n_curves2d, n_surfaces, n_locs)
        elif kind == "edge":
            _edge(r, n_curves, n_curves2d, n_surfaces, n_locs)
        elif kind == "face":
            _face(r, n_surfaces, n_locs)
        if not _FLAGS.fullmatch(r.word()):
            raise r.fail("bad shape flags")
        s, f, e = int(kind == "solid"), int(kind == "face"), int(kind == "edge")
        while True:  # ends: every pass consumes a token, and the file is finite
            tok = r.word()
            if tok == b"*":
                break
            if tok[:1] not in _ORIENTATIONS or not tok[1:].isdigit() or len(tok) > 10:
                raise r.fail("bad sub-shape reference")
            r.refs += 1
            if r.refs > 4 * 3 * limits.max_edges:
                raise r.fail("more sub-shape references than a B-rep within the caps has")
            # TopTools_ShapeSet::Read: reference k names shape n - k + 1; only shapes already read exist.
            idx = n - int(tok[1:])
            if not 0 <= idx < i:
                raise r.fail(f"sub-shape reference {tok.decode()} does not name a shape written before it")
            if kinds[idx] not in _CHILDREN[kind]:
                raise r.fail(f"a {kind} cannot contain a {kinds[idx]}")
            r.int_(0, n_locs, "location index")
            cs, cf, ce = occ[idx]
            s, f, e = min(_BIG, s + cs), min(_BIG, f + cf), min(_BIG, e + ce)
        kinds.append(kind)
        occ.append((s, f, e))

    tok = r.word()
    if tok[:1] not in _ORIENTATIONS or not tok[1:].isdigit() or len(tok) > 10 or not 1 <= int(tok[1:]) <= n:
        raise r.fail("bad root shape reference")
    r.int_(0, n_locs, "location index")
    if r.left():
        raise r.fail("data after the root shape")
    solids, faces, edges = occ[n - int(tok[1:])]
    if solids == 0:
        raise BrepRejected("the BREP file holds no solid")
    if solids > limits.max_solids:
        raise BrepRejected(f"the BREP file holds {_n(solids)} solids; the grader accepts at most {limits.max_solids}")
    if faces > limits.max_faces:
        raise BrepRejected(f"the BREP file holds {_n(faces)} faces; the grader accepts at most {limits.max_faces}")
    if solids > 1 and faces > limits.max_fuse_faces:
        raise BrepRejected(f"the BREP file holds {solids} separate solids with {_n(faces)} faces in all; several solids "
                           f"are accepted only up to {limits.max_fuse_faces} faces (fuse them into one solid)")
    if edges > limits.max_edges:
        raise BrepRejected(f"the BREP file holds {_n(edges)} edge uses; the grader accepts at most {limits.max_edges}")
    return BrepStats(bytes=len(data), tshapes=n, solids=solids, faces=faces, edges=edges, poles=r.poles,
                     locations=n_locs)


def _n(x: int) -> str:
    return f"more than {_BIG:.0e}" if x >= _BIG else str(x)
