"""cad-primitive-v0: one primitive solid with its dimensions given, the first rung of the CAD curriculum.

Same sandbox, runner, grader and rubric as cad-v0 (envs/cad/domain.py): the episode is a `CadDomain`
and the rung's one tool delegates to its `submit`, so the agent's code runs in the same bubblewrap
sandbox and the exported solid is graded after `kill_all()` by the same trusted workers,

    score = IoU x (holes_ok + faces_ok + bbox_ok) / 3      (docs/cad.md, "Grading")

against the reference solid built from `Task.private["reference_code"]`. What differs:

* the tasks: three families of single primitives, every dimension in whole or half millimetres,
  stated in the prompt in the order the reference code (`import cadquery as cq` and one line) takes them:
    box        `cq.Workplane('XY').box(L, W, H)`
    cylinder   `cq.Workplane(P).cylinder(H, R)`, axis along Z, X or Y (workplane XY, YZ or XZ)
    box_hole   `cq.Workplane('XY').box(L, W, H).faces('>Z').workplane().hole(D)`, a central
               through-hole along Z
  each either centred at the origin or (axis Z only) resting on z = 0, which the code says with
  `centered=(True, True, False)`. What the policy must read from the prompt: the family, the axis,
  the placement and 3-4 numbers; the reference is one `submit` call (the import and one expression).
* only `submit` is offered (no `run_cad`): one tool schema instead of two keeps the prompt short,
  and a run of `run_cad` costs a cadquery import in the sandbox (~2 s idle, 5-7 s on a loaded
  machine) that these one-line parts do not need. `max_turns` leaves room to retry after a malformed call.
* no picture: the policy is text-only and the picture of cad-v0 costs prompt text (its layout
  description) and a render per task; task generation here is pure Python (no worker).

Splits: the variant is the dimension tuple; each family's grid is split by hash (envs/splits.py),
20% held out, so no held-out task uses a dimension tuple of a train task of its family. The pose
(axis, placement) is drawn per task from the task's own seeded RNG, like terminal's file contents.

This module does not grade, sandbox or run code itself: that is CadDomain's, reused as it is.
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Callable, Mapping

from envs.base import Domain, ToolEnv, ToolInvocation, ToolOutput
from envs.cad.domain import CadDomain
from envs.cad.families import _g
from envs.splits import split_by_hash, variant_key
from envs.tools import ToolContext, tool
from jointrl.records import Limits, Message, Task

ENV_ID = "cad-primitive-v0"
HELDOUT_FRACTION = 0.2
# 100 train / 80 held-out tasks per family. A paired comparison resolves a gain d at t >= 3 with
# n >= (3 sd_d / d)^2 tasks; the per-task sd of two RL-trained arms' difference reached 0.58 here
# (docs/training.md, attempt 14), so 240 tasks resolve ~11 points. Tasks are made by index, so the
# first 150 are the held-out tasks of the earlier 150-task split.
DEFAULT_N = {"train": 300, "heldout": 240}
# One submit; max_turns leaves two retries after malformed calls. A submit imports cadquery in the
# sandbox (~2 s idle, 5-7 s at load average 11), so the tool keeps cad-v0's 60 s.
LIMITS = Limits(max_turns=3, tool_timeout_s=60.0, episode_timeout_s=240.0, max_obs_chars=2000, max_arg_chars=4000)

SYSTEM_PROMPT = (
    "Build the solid the user describes with CadQuery. Call `submit` once with Python code that assigns the part to "
    "`result`. Units are mm, Z points up; place the part exactly as described (it is compared with the target in "
    "absolute coordinates).")
# The grading worker runs the reference as a script (no `cq` predefined, unlike the sandbox's runner),
# so every reference starts with the import, as cad-v0's do.
IMPORT = "import cadquery as cq\n"

# Dimension grids (mm): whole numbers with a few halves, so that copying a number is the skill, not arithmetic.
SIDES = (6, 8, 10, 12, 12.5, 15, 16, 18, 20, 22.5, 24, 25, 28, 30, 32, 35, 40, 45, 50, 60)
RADII = (3, 4, 5, 6, 7.5, 8, 10, 12, 14, 15, 16, 18, 20, 22, 24, 25, 28, 30)
HEIGHTS = SIDES + (5, 14, 36, 42, 48, 55, 70, 80)  # cylinders: a longer list, their grid has only two axes
HOLE_DIAMETERS = (3, 4, 5, 6, 8, 10, 12, 14, 16, 20)
MIN_WALL = 3.0  # box_hole: material left on each side of the hole


@dataclass(frozen=True)
class Pose:
    """Where a primitive sits: `plane` is the CadQuery workplane whose normal is the part's axis
    ('XY': Z, 'YZ': X, 'XZ': Y); `on_floor` puts its base on z = 0 (axis Z only), else it is centred
    at the origin."""

    plane: str
    on_floor: bool

    @property
    def axis(self) -> int:
        return {"XY": 2, "YZ": 0, "XZ": 1}[self.plane]


CENTRED_Z = Pose("XY", False)
FLOOR_Z = Pose("XY", True)
CENTRED_X = Pose("YZ", False)
CENTRED_Y = Pose("XZ", False)
_AXIS_NAME = "XYZ"


@dataclass(frozen=True)
class Summary:
    """The reference solid's measures, from the formulas (the tests check them against the kernel)."""

    volume: float
    bbox: tuple[float, float, float, float, float, float]  # xmin, ymin, zmin, xmax, ymax, zmax
    faces: int
    holes: int

    def to_dict(self) -> dict:
        return {"volume": self.volume, "bbox": list(self.bbox), "faces": self.faces, "holes": self.holes}


@dataclass(frozen=True)
class Primitive:
    """One family of the rung: a grid of dimension tuples, the poses a task may draw, and for a
    (dims, pose): the prompt text, the reference code, another construction of the same solid
    (tests only) and its analytic summary."""

    name: str
    keys: tuple[str, ...]
    grid: tuple[tuple[float, ...], ...]
    poses: tuple[Pose, ...]
    spec: Callable[[dict, Pose], str]
    reference: Callable[[dict, Pose], str]
    alternative: Callable[[dict, Pose], str]
    summary: Callable[[dict, Pose], Summary]

    def params(self, variant: tuple[float, ...]) -> dict[str, float]:
        if len(variant) != len(self.keys):
            raise ValueError(f"primitive {self.name}: variant {variant!r} does not have {len(self.keys)} values {self.keys}")
        return dict(zip(self.keys, variant))


def _placement(pose: Pose) -> str:
    if pose.on_floor:
        return "its base on the XY plane (z = 0), centred on the Z axis"
    return "centred at the origin"


def _centred(pose: Pose) -> str:
    """The `centered` argument the reference passes (empty for CadQuery's default, centred on all axes)."""
    return ", centered=(True, True, False)" if pose.on_floor else ""


def _bbox(size: tuple[float, float, float], pose: Pose) -> tuple[float, float, float, float, float, float]:
    lo = [-s / 2 for s in size]
    hi = [s / 2 for s in size]
    if pose.on_floor:
        lo[2], hi[2] = 0.0, size[2]
    return (lo[0], lo[1], lo[2], hi[0], hi[1], hi[2])


def _z0(h: float, pose: Pose) -> float:
    return 0.0 if pose.on_floor else -h / 2


def _box_text(p: dict) -> str:
    return f"A rectangular box {_g(p['L'])} mm along X, {_g(p['W'])} mm along Y and {_g(p['H'])} mm along Z"


BOX = Primitive(
    name="box", keys=("L", "W", "H"),
    grid=tuple(itertools.product(SIDES, SIDES, SIDES)),
    poses=(CENTRED_Z, FLOOR_Z),
    spec=lambda p, pose: f"{_box_text(p)}, {_placement(pose)}.",
    reference=lambda p, pose: IMPORT + f"result = cq.Workplane('XY').box({_g(p['L'])}, {_g(p['W'])}, {_g(p['H'])}{_centred(pose)})",
    alternative=lambda p, pose: (f"result = cq.Solid.makeBox({p['L']}, {p['W']}, {p['H']}, "
                                 f"cq.Vector({-p['L'] / 2}, {-p['W'] / 2}, {_z0(p['H'], pose)}))"),
    summary=lambda p, pose: Summary(p["L"] * p["W"] * p["H"], _bbox((p["L"], p["W"], p["H"]), pose), 6, 0),
)


def _cylinder_size(p: dict, pose: Pose) -> tuple[float, float, float]:
    size = [2 * p["R"]] * 3
    size[pose.axis] = p["H"]
    return (size[0], size[1], size[2])


def _cylinder_alternative(p: dict, pose: Pose) -> str:
    direction = [0.0, 0.0, 0.0]
    direction[pose.axis] = 1.0
    base = [0.0, 0.0, 0.0]
    base[pose.axis] = _z0(p["H"], pose)
    return (f"result = cq.Solid.makeCylinder({p['R']}, {p['H']}, cq.Vector(*{tuple(base)}), "
            f"cq.Vector(*{tuple(direction)}))")


CYLINDER = Primitive(
    name="cylinder", keys=("H", "R"),
    grid=tuple(itertools.product(HEIGHTS, RADII)),
    poses=(CENTRED_Z, FLOOR_Z, CENTRED_X, CENTRED_Y),
    spec=lambda p, pose: (f"A cylinder of height {_g(p['H'])} mm and radius {_g(p['R'])} mm, its axis along "
                          f"{_AXIS_NAME[pose.axis]}, {_placement(pose)}."),
    reference=lambda p, pose: IMPORT + f"result = cq.Workplane('{pose.plane}').cylinder({_g(p['H'])}, {_g(p['R'])}{_centred(pose)})",
    alternative=_cylinder_alternative,
    summary=lambda p, pose: Summary(math.pi * p["R"] ** 2 * p["H"], _bbox(_cylinder_size(p, pose), pose), 3, 0),
)


def _hole_grid() -> tuple[tuple[float, ...], ...]:
    return tuple((L, W, H, D) for L, W, H, D in itertools.product(SIDES, SIDES, SIDES, HOLE_DIAMETERS)
                 if D + 2 * MIN_WALL <= min(L, W))


BOX_HOLE = Primitive(
    name="box_hole", keys=("L", "W", "H", "D"),
    grid=_hole_grid(),
    poses=(CENTRED_Z, FLOOR_Z),
    spec=lambda p, pose: (f"{_box_text(p)}, {_placement(pose)}, with a through-hole of diameter {_g(p['D'])} mm "
                          "along Z through its centre."),
    reference=lambda p, pose: (IMPORT + f"result = cq.Workplane('XY').box({_g(p['L'])}, {_g(p['W'])}, {_g(p['H'])}{_centred(pose)})"
                               f".faces('>Z').workplane().hole({_g(p['D'])})"),
    alternative=lambda p, pose: (f"result = (cq.Workplane('XY').rect({p['L']}, {p['W']}).circle({p['D'] / 2})"
                                 f".extrude({p['H']}).translate((0, 0, {_z0(p['H'], pose)})))"),
    summary=lambda p, pose: Summary(p["L"] * p["W"] * p["H"] - math.pi * (p["D"] / 2) ** 2 * p["H"],
                                    _bbox((p["L"], p["W"], p["H"]), pose), 7, 1),
)

PRIMITIVES: dict[str, Primitive] = {f.name: f for f in (BOX, CYLINDER, BOX_HOLE)}

_SPLITS: dict[str, dict[str, list[tuple]]] = {}


def split_variants(family: Primitive) -> dict[str, list[tuple]]:
    if family.name not in _SPLITS:
        _SPLITS[family.name] = split_by_hash(family.name, list(family.grid), HELDOUT_FRACTION, min_variants=20)
    return _SPLITS[family.name]


def make_task(split: str, seed: int, index: int) -> Task:
    families = list(PRIMITIVES.values())
    family = families[index % len(families)]
    rng = random.Random(f"{ENV_ID}:{seed}:{split}:{family.name}:{index}")
    variant = rng.choice(split_variants(family)[split])
    pose = rng.choice(family.poses)
    p = family.params(variant)
    return Task(
        id=f"{ENV_ID}/{split}/s{seed}/{index:05d}-{family.name}",
        domain="cad",
        prompt=(Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=family.spec(p, pose))),
        public={"family": family.name},
        private={"family": family.name, "variant": variant_key(family.name, variant), "params": p,
                 "pose": {"plane": pose.plane, "on_floor": pose.on_floor},
                 "reference_code": family.reference(p, pose), "reference": family.summary(p, pose).to_dict()},
        limits=LIMITS,
        thinking="low",
        split=split,
    )


def make_tasks(split: str, seed: int = 0, n: int | None = None) -> list[Task]:
    if split not in DEFAULT_N:
        raise ValueError(f"unknown split {split!r}; splits are: {', '.join(DEFAULT_N)}")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0 or None, got {n}")
    return [make_task(split, seed, i) for i in range(DEFAULT_N[split] if n is None else n)]


class PrimitiveDomain(Domain):
    """cad-v0's domain behind one tool: set-up, grading and the rubric are the wrapped CadDomain's."""

    rubric = CadDomain.rubric

    def __init__(self, cad: CadDomain) -> None:
        self.cad = cad

    def setup(self, task: Task) -> None:
        self.cad.setup(task)

    @tool(ends_episode=True)
    def submit(self, code: str, ctx: ToolContext) -> ToolOutput:
        """Run CadQuery code and submit the solid it builds for grading. Ends the episode.

        Args:
            code: Python code using cadquery that assigns the part to `result`
        """
        return self.cad.submit(code, ctx)

    def before_grade(self) -> None:
        self.cad.before_grade()

    def check(self, task: Task, transcript: tuple[Message, ...]) -> Mapping[str, float]:
        return self.cad.check(task, transcript)

    def teardown(self) -> None:
        self.cad.teardown()

    def reference(self, task: Task) -> list[ToolInvocation]:
        return self.cad.reference(task)

    def noop(self, task: Task) -> list[ToolInvocation]:
        return self.cad.noop(task)


def make_env(*, backend=None, sandbox_limits=None, pool=None, **env_kwargs) -> ToolEnv:
    """`envs.make("cad-primitive-v0", backend=..., sandbox_limits=..., pool=..., limits=..., max_calls_per_turn=...)`."""
    kw = {} if sandbox_limits is None else {"sandbox_limits": sandbox_limits}
    return ToolEnv(PrimitiveDomain(CadDomain(backend=backend, pool=pool, families=tuple(PRIMITIVES), **kw)), **env_kwargs)
