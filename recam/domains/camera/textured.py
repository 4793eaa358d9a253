"""Textured synthetic world: procedural rooms of boxes and spheres, ray-cast at realistic resolution.

The sphere world (recam.domains.camera.world) is built for landmark PnP at 32 x 32 px; a structure-from-motion
reward (SIFT features, matching, mapping) needs something else: surfaces covered in non-repeating texture, at a
resolution where detectors find hundreds of keypoints per frame. Each scene here is a closed room (floor, ceiling,
four walls) holding 4-6 boxes (some turned about the vertical axis) and 1-2 spheres, 3-8 units in front of the world
camera around a scene centre 4-5 units ahead. Because the room is closed and every trajectory keeps its cameras inside
it and clear of the objects (:func:`trajectory_is_clear`), every pixel of every frame sees textured geometry.

Rendering (:func:`render_textured`) casts one ray per pixel per frame in numpy; each surface has its own procedural
texture (coarse colour fields, multi-octave value noise, stripes, anti-aliased blotches) in surface-fixed coordinates,
so texture moves rigidly with the geometry, and a fixed directional light shades it (Lambertian plus ambient), so
differently oriented faces differ in brightness. Shading and texture filtering depend only on the surface point and the
viewing ray's length and angle, so a point seen twice from the same distance and angle renders the same colour: a
pure rotation of the camera gives frames related by the homography K R K^-1 (up to resampling).

Conventions are the sphere world's: world-to-camera [R|t] (F, 3, 4) in OpenCV axes, world frame = the first source
camera (source_cams[0] = [I|0]), videos (3, F, H, W) float32 in [-1, 1], pixel (row i, col j) centred at u = j, v = i.
Intrinsics: :func:`textured_intrinsics`, fx = fy = 0.9 W (58 degree horizontal field of view).

Trajectories are the sphere world's families (world.trajectory_c2w); :func:`family_trajectory` gives a deterministic
one per family ("pan", "orbit+dolly", "static", ...), :func:`sample_family` a random one for dataset items.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import cv2
import numpy as np
import torch

from recam.domains.camera.world import (
    _AMOUNT_RANGES,
    _ROTATION_KINDS,
    _TRANSLATION_KINDS,
    TRAJECTORY_KINDS,
    Condition,
    SeededWorld,
    _look_at_c2w,
    _motion_phrase,
    condition_from_trajectories,
    trajectory_c2w,
)

FOCAL_FACTOR = 0.9  # fx = fy = FOCAL_FACTOR * W
DEGRADATIONS = ("clean", "blur", "noise", "lowres")
BLUR_SIGMA_PX = 1.5
NOISE_SIGMA = 0.04  # in [0, 1] intensity units
STATIC = "static"

# Texels per world unit. Objects are seen from 1.5-8 units, the room's far walls from ~10, so objects get twice the
# room's density; mip-mapping removes what a pixel cannot resolve.
_ROOM_DENSITY = 48.0
_OBJECT_DENSITY = 96.0
_MAX_LEVELS = 8
_AMBIENT = 0.45
# Closest a camera may come to an object (world units): closer, one face fills the frame and SfM has little else to
# match. Walls and floor are large and seen at grazing angles, so they may come closer.
MIN_OBJECT_CLEARANCE = 0.9
MIN_ROOM_CLEARANCE = 0.3
_EPS = 1e-4


def textured_intrinsics(height: int, width: int) -> torch.Tensor:
    """Pinhole K (3, 3): fx = fy = 0.9 W, principal point ((W - 1) / 2, (H - 1) / 2)."""
    if height < 4 or width < 4:
        raise ValueError(f"height and width must be >= 4, got {height}x{width}")
    f = FOCAL_FACTOR * width
    return torch.tensor([[f, 0.0, (width - 1) / 2.0], [0.0, f, (height - 1) / 2.0], [0.0, 0.0, 1.0]],
                        dtype=torch.float32)


def scale_intrinsics(K, scale: float):
    """K (..., 3, 3) of an image resized by `scale` (torch or numpy; the same type back).

    Pixel centres sit at integer coordinates, so pixel j spans [j - 0.5, j + 0.5]; resizing scales positions measured
    from the image's edge, u + 0.5, hence u' = (u + 0.5) s - 0.5 -- the convention cv2.resize follows.
    """
    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale}")
    out = K.clone() if isinstance(K, torch.Tensor) else np.array(K, dtype=np.float64, copy=True)
    if out.shape[-2:] != (3, 3):
        raise ValueError(f"K must be (..., 3, 3), got {tuple(out.shape)}")
    out[..., :2, :2] = out[..., :2, :2] * scale
    out[..., :2, 2] = (out[..., :2, 2] + 0.5) * scale - 0.5
    return out


# ----------------------------------------------------------------------------------------------------
# procedural textures


def _random_colours(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 3) RGB in [0, 1]: random hues, mid-to-high saturation and value, so no surface is grey or black."""
    hsv = np.stack([rng.uniform(0, 360, n), rng.uniform(0.3, 0.9, n), rng.uniform(0.35, 0.95, n)], axis=1)
    return cv2.cvtColor(hsv.astype(np.float32)[None], cv2.COLOR_HSV2RGB)[0]


def _value_noise(rng: np.random.Generator, h: int, w: int, period: float) -> np.ndarray:
    """(h, w) float32 smooth noise with features ~`period` texels across: a random lattice, bicubically upsampled."""
    period = max(float(period), 1.5)
    gh, gw = int(math.ceil(h / period)) + 3, int(math.ceil(w / period)) + 3
    grid = rng.standard_normal((gh, gw)).astype(np.float32)
    big = cv2.resize(grid, (max(w, int(round(gw * period))), max(h, int(round(gh * period)))),
                     interpolation=cv2.INTER_CUBIC)
    # A random crop offset keeps lattice points from lining up with the texture's edges on every surface.
    y0 = int(rng.integers(0, big.shape[0] - h + 1))
    x0 = int(rng.integers(0, big.shape[1] - w + 1))
    return big[y0:y0 + h, x0:x0 + w]


def _fbm(rng: np.random.Generator, h: int, w: int, periods: Sequence[float]) -> np.ndarray:
    """Zero-mean, unit-std sum of value-noise octaves; coarser octaves weigh more (amplitude ~ period^0.5)."""
    out = np.zeros((h, w), np.float32)
    for p in periods:
        out += _value_noise(rng, h, w, p) * float(max(p, 1.5)) ** 0.5
    return (out - out.mean()) / max(float(out.std()), 1e-6)


def _make_texture(rng: np.random.Generator, h: int, w: int, density: float) -> np.ndarray:
    """(h, w, 3) float32 in [0, 1]: one surface's texture, `density` texels per world unit.

    Layers, each for a reason: two colours mixed by coarse noise (large-scale structure, so views far apart still
    share features); optional warped stripes (strong oriented edges); anti-aliased coloured blotches (blob and corner
    features at several scales); multi-octave luminance noise down to 3 texels (fine detail, so even close views are
    not smooth). Nothing is periodic, so features match unambiguously.
    """
    cols = _random_colours(rng, 4)
    coarse = _fbm(rng, h, w, [2.0 * density, 0.8 * density])
    t = (1.0 / (1.0 + np.exp(-2.0 * coarse)))[..., None]
    img = cols[0] * (1 - t) + cols[1] * t
    if rng.random() < 0.5:
        angle = rng.uniform(0, math.pi)
        period = rng.uniform(0.12, 0.4) * density
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        phase = (xx * math.cos(angle) + yy * math.sin(angle)) * (2 * math.pi / period) + 2.5 * coarse
        stripe = (np.clip(2.5 * np.sin(phase), -1, 1) * 0.225 + 0.225)[..., None]
        img = img * (1 - stripe) + cols[2] * stripe
    canvas = np.clip(img * 255.0, 0, 255).astype(np.uint8)
    area = (h / density) * (w / density)
    n_blotches = int(area * rng.uniform(8, 16)) + 3
    blotch_cols = np.concatenate([cols, _random_colours(rng, 4)])
    for _ in range(n_blotches):
        centre = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        size = rng.uniform(0.015, 0.12) * density * (3.0 if rng.random() < 0.1 else 1.0)
        axes = (max(1, int(size)), max(1, int(size * rng.uniform(0.3, 1.0))))
        colour = tuple(float(c) for c in (blotch_cols[rng.integers(0, len(blotch_cols))] * 255.0))
        cv2.ellipse(canvas, centre, axes, float(rng.uniform(0, 180)), 0, 360, colour, -1, cv2.LINE_AA)
    detail = _fbm(rng, h, w, [0.3 * density, 0.1 * density, 6.0, 3.0])
    gain = np.float32(rng.uniform(0.2, 0.35))
    out = canvas.astype(np.float32) * (np.float32(1 / 255) * (1.0 + gain * detail[..., None]))
    return np.clip(out, 0.0, 1.0)


# ----------------------------------------------------------------------------------------------------
# scenes


@dataclass
class Box:
    """Oriented box: centre (3,), rotation (3, 3) local-to-world (a turn about the vertical axis), half sizes (3,)."""

    centre: np.ndarray
    rotation: np.ndarray
    half: np.ndarray


@dataclass
class Ball:
    """Sphere: centre (3,), radius, rotation (3, 3) local-to-world: the frame its cube-mapped texture turns with."""

    centre: np.ndarray
    radius: float
    rotation: np.ndarray


@dataclass
class TexturedScene:
    """A room [room_lo, room_hi] (axis-aligned, world units) with boxes and balls.

    Surfaces: ids 0-5 the room's faces (axis * 2 + side, side 1 = the max face), then 6 per box (same order), then
    6 per ball (its cube map's faces, same order in the ball's frame). Planar surfaces are p = origin + u * axis_u +
    v * axis_v with u in [0, size_u], v in [0, size_v]; `normal` points toward the space cameras are in. Texture mip
    levels of all surfaces are packed in `atlas` (T, 3) float32; level l of surface s starts at level_offset[s, l]
    and is level_width[s, l] x level_height[s, l] texels.
    """

    scene_id: int
    centre: np.ndarray
    room_lo: np.ndarray
    room_hi: np.ndarray
    boxes: list[Box]
    balls: list[Ball]
    light: np.ndarray  # unit vector toward the light
    plane_origin: np.ndarray  # (P, 3) planar surfaces only
    plane_u: np.ndarray
    plane_v: np.ndarray
    normal: np.ndarray  # (S, 3); zero for balls' faces (their normal varies)
    density: np.ndarray  # (S,)
    num_levels: np.ndarray  # (S,)
    level_offset: np.ndarray  # (S, _MAX_LEVELS) int64, last level repeated
    level_width: np.ndarray
    level_height: np.ndarray
    atlas: np.ndarray

    def __post_init__(self) -> None:
        # Per-surface float32 columns, for the renderer's gathers (one per pixel each); balls' faces get zeros.
        S, P = len(self.normal), len(self.plane_origin)

        def columns(a: np.ndarray) -> list[np.ndarray]:
            full = np.zeros((S, 3), np.float32)
            full[: len(a)] = a
            return [np.ascontiguousarray(full[:, k]) for k in range(3)]

        self.num_planes = P
        self.tables = {"origin": columns(self.plane_origin), "u": columns(self.plane_u), "v": columns(self.plane_v),
                       "normal": columns(self.normal), "density": self.density.astype(np.float32),
                       "top_level": (self.num_levels - 1).astype(np.float32)}

    def description(self) -> str:
        nb, ns = len(self.boxes), len(self.balls)
        return f"a textured room with {nb} box{'es' if nb != 1 else ''} and {ns} sphere{'s' if ns != 1 else ''}"


def _face_frames(lo: np.ndarray, hi: np.ndarray, inward: bool):
    """Per face (axis * 2 + side) of the axis-aligned box [lo, hi]: (origin, axis_u, axis_v, normal, size_u, size_v)
    in the box's own frame."""
    faces = []
    for axis in range(3):
        b, c = [a for a in range(3) if a != axis]
        for side in range(2):
            origin = lo.copy()
            origin[axis] = hi[axis] if side else lo[axis]
            n = np.zeros(3)
            n[axis] = 1.0 if side else -1.0
            if inward:
                n = -n
            eu, ev = np.eye(3)[b], np.eye(3)[c]
            faces.append((origin, eu, ev, n, hi[b] - lo[b], hi[c] - lo[c]))
    return faces


def _rot_y(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])


def make_textured_scene(scene_id: int, seed: int = 0) -> TexturedScene:
    """Seeded room: 4-6 boxes and 1-2 spheres on the floor, 3-8.5 units ahead of the world camera, mostly inside its
    initial field of view, not overlapping."""
    rng = np.random.default_rng([seed, scene_id, 0x7E47])
    centre = np.array([0.0, 0.0, rng.uniform(4.0, 5.0)])
    floor = rng.uniform(1.4, 1.9)  # y points down: the floor is below the camera at +y
    room_lo = np.array([-rng.uniform(5.5, 7.0), -rng.uniform(2.2, 3.0), -rng.uniform(3.5, 4.5)])
    room_hi = np.array([rng.uniform(5.5, 7.0), floor, rng.uniform(10.0, 12.5)])

    # Footprints (x, z, radius) on the floor, rejection-sampled apart from each other.
    n_boxes, n_balls = int(rng.integers(4, 7)), int(rng.integers(1, 3))
    placed: list[tuple[float, float, float]] = []
    boxes: list[Box] = []
    balls: list[Ball] = []
    tries = 0
    while len(boxes) + len(balls) < n_boxes + n_balls:
        tries += 1
        if tries > 5_000:
            raise RuntimeError(f"could not place objects for textured scene {scene_id}")
        is_box = len(boxes) < n_boxes
        if is_box:
            half = np.array([rng.uniform(0.25, 0.7), rng.uniform(0.3, 1.1), rng.uniform(0.25, 0.7)])
            radius = float(np.hypot(half[0], half[2]))
        else:
            radius = float(rng.uniform(0.35, 0.7))
        z = rng.uniform(3.0 + radius, 8.5)
        x = rng.uniform(-1.0, 1.0) * 0.5 * z  # within the world camera's horizontal field of view (tan 29 deg)
        if any(math.hypot(x - px, z - pz) < radius + pr + 0.25 for px, pz, pr in placed):
            continue
        placed.append((x, z, radius))
        if is_box:
            yaw = 0.0 if rng.random() < 0.3 else rng.uniform(-math.pi / 4, math.pi / 4)
            # Sunk 5 cm into the floor, so no crack shows between box and floor.
            boxes.append(Box(np.array([x, floor - half[1] + 0.05, z]), _rot_y(yaw), half))
        else:
            q, r = np.linalg.qr(rng.standard_normal((3, 3)))
            q = q * np.sign(np.diag(r))
            if np.linalg.det(q) < 0:
                q[:, 0] = -q[:, 0]
            balls.append(Ball(np.array([x, floor - radius + 0.02, z]), radius, q))

    light = np.array([rng.uniform(-0.6, 0.6), -1.0, rng.uniform(-0.9, -0.2)])
    light /= np.linalg.norm(light)

    # Surfaces: (origin, u, v, normal, size_u, size_v, density) for planes; balls appended after.
    planes = [(*f, _ROOM_DENSITY) for f in _face_frames(room_lo, room_hi, inward=True)]
    for box in boxes:
        for o, eu, ev, n, su, sv in _face_frames(-box.half, box.half, inward=False):
            R = box.rotation
            planes.append((box.centre + R @ o, R @ eu, R @ ev, R @ n, su, sv, _OBJECT_DENSITY))
    # Balls are cube-mapped (six faces of side 2r each): unlike longitude/latitude, no pole pinches the texture.
    sizes = [(p[4], p[5], p[6]) for p in planes] + [(2 * b.radius, 2 * b.radius, _OBJECT_DENSITY)
                                                    for b in balls for _ in range(6)]
    pyramids = []
    for su, sv, dens in sizes:
        w, h = max(2, int(math.ceil(su * dens))), max(2, int(math.ceil(sv * dens)))
        levels = [_make_texture(rng, h, w, dens)]
        while len(levels) < _MAX_LEVELS and min(levels[-1].shape[:2]) > 4:
            levels.append(cv2.pyrDown(levels[-1]))
        pyramids.append(levels)
    S = len(pyramids)
    offset = np.zeros((S, _MAX_LEVELS), np.int64)
    width = np.zeros((S, _MAX_LEVELS), np.int64)
    height = np.zeros((S, _MAX_LEVELS), np.int64)
    chunks, pos = [], 0
    for s, levels in enumerate(pyramids):
        for lv in range(_MAX_LEVELS):
            if lv < len(levels):
                chunks.append(levels[lv].reshape(-1, 3))
                offset[s, lv], height[s, lv], width[s, lv] = pos, levels[lv].shape[0], levels[lv].shape[1]
                pos += levels[lv].shape[0] * levels[lv].shape[1]
            else:  # past the coarsest level: repeat it, so lookups need no per-surface clamp
                offset[s, lv], height[s, lv], width[s, lv] = offset[s, lv - 1], height[s, lv - 1], width[s, lv - 1]
    normals = np.concatenate([np.stack([p[3] for p in planes]), np.zeros((6 * len(balls), 3))])
    return TexturedScene(
        scene_id=scene_id, centre=centre, room_lo=room_lo, room_hi=room_hi, boxes=boxes, balls=balls, light=light,
        plane_origin=np.stack([p[0] for p in planes]), plane_u=np.stack([p[1] for p in planes]),
        plane_v=np.stack([p[2] for p in planes]), normal=normals, density=np.array([s[2] for s in sizes]),
        num_levels=np.array([len(p) for p in pyramids]), level_offset=offset, level_width=width,
        level_height=height, atlas=np.concatenate(chunks).astype(np.float32),
    )


def camera_clearance(scene: TexturedScene, c2w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distances (F,) from each camera centre to the room's walls and to the nearest object (box or ball); negative
    when the camera is outside the room or inside an object."""
    p = np.asarray(c2w, dtype=np.float64)[:, :3, 3]
    room = np.minimum(p - scene.room_lo, scene.room_hi - p).min(axis=1)
    objects = np.full(len(p), np.inf)
    for box in scene.boxes:
        q = np.abs((p - box.centre) @ box.rotation) - box.half
        sdf = np.linalg.norm(np.maximum(q, 0.0), axis=1) + np.minimum(q.max(axis=1), 0.0)
        objects = np.minimum(objects, sdf)
    for ball in scene.balls:
        objects = np.minimum(objects, np.linalg.norm(p - ball.centre, axis=1) - ball.radius)
    return room, objects


def trajectory_is_clear(scene: TexturedScene, c2w: np.ndarray) -> bool:
    """Every camera inside the room (MIN_ROOM_CLEARANCE from its walls) and MIN_OBJECT_CLEARANCE from every object,
    so every pixel sees textured geometry and no object fills the frame."""
    room, objects = camera_clearance(scene, c2w)
    return bool(room.min() >= MIN_ROOM_CLEARANCE and objects.min() >= MIN_OBJECT_CLEARANCE)


# ----------------------------------------------------------------------------------------------------
# rendering


def _screen_rect(corners: np.ndarray, R: np.ndarray, tr: np.ndarray, K: np.ndarray, height: int, width: int):
    """Pixel window (row slice, column slice) holding every pixel whose ray can meet the convex hull of `corners`
    (world (M, 3)); None when the hull is behind the camera or off the image; the whole image when it straddles the
    camera's plane (its projection is then unbounded)."""
    pc = corners @ R.T + tr
    if (pc[:, 2] <= 0).all():
        return None
    if (pc[:, 2] < 1e-3).any():
        return slice(0, height), slice(0, width)
    proj = pc @ K.T
    u, v = proj[:, 0] / proj[:, 2], proj[:, 1] / proj[:, 2]
    # Pixel centres are at integer coordinates; one pixel of margin absorbs float32 round-off in the ray casts.
    c0, c1 = max(0, math.floor(u.min()) - 1), min(width, math.floor(u.max()) + 2)
    r0, r1 = max(0, math.floor(v.min()) - 1), min(height, math.floor(v.max()) + 2)
    if c0 >= c1 or r0 >= r1:
        return None
    return slice(r0, r1), slice(c0, c1)


def _box_corners(centre: np.ndarray, rotation: np.ndarray, half: np.ndarray) -> np.ndarray:
    signs = np.array([[sx, sy, sz] for sx in (-1, 1) for sy in (-1, 1) for sz in (-1, 1)], dtype=np.float64)
    return centre + (signs * half) @ rotation.T


def _pick3(ax: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    return np.where(ax == 0, a, np.where(ax == 1, b, c))


def _intersect(scene: TexturedScene, o: np.ndarray, d: tuple[np.ndarray, np.ndarray, np.ndarray], R: np.ndarray,
               tr: np.ndarray, K: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest hit of the rays o + t d (d: three (H, W) float32 components, not normalised) -> t (H, W) float32 and
    surface id (H, W), -1 where nothing is hit. Boxes and balls are only tested inside their projected windows."""
    dx, dy, dz = d
    H, W = dx.shape
    f32 = np.float32
    inside = bool(np.all(o > scene.room_lo) and np.all(o < scene.room_hi))
    if not inside:
        return np.full((H, W), np.inf, f32), np.full((H, W), -1, np.int64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # From inside the room every ray leaves through one face: that of the axis whose wall it reaches first.
        # Distance over |speed| keeps t = +inf (never -inf) for a ray parallel to a wall, whatever the sign of zero.
        ts = [np.where(c > 0, f32(hi - oc), f32(oc - lo)) / np.abs(c)
              for c, oc, lo, hi in zip(d, o, scene.room_lo, scene.room_hi, strict=True)]
        t_best = np.minimum(np.minimum(ts[0], ts[1]), ts[2])
        ax = np.where(ts[0] == t_best, 0, np.where(ts[1] == t_best, 1, 2))
        surf = ax * 2 + (_pick3(ax, dx, dy, dz) > 0)

        base = 6
        for box in scene.boxes:
            rect = _screen_rect(_box_corners(box.centre, box.rotation, box.half), R, tr, K, H, W)
            if rect is not None:
                rx, ry, rz = dx[rect], dy[rect], dz[rect]
                ol = (o - box.centre) @ box.rotation
                rb = box.rotation.astype(f32)
                tmins, tmaxs, dls = [], [], []
                for a in range(3):
                    dl = rb[0, a] * rx + rb[1, a] * ry + rb[2, a] * rz  # ray direction in the box's frame
                    inv = f32(1.0) / dl
                    t1 = f32(-box.half[a] - ol[a]) * inv
                    t2 = f32(box.half[a] - ol[a]) * inv
                    tmins.append(np.minimum(t1, t2))
                    tmaxs.append(np.maximum(t1, t2))
                    dls.append(dl)
                tnear = np.maximum(np.maximum(tmins[0], tmins[1]), tmins[2])
                tfar = np.minimum(np.minimum(tmaxs[0], tmaxs[1]), tmaxs[2])
                tb, sb = t_best[rect], surf[rect]  # views: writes land in t_best / surf
                hit = (tnear <= tfar) & (tnear > _EPS) & (tnear < tb)
                if hit.any():
                    bax = np.where(tmins[0] == tnear, 0, np.where(tmins[1] == tnear, 1, 2))[hit]
                    # A ray travelling toward -axis enters through the + face.
                    side = _pick3(bax, dls[0][hit], dls[1][hit], dls[2][hit]) < 0
                    tb[hit] = tnear[hit]
                    sb[hit] = base + bax * 2 + side
            base += 6

        for k, ball in enumerate(scene.balls):
            cube = _box_corners(ball.centre, np.eye(3), np.full(3, ball.radius))
            rect = _screen_rect(cube, R, tr, K, H, W)
            if rect is None:
                continue
            rx, ry, rz = dx[rect], dy[rect], dz[rect]
            oc = o - ball.centre
            b = f32(oc[0]) * rx + f32(oc[1]) * ry + f32(oc[2]) * rz
            dd = rx * rx + ry * ry + rz * rz
            disc = b * b - dd * f32(oc @ oc - ball.radius ** 2)
            t = (-b - np.sqrt(np.maximum(disc, 0))) / dd
            tb, sb = t_best[rect], surf[rect]
            hit = (disc > 0) & (t > _EPS) & (t < tb)
            tb[hit] = t[hit]
            sb[hit] = scene.num_planes + 6 * k  # the cube-map face is picked when shading
    return t_best, surf


def _sample_level(scene: TexturedScene, surf: np.ndarray, level: np.ndarray, u: np.ndarray, v: np.ndarray):
    """Bilinear texture lookup (N, 3) of surfaces `surf` at mip `level`, surface coordinates (u, v) in world units."""
    density = scene.tables["density"][surf]
    shrink = np.exp2(-level.astype(np.float32))
    w = scene.level_width[surf, level]
    h = scene.level_height[surf, level]
    off = scene.level_offset[surf, level]
    # Level-0 texel j spans [j, j + 1) in u * density. cv2.pyrDown keeps the even samples of the smoothed level
    # above, so texel i of level l is centred on level-0 texel 2^l i, at 2^l i + 0.5: not at 2^l (i + 0.5), which
    # would shift the texture by half a pixel whenever the mip level changes between views.
    x = (u * density - 0.5) * shrink
    y = (v * density - 0.5) * shrink
    x0 = np.floor(x)
    y0 = np.floor(y)
    fx = (x - x0)[:, None]
    fy = (y - y0)[:, None]
    x0 = x0.astype(np.int64)
    y0 = y0.astype(np.int64)
    xa, xb = np.clip(x0, 0, w - 1), np.clip(x0 + 1, 0, w - 1)
    ya, yb = np.clip(y0, 0, h - 1) * w + off, np.clip(y0 + 1, 0, h - 1) * w + off
    A = scene.atlas
    top = A[ya + xa] * (1 - fx) + A[ya + xb] * fx
    bottom = A[yb + xa] * (1 - fx) + A[yb + xb] * fx
    return top * (1 - fy) + bottom * fy


def _shade(scene: TexturedScene, o: np.ndarray, d: tuple[np.ndarray, ...], t: np.ndarray, surf: np.ndarray,
           fx: float) -> np.ndarray:
    """Colours (N, 3) in [0, 1] at the hit points of rays o + t d (d: three (N,) components; every ray hits)."""
    tab = scene.tables
    p = [np.float32(oc) + t * c for oc, c in zip(o, d, strict=True)]
    n = [tab["normal"][a][surf] for a in range(3)]
    rel = [p[a] - tab["origin"][a][surf] for a in range(3)]
    u = rel[0] * tab["u"][0][surf] + rel[1] * tab["u"][1][surf] + rel[2] * tab["u"][2][surf]
    v = rel[0] * tab["v"][0][surf] + rel[1] * tab["v"][1][surf] + rel[2] * tab["v"][2][surf]
    if scene.balls:
        surf = surf.copy()
    for k, ball in enumerate(scene.balls):
        base = scene.num_planes + 6 * k
        ib = np.flatnonzero(surf == base)
        if not len(ib):
            continue
        offset = np.stack([p[a][ib] for a in range(3)], axis=1) - ball.centre.astype(np.float32)
        normal = offset / np.linalg.norm(offset, axis=1, keepdims=True)
        for a in range(3):
            n[a][ib] = normal[:, a]
        local = normal @ ball.rotation.astype(np.float32)  # the texture's frame turns with the ball
        # Cube map: the dominant axis picks the face, the other two (divided by it) are its coordinates in [-1, 1].
        major = np.argmax(np.abs(local), axis=1)
        rows = np.arange(len(ib))
        m = local[rows, major]
        ua = local[rows, (major + 1) % 3] / np.abs(m)
        va = local[rows, (major + 2) % 3] / np.abs(m)
        surf[ib] = base + major * 2 + (m > 0)
        u[ib] = (ua + 1) * np.float32(ball.radius)
        v[ib] = (va + 1) * np.float32(ball.radius)

    # Mip level from the pixel's footprint on the surface, distance / (fx cos(incidence)): it depends only on the
    # ray's length and angle to the surface, not on where the pixel is in the image, so it is the same from any
    # camera at the same place (a pure rotation renders the same colours).
    ray_len = np.sqrt(d[0] * d[0] + d[1] * d[1] + d[2] * d[2])
    cos = np.abs(n[0] * d[0] + n[1] * d[1] + n[2] * d[2]) / ray_len
    footprint = t * ray_len / (np.float32(fx) * np.maximum(cos, np.float32(0.25)))
    lod = np.log2(np.maximum(footprint * tab["density"][surf], np.float32(1e-6)))
    top_level = tab["top_level"][surf]
    lod = np.clip(lod, np.float32(0.0), top_level)
    l0 = lod.astype(np.int64)  # lod >= 0, so truncation is floor
    frac = (lod - l0)[:, None]
    l1 = np.minimum(l0 + 1, top_level.astype(np.int64))
    colour = _sample_level(scene, surf, l0, u, v) * (1 - frac) + _sample_level(scene, surf, l1, u, v) * frac
    light = scene.light.astype(np.float32)
    lambert = np.maximum(n[0] * light[0] + n[1] * light[1] + n[2] * light[2], np.float32(0.0))
    return colour * (np.float32(_AMBIENT) + np.float32(1 - _AMBIENT) * lambert)[:, None]


def render_textured(scene: TexturedScene, cams, K, height: int, width: int, return_depth: bool = False):
    """Render a trajectory: cams (F, 3, 4) world-to-camera, K (3, 3) -> video (3, F, H, W) float32 in [-1, 1].

    With return_depth, also depth (F, H, W) float32: the hit's z in each camera's frame, inf where a ray hits
    nothing (only possible with a camera outside the room; such pixels are black).
    """
    cams = np.asarray(torch.as_tensor(cams, dtype=torch.float64))
    K = np.asarray(torch.as_tensor(K, dtype=torch.float64))
    if cams.ndim != 3 or cams.shape[-2:] != (3, 4):
        raise ValueError(f"cams must be (F, 3, 4), got {cams.shape}")
    if K.shape != (3, 3):
        raise ValueError(f"K must be (3, 3), got {K.shape}")
    if height < 1 or width < 1:
        raise ValueError(f"height and width must be positive, got {height}x{width}")
    F = cams.shape[0]
    v, u = np.meshgrid(np.arange(height, dtype=np.float64), np.arange(width, dtype=np.float64), indexing="ij")
    pix = np.stack([u, v, np.ones_like(u)], axis=-1)
    rays_cam = pix @ np.linalg.inv(K).T  # z = 1, so the ray parameter t is the hit's depth
    video = np.zeros((F, height * width, 3), np.float32)
    depth = np.full((F, height, width), np.inf, np.float32)
    for f in range(F):
        R, tr = cams[f, :, :3], cams[f, :, 3]
        o = -R.T @ tr
        # World direction R^T d_cam, component by component (each (H, W), float32).
        d = tuple((rays_cam @ R[:, a]).astype(np.float32) for a in range(3))
        t, surf = _intersect(scene, o, d, R, tr, K)
        depth[f] = t
        t, surf = t.ravel(), surf.ravel()
        hit = np.flatnonzero(surf >= 0)
        if len(hit) == len(surf):
            video[f] = _shade(scene, o, tuple(c.ravel() for c in d), t, surf, K[0, 0])
        elif len(hit):
            video[f, hit] = _shade(scene, o, tuple(c.ravel()[hit] for c in d), t[hit], surf[hit], K[0, 0])
    out = np.clip(video, 0.0, 1.0).reshape(F, height, width, 3) * 2.0 - 1.0
    out = torch.from_numpy(np.ascontiguousarray(out.transpose(3, 0, 1, 2)))
    if return_depth:
        return out, torch.from_numpy(depth)
    return out


# ----------------------------------------------------------------------------------------------------
# trajectories


def parse_family(kind: str) -> list[str]:
    """"static" -> []; "pan" -> ["pan"]; "orbit+dolly" -> ["orbit", "dolly"] (distinct known kinds)."""
    if kind == STATIC:
        return []
    kinds = kind.split("+")
    unknown = [k for k in kinds if k not in TRAJECTORY_KINDS]
    if unknown or len(set(kinds)) != len(kinds):
        raise ValueError(f"unknown trajectory family {kind!r}: use {STATIC!r}, one of {TRAJECTORY_KINDS}, "
                         "or different ones joined by '+' (e.g. 'orbit+dolly')")
    return kinds


def _family_amounts(kinds: list[str], sign: float, amount) -> list[float]:
    if amount is None:
        # Mid-range, and 0.8x for mixes, as the sphere world's sampler does.
        scale = 0.8 if len(kinds) > 1 else 1.0
        return [sign * scale * 0.5 * sum(_AMOUNT_RANGES[k]) for k in kinds]
    amounts = [float(amount)] * len(kinds) if np.ndim(amount) == 0 else [float(a) for a in amount]
    if len(kinds) > 1 and np.ndim(amount) == 0:
        raise ValueError(f"a mix ({'+'.join(kinds)}) needs one amount per motion, got the scalar {amount}")
    if len(amounts) != len(kinds):
        raise ValueError(f"{len(kinds)} motion(s) but {len(amounts)} amount(s)")
    return [sign * a for a in amounts]


def family_trajectory(kind: str, num_frames: int, centre, sign: float = 1.0, amount=None,
                      start_c2w: np.ndarray | None = None) -> np.ndarray:
    """Deterministic camera-to-world poses (F, 4, 4) of one trajectory family.

    kind: "static", one of world.TRAJECTORY_KINDS, or a mix "a+b". amount: None = the middle of
    world._AMOUNT_RANGES (0.8x for a mix), else a float (single kind) or one float per motion (radians or world units,
    world._motion_local's signs); `sign` multiplies it. centre: the point orbit / zoom use. start_c2w: first pose
    (identity when None).
    """
    kinds = parse_family(kind)
    start = np.eye(4) if start_c2w is None else np.asarray(start_c2w, dtype=np.float64)
    amounts = _family_amounts(kinds, float(sign), amount)
    return trajectory_c2w(start, kinds, amounts, np.asarray(centre, dtype=np.float64), num_frames)


def family_phrase(kind: str, amounts: Sequence[float]) -> str:
    kinds = parse_family(kind)
    if not kinds:
        return "static camera"
    return " and ".join(_motion_phrase(k, a) for k, a in zip(kinds, amounts, strict=True))


def sample_family(rng: np.random.Generator, scene: TexturedScene, start_c2w: np.ndarray, num_frames: int,
                  exclude: tuple[str, ...] = (), mix_prob: float = 0.3) -> tuple[np.ndarray, str, str]:
    """Random trajectory as the sphere world draws them (a kind, or with probability mix_prob a rotation + a
    translation; amounts uniform in world._AMOUNT_RANGES, random signs, 0.8x for mixes), redrawn and shrunk until
    trajectory_is_clear. Returns (c2w (F, 4, 4), kind, caption phrase)."""
    for attempt in range(60):
        if rng.random() < mix_prob:
            kinds = [str(rng.choice(_ROTATION_KINDS)), str(rng.choice(_TRANSLATION_KINDS))]
        else:
            kinds = [str(rng.choice(TRAJECTORY_KINDS))]
        if any(k in exclude for k in kinds):
            continue
        shrink = 0.85 ** (attempt // 4)
        amounts = [float(rng.uniform(*_AMOUNT_RANGES[k]) * rng.choice([-1.0, 1.0]) * shrink
                         * (0.8 if len(kinds) > 1 else 1.0)) for k in kinds]
        c2w = trajectory_c2w(start_c2w, kinds, amounts, scene.centre, num_frames)
        if trajectory_is_clear(scene, c2w):
            kind = "+".join(kinds)
            return c2w, kind, family_phrase(kind, amounts)
    raise RuntimeError(f"no trajectory keeps clear of the objects in textured scene {scene.scene_id}")


# ----------------------------------------------------------------------------------------------------
# dataset


def make_textured_condition(scene: TexturedScene, split: str, cond_index: int, seed: int = 0, num_frames: int = 16,
                            height: int = 256, width: int = 448) -> Condition:
    """Condition `cond_index` of a scene, as world.make_condition builds them: the source trajectory starts at the
    world origin, the target (of a different kind) at a pose near it, re-aimed near the scene centre."""
    rng = np.random.default_rng([seed, scene.scene_id, 0x7C0D, cond_index])
    K = textured_intrinsics(height, width)
    src_c2w, src_kind, _ = sample_family(rng, scene, np.eye(4), num_frames)
    start_pos = rng.uniform([-0.25, -0.15, -0.25], [0.25, 0.15, 0.25])
    aim = scene.centre + rng.uniform([-0.3, -0.2, -0.3], [0.3, 0.2, 0.3])
    tgt_c2w, tgt_kind, phrase = sample_family(rng, scene, _look_at_c2w(start_pos, aim), num_frames,
                                              exclude=tuple(src_kind.split("+")))
    return condition_from_trajectories(
        split, scene.scene_id, cond_index, f"{phrase} in {scene.description()}", src_c2w, tgt_c2w, K,
        lambda cams: render_textured(scene, cams, K, height, width), torch.zeros(0, 3), torch.zeros(0, 3),
        tgt_kind, src_kind)


class TexturedWorld(SeededWorld):
    """Seeded dataset of textured-room `Condition`s with SyntheticWorld's interface and split scene ranges
    (world.SeededWorld). At 16 x 256 x 448 a cached item holds ~44 MB of video. Scenes (textures ~20-40 MB) are
    rebuilt on demand; the last two are kept.
    """

    _SCENES_KEPT = 2

    def __init__(self, split: str, num_conditions: int, seed: int = 0, num_frames: int = 16, height: int = 256,
                 width: int = 448, conditions_per_scene: int = 4) -> None:
        super().__init__(split, num_conditions, seed, num_frames, conditions_per_scene)
        if height < 8 or width < 8:
            raise ValueError(f"height and width must be >= 8, got {height}x{width}")
        self.height = height
        self.width = width
        self._scenes: OrderedDict[int, TexturedScene] = OrderedDict()

    def scene(self, scene_id: int) -> TexturedScene:
        """The scene behind items (geometry, textures): for ground-truth checks."""
        if scene_id in self._scenes:
            self._scenes.move_to_end(scene_id)
        else:
            self._scenes[scene_id] = make_textured_scene(scene_id, self.seed)
            while len(self._scenes) > self._SCENES_KEPT:
                self._scenes.popitem(last=False)
        return self._scenes[scene_id]

    def scene_description(self, scene_id: int) -> str:
        return self.scene(scene_id).description()

    def _make(self, i: int) -> Condition:
        return make_textured_condition(self.scene(self.scene_id(i)), self.split, i % self.conditions_per_scene,
                                       self.seed, self.num_frames, self.height, self.width)


# ----------------------------------------------------------------------------------------------------
# degradations


def degrade(video, kind: str, seed: int = 0):
    """Degrade a video for robustness tests -> (video, scale).

    video: either the Condition format, a torch (3, F, H, W) float tensor in [-1, 1], or frames as numpy uint8
    (F, H, W, 3) (what feature extractors read); it comes back in the same format and dtype. kind:
      - "clean": unchanged (the same object);
      - "blur": Gaussian blur, sigma 1.5 px, each frame;
      - "noise": additive Gaussian noise, sigma 0.04 of the full intensity range, seeded by `seed`, clipped;
      - "lowres": half resolution (cv2.INTER_AREA); H and W must be even.
    scale: the factor the image was resized by (0.5 for lowres, else 1.0); pass it to scale_intrinsics(K, scale).
    """
    if kind not in DEGRADATIONS:
        raise ValueError(f"kind must be one of {DEGRADATIONS}, got {kind!r}")
    is_tensor = isinstance(video, torch.Tensor)
    if is_tensor:
        if video.ndim != 4 or video.shape[0] != 3:
            raise ValueError(f"video tensor must be (3, F, H, W), got {tuple(video.shape)}")
        frames = ((video.detach().float().cpu().permute(1, 2, 3, 0).numpy() + 1.0) * 0.5).astype(np.float32)
    else:
        video = np.asarray(video)
        if video.dtype != np.uint8 or video.ndim != 4 or video.shape[-1] != 3:
            raise ValueError(f"numpy video must be uint8 (F, H, W, 3), got {video.dtype} {video.shape}")
        frames = video.astype(np.float32) / 255.0
    if kind == "clean":
        return video, 1.0
    scale = 1.0
    if kind == "blur":
        frames = np.stack([cv2.GaussianBlur(fr, (0, 0), BLUR_SIGMA_PX) for fr in frames])
    elif kind == "noise":
        rng = np.random.default_rng([seed, 0xD15])
        frames = np.clip(frames + rng.normal(0.0, NOISE_SIGMA, frames.shape).astype(np.float32), 0.0, 1.0)
    else:
        h, w = frames.shape[1:3]
        if h % 2 or w % 2:
            raise ValueError(f"lowres needs even H and W (an exact 0.5 scale), got {h}x{w}")
        frames = np.stack([cv2.resize(fr, (w // 2, h // 2), interpolation=cv2.INTER_AREA) for fr in frames])
        scale = 0.5
    if is_tensor:
        out = torch.from_numpy(np.ascontiguousarray(frames.transpose(3, 0, 1, 2))) * 2.0 - 1.0
        return out.to(video.dtype), scale
    return np.clip(np.round(frames * 255.0), 0, 255).astype(np.uint8), scale
