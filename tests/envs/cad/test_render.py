"""The numpy view renderer and PNG writer of cad-v0: PNGs decode (with Pillow) to the exact pixels,
rasterised coverage matches the analytic area, the depth buffer keeps the nearest triangle, and a
rendered box covers its L x W footprint in the top view at the reported scale."""
from __future__ import annotations

import io

import numpy as np
import pytest

from envs.cad import render

PIL = pytest.importorskip("PIL.Image")


def decode(png: bytes) -> np.ndarray:
    return np.asarray(PIL.open(io.BytesIO(png)).convert("RGB"))


def test_png_round_trips_through_pillow():
    rng = np.random.default_rng(0)
    for h, w in [(1, 1), (7, 13), (64, 33)]:
        img = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        assert np.array_equal(decode(render.encode_png(img)), img)


def test_png_rejects_bad_arrays():
    with pytest.raises(ValueError, match="uint8"):
        render.encode_png(np.zeros((4, 4, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="shape"):
        render.encode_png(np.zeros((4, 4), dtype=np.uint8))


def coverage_reference(uv: np.ndarray, tri: tuple[int, int, int], h: int, w: int) -> np.ndarray:
    """Slow: test every pixel centre against the triangle with a cross-product sign check."""
    a, b, c = (uv[i] for i in tri)
    out = np.zeros((h, w), dtype=bool)

    def cross(o, p, q):
        return (p[0] - o[0]) * (q[1] - o[1]) - (p[1] - o[1]) * (q[0] - o[0])

    for y in range(h):
        for x in range(w):
            pt = (x + 0.5, y + 0.5)
            s = [cross(a, b, pt), cross(b, c, pt), cross(c, a, pt)]
            out[y, x] = all(v >= 0 for v in s) or all(v <= 0 for v in s)
    return out


def test_rasterize_coverage_matches_pixel_loop():
    rng = np.random.default_rng(1)
    h, w = 23, 31
    for _ in range(5):
        uv = rng.uniform(-3, 34, size=(3, 2))
        tris = np.array([[0, 1, 2]])
        z, v = render.rasterize(uv, np.zeros(3), tris, np.array([0.7]), h, w)
        want = coverage_reference(uv, (0, 1, 2), h, w)
        assert np.array_equal(np.isfinite(z), want)
        assert np.allclose(v[want], 0.7)


def test_rasterize_square_area_and_depth_order():
    # Two overlapping squares (two triangles each); the one with larger depth (nearer) must win.
    def square(x0, y0, x1, y1):
        return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], dtype=float)

    uv = np.vstack([square(2, 2, 22, 12), square(10, 5, 30, 25)])
    depth = np.array([1.0] * 4 + [2.0] * 4)
    tris = np.array([[0, 1, 2], [0, 2, 3], [4, 5, 6], [4, 6, 7]])
    vals = np.array([1.0, 1.0, 2.0, 2.0])
    z, v = render.rasterize(uv, depth, tris, vals, 32, 32, max_fragments=50)  # tiny chunks: chunking path
    assert int(np.isfinite(z).sum()) == 20 * 10 + 20 * 20 - 12 * 7  # union of the two areas
    assert (v == 2.0).sum() == 400 and (v == 1.0).sum() == 200 - 12 * 7
    fin = np.isfinite(z)
    assert np.allclose(z[fin], np.where(v == 2.0, 2.0, 1.0)[fin], atol=1e-12)


def box_mesh(lx: float, ly: float, lz: float):
    """An axis-aligned box [0, lx] x [0, ly] x [0, lz] as 12 triangles and its 12 edges."""
    v = np.array([[x, y, z] for x in (0, lx) for y in (0, ly) for z in (0, lz)], dtype=float)
    faces = [(0, 1, 3, 2), (4, 6, 7, 5), (0, 4, 5, 1), (2, 3, 7, 6), (0, 2, 6, 4), (1, 5, 7, 3)]
    tris = np.array([t for a, b, c, d in faces for t in ((a, b, c), (a, c, d))])
    edges = [np.array([v[i], v[j]]) for i in range(8) for j in range(i + 1, 8)
             if np.count_nonzero(v[i] != v[j]) == 1]
    return v, tris, edges


def test_top_view_of_a_box_covers_its_footprint():
    lx, ly, lz = 40.0, 20.0, 10.0
    v, t, e = box_mesh(lx, ly, lz)
    pic = render.render_views(v, t, e, panel=120)
    img = decode(pic.png)
    assert img.shape == (pic.height, pic.width, 3) == (241, 241, 3)
    assert pic.px_per_mm == pytest.approx(120 * (1 - 2 * 0.08) / lx)
    top = img[:120, :120]
    covered = np.any(top != 255, axis=2).sum()
    want = lx * ly * pic.px_per_mm ** 2
    assert covered == pytest.approx(want, rel=0.06)
    front = img[:120, 121:]
    assert np.any(front != 255, axis=2).sum() == pytest.approx(lx * lz * pic.px_per_mm ** 2, rel=0.08)


def test_render_views_rejects_bad_meshes():
    with pytest.raises(ValueError, match="vertices"):
        render.render_views(np.zeros((0, 3)), np.zeros((0, 3), dtype=int), [])
    with pytest.raises(ValueError, match="indices"):
        render.render_views(np.zeros((3, 3)), np.array([[0, 1, 5]]), [])
