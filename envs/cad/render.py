"""Pictures of parts for the model's image input: four shaded views of a triangle mesh, as a PNG.

Pure numpy (no OpenGL, no VTK, no matplotlib): the mesh comes from `kernel.geometry.mesh` in a
trusted worker, and this module only projects, rasterises with a depth buffer and encodes.

Layout of the image (2 x 2 panels of `panel` pixels, separated by a grey line):

    top-left:     top view,   looking down from +Z  (right = +X, up = +Y)
    top-right:    front view, looking from -Y       (right = +X, up = +Z)
    bottom-left:  right view, looking from +X       (right = +Y, up = +Z)
    bottom-right: isometric,  looking from (+1, -1, +1)

The three orthographic views share one scale (reported as `px_per_mm`) so sizes compare across
them; the isometric view is fitted on its own. Faces are shaded by the angle to a light fixed to the
camera, B-rep edges are drawn where visible (depth-tested), and silhouettes and depth jumps are
outlined. Short red / green / blue lines from the world origin mark +X / +Y / +Z (drawn on top).

`render_view` draws one of the four views alone, `size` x `size` pixels, fitted to the part (the agent's
`render_view` tool: a square of a size the policy's patch size divides). `drop_separator` turns a sheet into the
image a task prompt shows the policy: the same four panels without the separator line, `2 * panel` pixels square
(a multiple of the patch size when the panel is one).

What it does not do: hidden-line dashes, text labels or dimensions (the text spec carries those).
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

BACKGROUND = np.array([255, 255, 255], dtype=np.float64)
PART_RGB = np.array([165, 188, 214], dtype=np.float64)
EDGE_RGB = np.array([35, 35, 45], dtype=np.uint8)
AXIS_RGB = (np.array([220, 30, 30], np.uint8), np.array([20, 160, 40], np.uint8), np.array([30, 60, 230], np.uint8))
SEPARATOR_RGB = np.array([150, 150, 150], dtype=np.uint8)


@dataclass(frozen=True)
class View:
    name: str
    toward_camera: tuple[float, float, float]  # unit vector from the part to the camera (depth axis)
    right: tuple[float, float, float]
    up: tuple[float, float, float]


def _unit(v) -> tuple[float, float, float]:
    a = np.asarray(v, dtype=np.float64)
    a = a / np.linalg.norm(a)
    return (float(a[0]), float(a[1]), float(a[2]))


_ISO_C = _unit((1, -1, 1))
_ISO_R = _unit((1, 1, 0))
VIEWS = (
    View("top", (0.0, 0.0, 1.0), (1.0, 0.0, 0.0), (0.0, 1.0, 0.0)),
    View("front", (0.0, -1.0, 0.0), (1.0, 0.0, 0.0), (0.0, 0.0, 1.0)),
    View("right", (1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)),
    View("iso", _ISO_C, _ISO_R, _unit(np.cross(_ISO_C, _ISO_R))),
)


@dataclass(frozen=True)
class Picture:
    png: bytes
    width: int
    height: int
    px_per_mm: float  # scale of the three orthographic views


# ----------------------------------------------------------------------------- PNG
def encode_png(rgb_HW3: np.ndarray) -> bytes:
    """An 8-bit RGB PNG (PNG spec, ISO/IEC 15948): signature, IHDR, one zlib IDAT, IEND; filter 0."""
    if rgb_HW3.ndim != 3 or rgb_HW3.shape[2] != 3 or rgb_HW3.dtype != np.uint8:
        raise ValueError(f"encode_png needs a uint8 array of shape (H, W, 3), got {rgb_HW3.dtype} {rgb_HW3.shape}")
    h, w, _ = rgb_HW3.shape
    if h == 0 or w == 0:
        raise ValueError("encode_png: empty image")

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb_HW3.reshape(h, w * 3)], axis=1).tobytes()
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # bit depth 8, colour type 2 (RGB)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


# ----------------------------------------------------------------------------- rasterising
def rasterize(uv_N2: np.ndarray, depth_N: np.ndarray, tris_M3: np.ndarray, value_M: np.ndarray,
              height: int, width: int, max_fragments: int = 4_000_000) -> tuple[np.ndarray, np.ndarray]:
    """Depth-buffered fill of triangles; larger depth is nearer. Returns (depth_HW, value_HW).

    Pixels no triangle covers have depth -inf and value nan. A pixel is covered when its centre
    (x + 0.5, y + 0.5) lies in the triangle (barycentric test, edges inclusive).
    """
    zbuf = np.full(height * width, -np.inf)
    vbuf = np.full(height * width, np.nan)
    if len(tris_M3) == 0:
        return zbuf.reshape(height, width), vbuf.reshape(height, width)
    a, b, c = uv_N2[tris_M3[:, 0]], uv_N2[tris_M3[:, 1]], uv_N2[tris_M3[:, 2]]
    area = (b[:, 0] - a[:, 0]) * (c[:, 1] - a[:, 1]) - (b[:, 1] - a[:, 1]) * (c[:, 0] - a[:, 0])
    keep = np.abs(area) > 1e-12
    tri_ids = np.nonzero(keep)[0]
    lo = np.floor(np.minimum(np.minimum(a, b), c) - 0.5).astype(np.int64)
    hi = np.ceil(np.maximum(np.maximum(a, b), c) - 0.5).astype(np.int64) + 1
    x0 = np.clip(lo[:, 0], 0, width)
    x1 = np.clip(hi[:, 0], 0, width)
    y0 = np.clip(lo[:, 1], 0, height)
    y1 = np.clip(hi[:, 1], 0, height)
    bw, bh = x1 - x0, y1 - y0
    counts = np.where(keep, bw * bh, 0)
    # Chunks of triangles keep the fragment arrays bounded for big meshes.
    order = tri_ids
    start = 0
    pids, depths, vals = [], [], []
    while start < len(order):
        csum = np.cumsum(counts[order[start:]])
        stop = start + max(1, int(np.searchsorted(csum, max_fragments, side="right")))
        ids = order[start:stop]
        start = stop
        n = counts[ids]
        total = int(n.sum())
        if total == 0:
            continue
        t = np.repeat(ids, n)
        local = np.arange(total) - np.repeat(np.cumsum(n) - n, n)
        px = x0[t] + local % bw[t]
        py = y0[t] + local // bw[t]
        cx, cy = px + 0.5, py + 0.5
        # Barycentric weights from the signed sub-triangle areas.
        w_a = ((b[t, 0] - cx) * (c[t, 1] - cy) - (b[t, 1] - cy) * (c[t, 0] - cx)) / area[t]
        w_b = ((c[t, 0] - cx) * (a[t, 1] - cy) - (c[t, 1] - cy) * (a[t, 0] - cx)) / area[t]
        w_c = 1.0 - w_a - w_b
        inside = (w_a >= -1e-9) & (w_b >= -1e-9) & (w_c >= -1e-9)
        t, px, py = t[inside], px[inside], py[inside]
        d = (w_a[inside] * depth_N[tris_M3[t, 0]] + w_b[inside] * depth_N[tris_M3[t, 1]]
             + w_c[inside] * depth_N[tris_M3[t, 2]])
        pids.append(py * width + px)
        depths.append(d)
        vals.append(value_M[t])
    if pids:
        pid, dep, val = np.concatenate(pids), np.concatenate(depths), np.concatenate(vals)
        o = np.lexsort((-dep, pid))  # per pixel, nearest fragment first
        pid, dep, val = pid[o], dep[o], val[o]
        first = np.ones(len(pid), dtype=bool)
        first[1:] = pid[1:] != pid[:-1]
        zbuf[pid[first]] = dep[first]
        vbuf[pid[first]] = val[first]
    return zbuf.reshape(height, width), vbuf.reshape(height, width)


def _draw_points(img: np.ndarray, xy: np.ndarray, rgb: np.ndarray) -> None:
    h, w, _ = img.shape
    px = np.floor(xy[:, 0]).astype(np.int64)
    py = np.floor(xy[:, 1]).astype(np.int64)
    ok = (px >= 0) & (px < w) & (py >= 0) & (py < h)
    img[py[ok], px[ok]] = rgb


def _sample_segments(p_K2: np.ndarray, extra_K: np.ndarray, step: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """Points every `step` pixels along the polyline p (and the linearly interpolated extra value)."""
    seg = p_K2[1:] - p_K2[:-1]
    n = np.maximum(1, np.ceil(np.linalg.norm(seg, axis=1) / step).astype(np.int64))
    i = np.repeat(np.arange(len(seg)), n)
    f = (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)) / np.repeat(n, n)
    pts = p_K2[i] + seg[i] * f[:, None]
    ex = extra_K[i] + (extra_K[i + 1] - extra_K[i]) * f
    return np.vstack([pts, p_K2[-1:]]), np.concatenate([ex, extra_K[-1:]])


def _panel(verts_N3, tris_M3, lines, view: View, size: int, scale: float, center_3: np.ndarray) -> np.ndarray:
    c, r, u = (np.array(x) for x in (view.toward_camera, view.right, view.up))

    def project(p_K3: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = p_K3 - center_3
        uv = np.stack([size / 2 + (q @ r) * scale, size / 2 - (q @ u) * scale], axis=1)
        return uv, p_K3 @ c

    uv, depth = project(verts_N3)
    a, b, cc = verts_N3[tris_M3[:, 0]], verts_N3[tris_M3[:, 1]], verts_N3[tris_M3[:, 2]]
    nrm = np.cross(b - a, cc - a)
    nrm /= np.maximum(np.linalg.norm(nrm, axis=1, keepdims=True), 1e-300)
    light = np.array(_unit(c + 0.5 * r + 0.8 * u))
    shade = 0.45 + 0.55 * np.abs(nrm @ light)
    zbuf, vbuf = rasterize(uv, depth, tris_M3, shade, size, size)
    fg = np.isfinite(zbuf)
    img = np.where(fg[..., None], np.nan_to_num(vbuf)[..., None] * PART_RGB, BACKGROUND).astype(np.uint8)
    # Outlines: foreground next to background, or a depth jump of more than 3 pixels' worth.
    jump = 3.0 / scale
    z = np.where(fg, zbuf, -1e30)
    edge = np.zeros_like(fg)
    for dz in (z[1:, :] - z[:-1, :], z[:, 1:] - z[:, :-1]):
        big = np.abs(dz) > jump
        if dz.shape[0] != z.shape[0]:
            edge[1:, :] |= big
            edge[:-1, :] |= big
        else:
            edge[:, 1:] |= big
            edge[:, :-1] |= big
    img[edge & fg] = EDGE_RGB
    # B-rep edges, drawn where no face is nearer (tolerance: 1.5 px in depth units).
    eps = 1.5 / scale
    for pl in lines:
        if len(pl) < 2:
            continue
        luv, ld = project(pl)
        pts, d = _sample_segments(luv, ld)
        px = np.floor(pts[:, 0]).astype(np.int64)
        py = np.floor(pts[:, 1]).astype(np.int64)
        ok = (px >= 0) & (px < size) & (py >= 0) & (py < size)
        vis = np.zeros(len(px), dtype=bool)
        vis[ok] = d[ok] >= zbuf[py[ok], px[ok]] - eps
        img[py[vis], px[vis]] = EDGE_RGB
    # World axes from the origin.
    origin = np.zeros((1, 3))
    for k in range(3):
        tip = np.zeros((1, 3))
        tip[0, k] = 0.12 * size / scale
        puv, _ = project(np.vstack([origin, tip]))
        if np.linalg.norm(puv[1] - puv[0]) < 1.0:
            continue  # the axis points at the camera
        pts, _ = _sample_segments(puv, np.zeros(2))
        _draw_points(img, pts, AXIS_RGB[k])
    return img


VIEW_NAMES = tuple(v.name for v in VIEWS)


def render_view(verts_N3: np.ndarray, tris_M3: np.ndarray, lines: list[np.ndarray], view: str, size: int = 128,
                margin: float = 0.08) -> Picture:
    """One view (`VIEW_NAMES`) of the part, fitted to a `size` x `size` PNG (`px_per_mm` is this view's scale)."""
    by_name = {v.name: v for v in VIEWS}
    if view not in by_name:
        raise ValueError(f"unknown view {view!r}; views: {', '.join(VIEW_NAMES)}")
    verts_N3 = np.asarray(verts_N3, dtype=np.float64)
    tris_M3 = np.asarray(tris_M3, dtype=np.int64)
    if verts_N3.ndim != 2 or verts_N3.shape[1] != 3 or len(verts_N3) == 0:
        raise ValueError(f"render_view needs vertices of shape (N, 3), got {verts_N3.shape}")
    v = by_name[view]
    lo, hi = verts_N3.min(axis=0), verts_N3.max(axis=0)
    center = (lo + hi) / 2
    corners = np.array([[x, y, z] for x in (lo[0], hi[0]) for y in (lo[1], hi[1]) for z in (lo[2], hi[2])]) - center
    span = max(np.ptp(corners @ np.array(v.right)), np.ptp(corners @ np.array(v.up)), 1e-9)
    scale = size * (1 - 2 * margin) / span
    img = _panel(verts_N3, tris_M3, lines, v, size, scale, center)
    return Picture(png=encode_png(img), width=size, height=size, px_per_mm=float(scale))


def render_views(verts_N3: np.ndarray, tris_M3: np.ndarray, lines: list[np.ndarray], panel: int = 160,
                 margin: float = 0.08) -> Picture:
    """The 2 x 2 view sheet described in the module docstring, as a PNG."""
    verts_N3 = np.asarray(verts_N3, dtype=np.float64)
    tris_M3 = np.asarray(tris_M3, dtype=np.int64)
    if verts_N3.ndim != 2 or verts_N3.shape[1] != 3 or len(verts_N3) == 0:
        raise ValueError(f"render_views needs vertices of shape (N, 3), got {verts_N3.shape}")
    if tris_M3.ndim != 2 or tris_M3.shape[1] != 3 or (len(tris_M3) and (tris_M3.min() < 0 or tris_M3.max() >= len(verts_N3))):
        raise ValueError("render_views: triangles must be (M, 3) indices into the vertices")
    lo, hi = verts_N3.min(axis=0), verts_N3.max(axis=0)
    center = (lo + hi) / 2
    extent = float(max(np.max(hi - lo), 1e-9))
    usable = panel * (1 - 2 * margin)
    scale = usable / extent  # the largest box side fits every orthographic panel
    # Isometric: fit the projected extent of the box corners.
    corners = np.array([[x, y, z] for x in (lo[0], hi[0]) for y in (lo[1], hi[1]) for z in (lo[2], hi[2])]) - center
    iso = VIEWS[3]
    span = max(np.ptp(corners @ np.array(iso.right)), np.ptp(corners @ np.array(iso.up)), 1e-9)
    iso_scale = usable / span
    panels = [_panel(verts_N3, tris_M3, lines, v, panel, scale if v.name != "iso" else iso_scale, center)
              for v in VIEWS]
    sheet = np.zeros((2 * panel + 1, 2 * panel + 1, 3), dtype=np.uint8)
    sheet[:] = SEPARATOR_RGB
    sheet[:panel, :panel] = panels[0]
    sheet[:panel, panel + 1:] = panels[1]
    sheet[panel + 1:, :panel] = panels[2]
    sheet[panel + 1:, panel + 1:] = panels[3]
    return Picture(png=encode_png(sheet), width=sheet.shape[1], height=sheet.shape[0], px_per_mm=float(scale))


def drop_separator(sheet_HW3: np.ndarray) -> np.ndarray:
    """The `(2p+1) x (2p+1)` sheet `render_views` draws, without its separator row and column: the four panels
    abutting, `2p x 2p`, every panel pixel unchanged."""
    h, w = sheet_HW3.shape[:2]
    if sheet_HW3.ndim != 3 or h != w or h % 2 != 1 or h < 3:
        raise ValueError(f"drop_separator needs a (2p+1, 2p+1, C) view sheet, got shape {sheet_HW3.shape}")
    p = h // 2
    keep = np.r_[0:p, p + 1:h]
    return np.ascontiguousarray(sheet_HW3[keep][:, keep])
