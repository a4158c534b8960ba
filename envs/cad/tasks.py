"""Task generation for cad-v0: deterministic in (split, seed, index); held-out dimensions disjoint from train.

As in terminal-v0: each family's finite grid of variants (dimension tuples) is ranked by a hash of
(family, variant) and the first 20% are held out, so no held-out part shares its dimensions with
a train part; task `i` uses family `i mod F` and a `random.Random` seeded by (seed, split, family,
i). `Task.private["variant"]` records the variant for `check_env`.

Each task carries (JSON-serialisable, so it lives in an HF dataset):
  public["image_png_b64"]  the target rendered as four views (envs/cad/render.py), base64 PNG,
  public["image_views"]    the text describing that image's layout and scale,
  private["reference_code"] the family's CadQuery code (graded references are built from it),
  private["reference"]     the reference solid's volume, bounding box, faces and through-holes.
Pictures are rendered by the warm worker pool (envs/cad/worker.py) and cached per process by
reference code, so regenerating the same tasks does not render twice.

`prompt_image(public)` is the picture as the policy's prompt carries it (`CadEnv(prompt_views=True)`): the
sheet without its separator line, `PROMPT_IMAGE_PX` square, a multiple of the 16-pixel patch (400 patches).
The task rows keep only the base64 sheet in `public` (a row does not carry `Message.images`).
"""
from __future__ import annotations

import base64
import concurrent.futures
import functools
import random
import threading
from typing import Any, Mapping

from envs.cad.families import FAMILIES, Family
from envs.splits import split_by_hash
from envs.splits import variant_key as _variant_key
from jointrl.records import Limits, Message, Task

ENV_ID = "cad-v0"
HELDOUT_FRACTION = 0.2
DEFAULT_N = {"train": 60 * len(FAMILIES), "heldout": 12 * len(FAMILIES)}
LIMITS = Limits(max_turns=12, tool_timeout_s=60.0, episode_timeout_s=900.0, max_obs_chars=4000, max_arg_chars=20_000)
PANEL_PX = 160
# The prompt's picture: the 2 x 2 panels without the 1-pixel separator (render.drop_separator).
PROMPT_IMAGE_PX = 2 * PANEL_PX

SYSTEM_PROMPT = (
    "You are a mechanical CAD engineer. Build the part described by the user as a solid with CadQuery 2.8 "
    "(Python), using the tools:\n"
    "- `run_cad(code)` runs your code in a sandbox and reports on the solid it built (volume, bounding box, number "
    "of faces and of through-holes) or the error;\n"
    "- `submit(code)` runs your final code and ends the episode; that solid is graded.\n"
    "Rules for the code: `cadquery` is available as `cq` (you may also `import cadquery as cq`); assign the finished "
    "part to a variable named `result` (a cq.Workplane or cq.Shape holding one solid). Units are millimetres and Z "
    "points up. Build the part in the exact position the description gives (absolute coordinates): the grade is the "
    "volume overlap (intersection over union) with the target, multiplied by a feature score for the number of "
    "through-holes, the number of faces and the bounding box. Each run has a time limit; there is no network.")


def variant_key(family: Family, variant: tuple) -> str:
    return _variant_key(family.name, variant)


def split_variants(family: Family) -> dict[str, list[tuple]]:
    return split_by_hash(family.name, family.variants(), HELDOUT_FRACTION, min_variants=5)


_SPLITS: dict[str, dict[str, list[tuple]]] = {}
_PICTURES: dict[str, dict] = {}  # reference code -> rendered picture + reference summary
_PIC_LOCK = threading.Lock()


def _splits(family: Family) -> dict[str, list[tuple]]:
    if family.name not in _SPLITS:
        _SPLITS[family.name] = split_variants(family)
    return _SPLITS[family.name]


def image_views_text(px_per_mm: float) -> str:
    return ("The attached image shows the target part in four views on a 2x2 grid: top-left, the top view (looking "
            "down from +Z; right is +X, up is +Y); top-right, the front view (looking from -Y; right is +X, up is +Z); "
            "bottom-left, the right view (looking from +X; right is +Y, up is +Z); bottom-right, an isometric view from "
            f"(+1, -1, +1). The three orthographic views share one scale, {px_per_mm:.3g} pixels per mm. Short red, "
            "green and blue lines start at the origin and point along +X, +Y and +Z.")


def _pictures(codes: list[str], pool=None) -> dict[str, dict]:
    """Render every code not in the cache (in parallel over the pool's workers)."""
    with _PIC_LOCK:
        todo = sorted({c for c in codes if c not in _PICTURES})
    if todo:
        if pool is None:
            from envs.cad.worker import default_pool

            pool = default_pool()

        def one(code: str) -> tuple[str, dict]:
            r = pool.render(code, panel=PANEL_PX)
            return code, {"png_b64": base64.b64encode(r.png).decode(), "px_per_mm": r.px_per_mm,
                          "reference": {"volume": r.volume, "bbox": list(r.bbox), "faces": r.faces, "holes": r.holes}}

        with concurrent.futures.ThreadPoolExecutor(max_workers=pool.size) as ex:
            done = list(ex.map(one, todo))
        with _PIC_LOCK:
            _PICTURES.update(done)
    with _PIC_LOCK:
        return {c: _PICTURES[c] for c in codes}


@functools.lru_cache(maxsize=512)
def _prompt_image(sheet_b64: str) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    from envs.cad.render import drop_separator, encode_png

    try:
        sheet_HW3 = np.asarray(Image.open(io.BytesIO(base64.b64decode(sheet_b64, validate=True))).convert("RGB"))
    except (ValueError, OSError) as e:  # bad base64 (binascii.Error is a ValueError), bytes Pillow cannot read
        raise ValueError(f"CAD task public['image_png_b64'] is not a base64 PNG ({type(e).__name__}: {e})") from None
    if sheet_HW3.shape[:2] != (PROMPT_IMAGE_PX + 1, PROMPT_IMAGE_PX + 1):
        raise ValueError(f"CAD task public['image_png_b64'] is a {sheet_HW3.shape[1]}x{sheet_HW3.shape[0]} image; expected "
                         f"the {PROMPT_IMAGE_PX + 1}x{PROMPT_IMAGE_PX + 1} view sheet (panels of {PANEL_PX} px)")
    return encode_png(drop_separator(sheet_HW3))


def prompt_image(public: Mapping[str, Any]) -> bytes:
    """PNG of the target's four views for the task prompt: the task's sheet (`public["image_png_b64"]`)
    without its separator, `PROMPT_IMAGE_PX` square. ValueError naming the key when the task has no sheet or
    it is not the sheet `make_tasks` renders."""
    b64 = public.get("image_png_b64")
    if not isinstance(b64, str) or not b64:
        raise ValueError("CAD task public['image_png_b64'] is missing: the task carries no picture of the target")
    return _prompt_image(b64)


def _plan(split: str, seed: int, index: int) -> tuple[Family, tuple]:
    families = list(FAMILIES.values())
    family = families[index % len(families)]
    rng = random.Random(f"{ENV_ID}:{seed}:{split}:{family.name}:{index}")
    return family, rng.choice(_splits(family)[split])


def make_tasks(split: str, seed: int = 0, n: int | None = None, *, pool=None) -> list[Task]:
    if split not in DEFAULT_N:
        raise ValueError(f"unknown split {split!r}; splits are: {', '.join(DEFAULT_N)}")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0 or None, got {n}")
    count = DEFAULT_N[split] if n is None else n
    plans = [_plan(split, seed, i) for i in range(count)]
    codes = [fam.reference(fam.params(v)) for fam, v in plans]
    pics = _pictures(codes, pool) if codes else {}
    tasks = []
    for i, ((family, variant), code) in enumerate(zip(plans, codes)):
        p = family.params(variant)
        pic = pics[code]
        user = (f"Build this part: {family.title}.\n\n{family.spec(p)}\n\n{image_views_text(pic['px_per_mm'])}")
        tasks.append(Task(
            id=f"{ENV_ID}/{split}/s{seed}/{i:05d}-{family.name}",
            domain="cad",
            prompt=(Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=user)),
            public={"family": family.name, "image_png_b64": pic["png_b64"], "image_views": image_views_text(pic["px_per_mm"]),
                    "px_per_mm": pic["px_per_mm"]},
            private={"family": family.name, "variant": variant_key(family, variant), "params": p,
                     "reference_code": code, "reference": pic["reference"]},
            limits=LIMITS,
            thinking="high",
            split=split,
        ))
    return tasks
