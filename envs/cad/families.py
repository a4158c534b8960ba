"""The part families of cad-v0: parameter grids, text specs, and two CadQuery constructions each.

A family turns one *variant* (a tuple of dimensions from its finite grid) into:
  * `spec(p)`: the text the agent reads, with every dimension and the placement convention;
  * `reference(p)`: CadQuery code that builds the target (graded references are built from it,
    in the trusted workers, and it is the domain's scripted reference solution);
  * `alternative(p)`: the same part built another way (another sketch order / other operations),
    used by the tests to show that grading depends on the solid, not on the construction;
  * `holes(p)`: the through-hole count the family intends (the tests check that the Euler-Poincare
    count in geometry.py agrees).
All code assigns the part to `result`, the convention the agent is told. Conventions shared by every
family: millimetres, Z up, the part rests on the plane z = 0 (its lowest point has z = 0) unless the
spec says otherwise. Grids keep only consistent combinations (walls > 0, holes inside the part...).

This module is pure Python (no cadquery import): task generation reads specs without the kernel.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Mapping

Params = Mapping[str, float]


def _g(x: float) -> str:
    """A dimension as text: integers without a decimal point, otherwise up to 4 significant decimals."""
    return f"{x:.4f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    keys: tuple[str, ...]  # parameter names, in the order of a variant tuple
    grid: Callable[[], list[tuple[float, ...]]]
    spec: Callable[[Params], str]
    reference: Callable[[Params], str]
    alternative: Callable[[Params], str]
    holes: Callable[[Params], int]

    def variants(self) -> list[tuple[float, ...]]:
        return self.grid()

    def params(self, variant: tuple[float, ...]) -> dict[str, float]:
        if len(variant) != len(self.keys):
            raise ValueError(f"family {self.name}: variant {variant!r} does not have {len(self.keys)} values {self.keys}")
        return dict(zip(self.keys, variant))


def _product(**axes: list[float]) -> list[tuple[float, ...]]:
    return list(itertools.product(*axes.values()))


# ----------------------------------------------------------------------------- 1. plate with holes
def _plate_grid():
    out = []
    for L, W, T, d, e in _product(L=[60, 70, 80, 90, 100, 120], W=[30, 40, 50, 60], T=[3, 4, 5, 6, 8],
                                  d=[3.5, 4.5, 5.5, 6.6], e=[5, 6, 8]):
        if e >= d / 2 + 1.5 and W - 2 * e >= d + 4 and L > W:
            out.append((L, W, T, d, e))
    return out


FAMILIES_LIST: list[Family] = []

FAMILIES_LIST.append(Family(
    name="plate_holes", title="rectangular plate with four corner holes",
    keys=("L", "W", "T", "d", "e"), grid=_plate_grid,
    spec=lambda p: (
        f"A rectangular plate {_g(p['L'])} mm long (X) x {_g(p['W'])} mm wide (Y) x {_g(p['T'])} mm thick (Z), "
        f"centred on the origin in X and Y, bottom face on z = 0. It has four through-holes (along Z) of diameter "
        f"{_g(p['d'])} mm; each hole centre is {_g(p['e'])} mm in from the two nearest plate edges, i.e. at "
        f"x = +-{_g(p['L'] / 2 - p['e'])}, y = +-{_g(p['W'] / 2 - p['e'])}."),
    reference=lambda p: (
        "import cadquery as cq\n"
        f"result = (cq.Workplane('XY').box({p['L']}, {p['W']}, {p['T']}, centered=(True, True, False))\n"
        f"          .faces('>Z').workplane()\n"
        f"          .rect({p['L'] - 2 * p['e']}, {p['W'] - 2 * p['e']}, forConstruction=True).vertices()\n"
        f"          .hole({p['d']}))\n"),
    alternative=lambda p: (
        "import cadquery as cq\n"
        f"pts = [(sx * {p['L'] / 2 - p['e']}, sy * {p['W'] / 2 - p['e']}) for sx in (1, -1) for sy in (-1, 1)]\n"
        "# holes sketched first as inner wires of the same face, then one extrusion\n"
        f"result = cq.Workplane('XY').rect({p['L']}, {p['W']}).pushPoints(pts).circle({p['d'] / 2}).extrude({p['T']})\n"),
    holes=lambda p: 4,
))


# ----------------------------------------------------------------------------- 2. L-bracket
def _bracket_grid():
    out = []
    for L, H, W, T, d in _product(L=[40, 50, 60, 80], H=[30, 40, 50, 60], W=[20, 25, 30, 40], T=[3, 4, 5, 6],
                                  d=[4, 5, 6, 8]):
        if W >= d + 8 and L - T >= d + 8 and H - T >= d + 8:
            out.append((L, H, W, T, d))
    return out


FAMILIES_LIST.append(Family(
    name="l_bracket", title="L-bracket with one hole in each leg",
    keys=("L", "H", "W", "T", "d"), grid=_bracket_grid,
    spec=lambda p: (
        f"An L-shaped bracket of constant thickness {_g(p['T'])} mm and width {_g(p['W'])} mm (along Y, centred on "
        f"y = 0). The horizontal leg lies on z = 0 and runs from x = 0 to x = {_g(p['L'])} (so it occupies "
        f"0 <= z <= {_g(p['T'])}); the vertical leg stands at x = 0 (occupying 0 <= x <= {_g(p['T'])}) and rises "
        f"to z = {_g(p['H'])}. The horizontal leg has a through-hole of diameter {_g(p['d'])} mm along Z centred at "
        f"x = {_g((p['L'] + p['T']) / 2)}, y = 0; the vertical leg has a through-hole of diameter {_g(p['d'])} mm "
        f"along X centred at y = 0, z = {_g((p['H'] + p['T']) / 2)}."),
    reference=lambda p: (
        "import cadquery as cq\n"
        f"base = cq.Workplane('XY').box({p['L']}, {p['W']}, {p['T']}, centered=(False, True, False))\n"
        f"wall = cq.Workplane('XY').box({p['T']}, {p['W']}, {p['H']}, centered=(False, True, False))\n"
        f"hole_z = cq.Workplane('XY').center({(p['L'] + p['T']) / 2}, 0).circle({p['d'] / 2}).extrude({p['T']})\n"
        f"hole_x = cq.Workplane('YZ').center(0, {(p['H'] + p['T']) / 2}).circle({p['d'] / 2}).extrude({p['T']})\n"
        "result = base.union(wall).cut(hole_z).cut(hole_x)\n"),
    alternative=lambda p: (
        "import cadquery as cq\n"
        "# the L profile sketched in the XZ plane and extruded symmetrically along Y, holes drilled after\n"
        f"prof = [(0, 0), ({p['L']}, 0), ({p['L']}, {p['T']}), ({p['T']}, {p['T']}), ({p['T']}, {p['H']}), (0, {p['H']})]\n"
        f"body = cq.Workplane('XZ').polyline(prof).close().extrude({p['W'] / 2}, both=True)\n"
        f"hx = cq.Solid.makeCylinder({p['d'] / 2}, {p['T'] + 2}, cq.Vector(-1, 0, {(p['H'] + p['T']) / 2}), cq.Vector(1, 0, 0))\n"
        f"hz = cq.Solid.makeCylinder({p['d'] / 2}, {p['T'] + 2}, cq.Vector({(p['L'] + p['T']) / 2}, 0, -1), cq.Vector(0, 0, 1))\n"
        "result = body.cut(hz).cut(hx)\n"),
    holes=lambda p: 2,
))


# ----------------------------------------------------------------------------- 3. flange with bolt circle
def _flange_grid():
    out = []
    for D, T, Dh, Hh, d, n, h in _product(D=[60, 80, 100, 120], T=[6, 8, 10], Dh=[30, 40, 50], Hh=[5, 10, 15],
                                          d=[12, 16, 20], n=[3, 4, 6, 8], h=[5, 6.6, 9]):
        B = (D + Dh) / 2  # bolt circle half-way between hub and rim
        if Dh >= d + 8 and D - Dh >= 2 * h + 8 and B * math.sin(math.pi / n) > h + 2:
            out.append((D, T, Dh, Hh, d, n, h))
    return out


def _bolt_circle(p: Params) -> float:
    return (p["D"] + p["Dh"]) / 2


FAMILIES_LIST.append(Family(
    name="flange", title="flange with hub, bore and bolt circle",
    keys=("D", "T", "Dh", "Hh", "d", "n", "h"), grid=_flange_grid,
    spec=lambda p: (
        f"A round flange on the Z axis: a disc of diameter {_g(p['D'])} mm from z = 0 to z = {_g(p['T'])}, with a "
        f"cylindrical hub of diameter {_g(p['Dh'])} mm on top of it from z = {_g(p['T'])} to z = {_g(p['T'] + p['Hh'])}. "
        f"A central bore of diameter {_g(p['d'])} mm goes through disc and hub. {int(p['n'])} bolt holes of diameter "
        f"{_g(p['h'])} mm go through the disc, equally spaced on a bolt circle of diameter {_g(_bolt_circle(p))} mm, "
        f"the first one on the +X axis."),
    reference=lambda p: (
        "import cadquery as cq\n"
        f"result = (cq.Workplane('XY').circle({p['D'] / 2}).extrude({p['T']})\n"
        f"          .faces('>Z').workplane().circle({p['Dh'] / 2}).extrude({p['Hh']})\n"
        f"          .faces('>Z').workplane().hole({p['d']}))\n"
        f"bolts = cq.Workplane('XY').polarArray({_bolt_circle(p) / 2}, 0, 360, {int(p['n'])}).circle({p['h'] / 2}).extrude({p['T']})\n"
        "result = result.cut(bolts)\n"),
    alternative=lambda p: (
        "import math\nimport cadquery as cq\n"
        "# half cross-section revolved about Z, bolt holes placed with explicit trigonometry\n"
        f"prof = [({p['d'] / 2}, 0), ({p['D'] / 2}, 0), ({p['D'] / 2}, {p['T']}), ({p['Dh'] / 2}, {p['T']}),\n"
        f"        ({p['Dh'] / 2}, {p['T'] + p['Hh']}), ({p['d'] / 2}, {p['T'] + p['Hh']})]\n"
        "body = cq.Workplane('XZ').polyline(prof).close().revolve(360, (0, 0, 0), (0, 1, 0))\n"
        f"n, r = {int(p['n'])}, {_bolt_circle(p) / 2}\n"
        "pts = [(r * math.cos(2 * math.pi * i / n), r * math.sin(2 * math.pi * i / n)) for i in range(n)]\n"
        f"holes = cq.Workplane('XY').workplane(offset=-1).pushPoints(pts).circle({p['h'] / 2}).extrude({p['T'] + 2})\n"
        "result = body.cut(holes)\n"),
    holes=lambda p: 1 + int(p["n"]),
))


# ----------------------------------------------------------------------------- 4. stepped shaft
def _shaft_grid():
    out = []
    for d1, l1, d2, l2, d3, l3 in _product(d1=[20, 25, 30, 40], l1=[10, 20, 30], d2=[12, 16, 20, 25],
                                           l2=[20, 30, 40], d3=[8, 10, 12], l3=[10, 15, 25]):
        if d1 > d2 + 2 and d2 > d3 + 2:
            out.append((d1, l1, d2, l2, d3, l3))
    return out


FAMILIES_LIST.append(Family(
    name="stepped_shaft", title="stepped shaft with three diameters",
    keys=("d1", "l1", "d2", "l2", "d3", "l3"), grid=_shaft_grid,
    spec=lambda p: (
        f"A solid stepped shaft on the Z axis made of three coaxial cylinders stacked from z = 0 upward: diameter "
        f"{_g(p['d1'])} mm for {_g(p['l1'])} mm (z = 0 to {_g(p['l1'])}), then diameter {_g(p['d2'])} mm for "
        f"{_g(p['l2'])} mm (to z = {_g(p['l1'] + p['l2'])}), then diameter {_g(p['d3'])} mm for {_g(p['l3'])} mm "
        f"(to z = {_g(p['l1'] + p['l2'] + p['l3'])}). No holes."),
    reference=lambda p: (
        "import cadquery as cq\n"
        f"result = (cq.Workplane('XY').circle({p['d1'] / 2}).extrude({p['l1']})\n"
        f"          .faces('>Z').workplane().circle({p['d2'] / 2}).extrude({p['l2']})\n"
        f"          .faces('>Z').workplane().circle({p['d3'] / 2}).extrude({p['l3']}))\n"),
    alternative=lambda p: (
        "import cadquery as cq\n"
        "# the half profile revolved about the Z axis\n"
        f"z1, z2, z3 = {p['l1']}, {p['l1'] + p['l2']}, {p['l1'] + p['l2'] + p['l3']}\n"
        f"r1, r2, r3 = {p['d1'] / 2}, {p['d2'] / 2}, {p['d3'] / 2}\n"
        "prof = [(0, 0), (r1, 0), (r1, z1), (r2, z1), (r2, z2), (r3, z2), (r3, z3), (0, z3)]\n"
        "result = cq.Workplane('XZ').polyline(prof).close().revolve(360, (0, 0, 0), (0, 1, 0))\n"),
    holes=lambda p: 0,
))


# ----------------------------------------------------------------------------- 5. washer
def _washer_grid():
    out = []
    for OD, ID, T in _product(OD=[10, 12, 16, 20, 24, 30, 37, 44], ID=[4.3, 5.3, 6.4, 8.4, 10.5, 13, 17, 21],
                              T=[0.8, 1, 1.6, 2, 2.5, 3, 4]):
        if OD >= ID * 1.6 and OD - ID >= 4:
            out.append((OD, ID, T))
    return out


FAMILIES_LIST.append(Family(
    name="washer", title="flat washer",
    keys=("OD", "ID", "T"), grid=_washer_grid,
    spec=lambda p: (
        f"A flat washer on the Z axis: outer diameter {_g(p['OD'])} mm, inner (hole) diameter {_g(p['ID'])} mm, "
        f"thickness {_g(p['T'])} mm, from z = 0 to z = {_g(p['T'])}."),
    reference=lambda p: (
        "import cadquery as cq\n"
        f"result = cq.Workplane('XY').circle({p['OD'] / 2}).circle({p['ID'] / 2}).extrude({p['T']})\n"),
    alternative=lambda p: (
        "import cadquery as cq\n"
        "# a solid disc minus a cylinder\n"
        f"disc = cq.Solid.makeCylinder({p['OD'] / 2}, {p['T']})\n"
        f"bore = cq.Solid.makeCylinder({p['ID'] / 2}, {p['T'] + 2}, cq.Vector(0, 0, -1))\n"
        "result = disc.cut(bore)\n"),
    holes=lambda p: 1,
))


# ----------------------------------------------------------------------------- 6. pocketed box
def _pocket_grid():
    out = []
    for L, W, H, wall, depth in _product(L=[40, 50, 60, 80, 100], W=[30, 40, 50, 60], H=[15, 20, 25, 30],
                                         wall=[3, 4, 5, 8], depth=[5, 10, 12, 20]):
        if L > W and depth <= H - 3 and W - 2 * wall >= 10:
            out.append((L, W, H, wall, depth))
    return out


FAMILIES_LIST.append(Family(
    name="pocketed_box", title="block with a rectangular pocket",
    keys=("L", "W", "H", "wall", "depth"), grid=_pocket_grid,
    spec=lambda p: (
        f"A rectangular block {_g(p['L'])} mm (X) x {_g(p['W'])} mm (Y) x {_g(p['H'])} mm (Z), centred on the origin "
        f"in X and Y, bottom on z = 0. A rectangular pocket with sharp corners is cut into its top face, leaving "
        f"side walls {_g(p['wall'])} mm thick all round (pocket {_g(p['L'] - 2 * p['wall'])} x "
        f"{_g(p['W'] - 2 * p['wall'])} mm, centred); the pocket is {_g(p['depth'])} mm deep (its floor at "
        f"z = {_g(p['H'] - p['depth'])}). It does not go through."),
    reference=lambda p: (
        "import cadquery as cq\n"
        f"result = (cq.Workplane('XY').box({p['L']}, {p['W']}, {p['H']}, centered=(True, True, False))\n"
        f"          .faces('>Z').workplane().rect({p['L'] - 2 * p['wall']}, {p['W'] - 2 * p['wall']}).cutBlind(-{p['depth']}))\n"),
    alternative=lambda p: (
        "import cadquery as cq\n"
        "# a floor slab plus four walls, fused\n"
        f"L, W, H, t, dp = {p['L']}, {p['W']}, {p['H']}, {p['wall']}, {p['depth']}\n"
        "floor = cq.Workplane('XY').box(L, W, H - dp, centered=(True, True, False))\n"
        "walls = [cq.Workplane('XY').center(0, s * (W - t) / 2).box(L, t, H, centered=(True, True, False)) for s in (-1, 1)]\n"
        "walls += [cq.Workplane('XY').center(s * (L - t) / 2, 0).box(t, W, H, centered=(True, True, False)) for s in (-1, 1)]\n"
        "result = floor\n"
        "for w in walls:\n"
        "    result = result.union(w)\n"),
    holes=lambda p: 0,
))


# ----------------------------------------------------------------------------- 7. slot plate
def _slot_grid():
    out = []
    for L, W, T, s, w in _product(L=[50, 60, 80, 100, 120], W=[25, 30, 40, 50], T=[3, 4, 5, 6, 10],
                                  s=[15, 20, 30, 40, 60], w=[5, 6, 8, 10, 12]):
        if s + w <= L - 12 and w <= W - 12:
            out.append((L, W, T, s, w))
    return out


FAMILIES_LIST.append(Family(
    name="slot_plate", title="plate with a through slot",
    keys=("L", "W", "T", "s", "w"), grid=_slot_grid,
    spec=lambda p: (
        f"A rectangular plate {_g(p['L'])} mm (X) x {_g(p['W'])} mm (Y) x {_g(p['T'])} mm (Z), centred on the origin "
        f"in X and Y, bottom on z = 0, with one straight through-slot (along Z) with semicircular ends, centred on the "
        f"origin and running along X: slot width {_g(p['w'])} mm, distance between the two end-arc centres "
        f"{_g(p['s'])} mm (overall slot length {_g(p['s'] + p['w'])} mm)."),
    reference=lambda p: (
        "import cadquery as cq\n"
        f"result = (cq.Workplane('XY').box({p['L']}, {p['W']}, {p['T']}, centered=(True, True, False))\n"
        f"          .faces('>Z').workplane().slot2D({p['s'] + p['w']}, {p['w']}).cutThruAll())\n"),
    alternative=lambda p: (
        "import cadquery as cq\n"
        "# the slot as a box and two cylinders fused into one cutter\n"
        f"s, w, T = {p['s']}, {p['w']}, {p['T']}\n"
        f"plate = cq.Workplane('XY').rect({p['L']}, {p['W']}).extrude(T)\n"
        "mid = cq.Workplane('XY').workplane(offset=-1).rect(s, w).extrude(T + 2)\n"
        "ends = cq.Workplane('XY').workplane(offset=-1).pushPoints([(-s / 2, 0), (s / 2, 0)]).circle(w / 2).extrude(T + 2)\n"
        "result = plate.cut(mid.union(ends))\n"),
    holes=lambda p: 1,
))


# ----------------------------------------------------------------------------- 8. hex nut blank
def _hex_grid():
    out = []
    for F, T, d in _product(F=[7, 8, 10, 13, 16, 17, 19, 24, 30], T=[3, 4, 5, 6.5, 8, 10, 13, 16],
                            d=[3.3, 4.2, 5, 6.8, 8.5, 10.2, 14, 17.5]):
        if F >= d * 1.35 + 1 and F - d >= 3:
            out.append((F, T, d))
    return out


FAMILIES_LIST.append(Family(
    name="hex_nut", title="hexagonal nut blank",
    keys=("F", "T", "d"), grid=_hex_grid,
    spec=lambda p: (
        f"A hexagonal nut blank on the Z axis: a regular hexagonal prism {_g(p['F'])} mm across the flats, from z = 0 "
        f"to z = {_g(p['T'])}, with two of its corners on the X axis (so two flats are parallel to the X axis, at "
        f"y = +-{_g(p['F'] / 2)}), and a plain central through-hole of diameter {_g(p['d'])} mm (no thread, no chamfers)."),
    reference=lambda p: (
        "import cadquery as cq\n"
        f"across_corners = {p['F']} / 0.8660254037844386  # F / cos(30 deg)\n"
        f"result = cq.Workplane('XY').polygon(6, across_corners).extrude({p['T']}).faces('>Z').workplane().hole({p['d']})\n"),
    alternative=lambda p: (
        "import math\nimport cadquery as cq\n"
        "# explicit corner list and the bore as an inner circle of the same sketch\n"
        f"R = {p['F']} / math.sqrt(3)\n"
        "corners = [(R * math.cos(math.pi / 3 * i), R * math.sin(math.pi / 3 * i)) for i in range(6)]\n"
        f"result = cq.Workplane('XY').polyline(corners).close().circle({p['d'] / 2}).extrude({p['T']})\n"),
    holes=lambda p: 1,
))


# ----------------------------------------------------------------------------- 9. U-channel
def _channel_grid():
    out = []
    for L, W, H, t, tb in _product(L=[40, 60, 80, 100, 150], W=[20, 30, 40, 50], H=[15, 20, 30, 40],
                                   t=[2, 3, 4, 5], tb=[2, 3, 4, 6]):
        if W - 2 * t >= 8 and H - tb >= 6:
            out.append((L, W, H, t, tb))
    return out


FAMILIES_LIST.append(Family(
    name="u_channel", title="U-channel section",
    keys=("L", "W", "H", "t", "tb"), grid=_channel_grid,
    spec=lambda p: (
        f"A straight U-channel {_g(p['L'])} mm long along X (from x = {_g(-p['L'] / 2)} to x = {_g(p['L'] / 2)}), open "
        f"at the top. Its cross-section (in the YZ plane) is {_g(p['W'])} mm wide (Y, centred on y = 0) and "
        f"{_g(p['H'])} mm tall (z = 0 to {_g(p['H'])}); the two side walls are {_g(p['t'])} mm thick and the base is "
        f"{_g(p['tb'])} mm thick (the inner channel is {_g(p['W'] - 2 * p['t'])} mm wide, its floor at "
        f"z = {_g(p['tb'])})."),
    reference=lambda p: (
        "import cadquery as cq\n"
        f"outer = cq.Workplane('XY').box({p['L']}, {p['W']}, {p['H']}, centered=(True, True, False))\n"
        f"inner = cq.Workplane('XY').workplane(offset={p['tb']}).box({p['L'] + 2}, {p['W'] - 2 * p['t']}, {p['H']}, centered=(True, True, False))\n"
        "result = outer.cut(inner)\n"),
    alternative=lambda p: (
        "import cadquery as cq\n"
        "# the U profile drawn in the YZ plane and extruded symmetrically along X\n"
        f"W, H, t, tb = {p['W']}, {p['H']}, {p['t']}, {p['tb']}\n"
        "prof = [(-W / 2, 0), (W / 2, 0), (W / 2, H), (W / 2 - t, H), (W / 2 - t, tb), (-W / 2 + t, tb), (-W / 2 + t, H), (-W / 2, H)]\n"
        f"result = cq.Workplane('YZ').polyline(prof).close().extrude({p['L'] / 2}, both=True)\n"),
    holes=lambda p: 0,
))


FAMILIES: dict[str, Family] = {f.name: f for f in FAMILIES_LIST}
if len(FAMILIES) != len(FAMILIES_LIST):
    raise RuntimeError("duplicate CAD family names")
