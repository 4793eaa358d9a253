"""Synthetic multi-camera world: a cheap, honest stand-in for ReCamMaster's multi-camera data.

Each scene is a handful of coloured spheres ("landmarks") floating 3-6 units in front of the first
source camera, over a low-contrast sky/ground background that depends on the viewing direction (so
rotations are visible even where no landmark is). Every landmark has its own saturated colour from a
fixed palette (corners of the RGB cube except black), so a camera-accuracy reward can find it by
colour and solve PnP against the known 3D positions without ever looking at the generator.

Conventions (shared with the rest of the project):
  - cameras are world-to-camera extrinsics [R|t], (F, 3, 4), OpenCV axes (x right, y down,
    z forward); the world frame is the first source camera's frame, so source_cams[0] = [I | 0];
  - intrinsics K (3, 3) are shared by all frames: fx = fy = W, principal point at the image centre
    in OpenCV's pixel convention (pixel (row i, col j) has its centre at u = j, v = i, so
    cx = (W - 1) / 2);
  - videos are (3, F, H, W) float32 in [-1, 1].

Zoom: a focal-length change cannot be expressed in extrinsics and K is shared by all frames, so
"zoom" is rendered as a translation of the camera toward (zoom in) or away from (zoom out) the scene
centre it looks at; unlike "dolly", which moves along the optical axis, it is aimed at the target.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

# Corners of the RGB cube except black: pairwise distance >= 1, so even blurred or background-mixed
# pixels are assigned to the right landmark by nearest colour.
PALETTE = np.array(
    [
        [1.0, 0.0, 0.0],  # red
        [0.0, 1.0, 0.0],  # green
        [0.0, 0.0, 1.0],  # blue
        [1.0, 1.0, 0.0],  # yellow
        [1.0, 0.0, 1.0],  # magenta
        [0.0, 1.0, 1.0],  # cyan
        [1.0, 1.0, 1.0],  # white
    ],
    dtype=np.float64,
)
PALETTE_NAMES = ("red", "green", "blue", "yellow", "magenta", "cyan", "white")

TRAJECTORY_KINDS = ("pan", "tilt", "roll", "dolly", "truck", "pedestal", "orbit", "zoom")
_ROTATION_KINDS = ("pan", "tilt", "roll", "orbit")
_TRANSLATION_KINDS = ("dolly", "truck", "pedestal", "zoom")
SPLITS = ("train", "val", "heldout")
# Each split's scene ids live in their own range, so no two splits can share a scene. "val" chooses which of a
# run's checkpoints is reported (config eval.select_by); "heldout" only measures it.
_SCENE_OFFSETS = {"train": 0, "heldout": 10_000_000, "val": 20_000_000}

# Landmark sphere radius in world units; its projected radius (fx * r / z) is the blob's Gaussian
# sigma in pixels, which keeps blobs 1-3 px wide at 32 px: large enough for sub-pixel centroids.
_RADIUS_RANGE = (0.16, 0.22)
_MIN_SIGMA_PX = 0.6


def default_intrinsics(size: int) -> torch.Tensor:
    """Pinhole intrinsics (3, 3) for a size x size image: fx = fy = size, centre (size - 1) / 2."""
    if size < 4:
        raise ValueError(f"image size must be >= 4, got {size}")
    c = (size - 1) / 2.0
    return torch.tensor([[float(size), 0.0, c], [0.0, float(size), c], [0.0, 0.0, 1.0]], dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------
# small SE(3) helpers (numpy, float64)


def _rot_x(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[1.0, 0.0, 0.0], [0.0, c, -s], [0.0, s, c]])


def _rot_y(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])


def _rot_z(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def _se3(R: np.ndarray | None = None, t: np.ndarray | None = None) -> np.ndarray:
    M = np.eye(4)
    if R is not None:
        M[:3, :3] = R
    if t is not None:
        M[:3, 3] = t
    return M


def _look_at_c2w(position: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Camera-to-world (4, 4) at `position` looking at `target`, world -y as up (OpenCV axes)."""
    z = target - position
    z = z / np.linalg.norm(z)
    up = np.array([0.0, -1.0, 0.0])
    x = np.cross(-up, z)  # with y down, x = y_cam x z_cam; y_cam is roughly +y_world
    x = x / np.linalg.norm(x)
    y = np.cross(z, x)
    return _se3(np.stack([x, y, z], axis=1), position)


def c2w_to_w2c(c2w: np.ndarray) -> np.ndarray:
    """(..., 4, 4) camera-to-world -> (..., 3, 4) world-to-camera [R^T | -R^T c]."""
    R = c2w[..., :3, :3]
    c = c2w[..., :3, 3:]
    Rt = np.swapaxes(R, -1, -2)
    return np.concatenate([Rt, -Rt @ c], axis=-1)


def project_points(points: torch.Tensor, cams: torch.Tensor, K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Project world points into every frame.

    points (L, 3) world; cams (F, 3, 4) world-to-camera; K (3, 3).
    Returns uv (F, L, 2) pixel coordinates (OpenCV: u = column, v = row) and depth z (F, L).
    """
    if points.ndim != 2 or points.shape[-1] != 3:
        raise ValueError(f"points must be (L, 3), got {tuple(points.shape)}")
    if cams.ndim != 3 or cams.shape[-2:] != (3, 4):
        raise ValueError(f"cams must be (F, 3, 4), got {tuple(cams.shape)}")
    pc = torch.einsum("fij,lj->fli", cams[..., :3], points) + cams[:, None, :, 3]
    z = pc[..., 2]
    proj = torch.einsum("ij,flj->fli", K, pc)
    uv = proj[..., :2] / z.clamp_min(1e-6)[..., None]
    return uv, z


# ----------------------------------------------------------------------------------------------------
# scenes


@dataclass
class Scene:
    """Landmark scene. landmarks (L, 3) world points, colors (L, 3) in [0, 1], radii (L,) world units,
    centre (3,) the point cameras orbit / zoom toward, sky/ground (3,) background colours in [0, 1]."""

    scene_id: int
    landmarks: np.ndarray
    colors: np.ndarray
    radii: np.ndarray
    centre: np.ndarray
    sky: np.ndarray
    ground: np.ndarray


def make_scene(scene_id: int, seed: int = 0, size: int = 32) -> Scene:
    """Seeded scene: 6-7 landmarks spread around a centre 4-5 units in front of the world camera.

    Landmarks are rejection-sampled so that, seen from the world camera, they sit inside the central
    part of the image and their blobs do not overlap (overlapping blobs would bias colour centroids).
    """
    rng = np.random.default_rng([seed, scene_id, 0x5CE7E])
    n = int(rng.integers(6, 8))
    centre = np.array([0.0, 0.0, rng.uniform(4.0, 5.0)])
    colors = PALETTE[rng.permutation(len(PALETTE))[:n]]
    radii = rng.uniform(*_RADIUS_RANGE, size=n)
    fx = float(size)
    pts: list[np.ndarray] = []
    uvs: list[np.ndarray] = []
    tries = 0
    while len(pts) < n:
        tries += 1
        if tries > 3_000 and n > 5:
            # Some layouts cannot fit n separated blobs; one landmark fewer keeps the scene (deterministically).
            n, tries = n - 1, 0
            colors, radii = colors[:n], radii[:n]
            pts, uvs = pts[:n], uvs[:n]
            continue
        if tries > 10_000:
            raise RuntimeError(f"could not place {n} landmarks for scene {scene_id}")
        p = centre + rng.uniform([-1.3, -0.8, -1.0], [1.3, 0.8, 1.0])
        uv = fx * p[:2] / p[2]  # offset from the principal point
        if np.abs(uv).max() > 0.36 * size:
            continue
        too_close = (np.linalg.norm(p - q) < 0.6 or np.linalg.norm(uv - w) < 0.18 * size
                     for q, w in zip(pts, uvs, strict=True))
        if any(too_close):
            continue
        pts.append(p)
        uvs.append(uv)
    tint = rng.uniform(-0.03, 0.03, size=3)
    sky = np.clip(np.array([0.55, 0.57, 0.61]) + tint, 0, 1)
    ground = np.clip(np.array([0.42, 0.40, 0.36]) + tint, 0, 1)
    return Scene(scene_id, np.stack(pts), colors, radii, centre, sky, ground)


# ----------------------------------------------------------------------------------------------------
# trajectories


def _motion_local(kind: str, amount: float, s: float, centre_local: np.ndarray) -> np.ndarray:
    """Relative camera-to-world motion (4, 4) in the start camera's frame at progress s in [0, 1].

    Signs: pan > 0 turns right, tilt > 0 turns up, roll > 0 rotates the camera's x axis toward +y,
    dolly > 0 moves forward, truck > 0 moves right, pedestal > 0 moves up, orbit > 0 circles to the
    left around the scene centre (keeps looking at it), zoom > 0 approaches the scene centre.
    Angles in radians, distances in world units.
    """
    a = amount * s
    if kind == "pan":
        return _se3(_rot_y(a))
    if kind == "tilt":
        return _se3(_rot_x(a))
    if kind == "roll":
        return _se3(_rot_z(a))
    if kind == "dolly":
        return _se3(t=np.array([0.0, 0.0, a]))
    if kind == "truck":
        return _se3(t=np.array([a, 0.0, 0.0]))
    if kind == "pedestal":
        return _se3(t=np.array([0.0, -a, 0.0]))
    if kind == "orbit":
        # Rotating about the vertical axis through the centre; the camera's up axis is used so that
        # the orbit stays level with respect to the start camera.
        return _se3(t=centre_local) @ _se3(_rot_y(a)) @ _se3(t=-centre_local)
    if kind == "zoom":
        d = centre_local / np.linalg.norm(centre_local)
        return _se3(t=d * a)
    raise ValueError(f"unknown trajectory kind {kind!r}; known: {TRAJECTORY_KINDS}")


_AMOUNT_RANGES = {
    "pan": (math.radians(8), math.radians(14)),
    "tilt": (math.radians(6), math.radians(10)),
    "roll": (math.radians(15), math.radians(35)),
    "dolly": (0.8, 1.3),
    "truck": (0.6, 1.0),
    "pedestal": (0.4, 0.7),
    "orbit": (math.radians(15), math.radians(30)),
    "zoom": (1.0, 1.5),
}


def _motion_phrase(kind: str, amount: float) -> str:
    pos = amount > 0
    return {
        "pan": "pan right" if pos else "pan left",
        "tilt": "tilt up" if pos else "tilt down",
        "roll": "roll clockwise" if pos else "roll counter-clockwise",
        "dolly": "dolly in" if pos else "dolly out",
        "truck": "truck right" if pos else "truck left",
        "pedestal": "pedestal up" if pos else "pedestal down",
        "orbit": "orbit left" if pos else "orbit right",
        "zoom": "zoom in" if pos else "zoom out",
    }[kind]


def trajectory_c2w(
    start_c2w: np.ndarray, kinds: list[str], amounts: list[float], centre: np.ndarray, num_frames: int
) -> np.ndarray:
    """Camera-to-world poses (F, 4, 4) for a composed motion starting at `start_c2w`.

    Each elementary motion is expressed in the start camera's frame and eased in/out (cosine), like a
    film move; a mix of two is the product of both relative motions at the same progress.
    """
    if num_frames < 2:
        raise ValueError(f"num_frames must be >= 2, got {num_frames}")
    centre_local = (np.linalg.inv(start_c2w) @ np.append(centre, 1.0))[:3]
    out = np.empty((num_frames, 4, 4))
    for f in range(num_frames):
        s = 0.5 - 0.5 * math.cos(math.pi * f / (num_frames - 1))
        M = np.eye(4)
        for kind, amount in zip(kinds, amounts, strict=True):
            M = M @ _motion_local(kind, amount, s, centre_local)
        out[f] = start_c2w @ M
    return out


def _visibility(scene: Scene, c2w: np.ndarray, size: int) -> np.ndarray:
    """(F, L) bool: landmark centre projects inside the image (1 px margin) in front of the camera."""
    w2c = c2w_to_w2c(c2w)
    pc = np.einsum("fij,lj->fli", w2c[..., :3], scene.landmarks) + w2c[:, None, :, 3]
    z = pc[..., 2]
    fx = float(size)
    c = (size - 1) / 2.0
    uv = fx * pc[..., :2] / np.maximum(z, 1e-6)[..., None] + c
    return (z > 0.8) & (uv >= 1.0).all(-1) & (uv <= size - 2.0).all(-1)


def sample_trajectory(
    rng: np.random.Generator,
    scene: Scene,
    start_c2w: np.ndarray,
    num_frames: int,
    size: int,
    exclude: tuple[str, ...] = (),  # elementary kinds the motion must not contain
    mix_prob: float = 0.3,
) -> tuple[np.ndarray, str, str]:
    """Random film-style trajectory whose landmarks mostly stay in view.

    Returns (c2w (F, 4, 4), kind e.g. "orbit" or "pan+truck", caption phrase). Every frame must keep
    at least 5 landmarks in view and 85% of landmark-frames visible; otherwise the magnitude is
    shrunk and the draw retried, so the camera reward always has enough landmarks on ground truth.
    """
    for attempt in range(40):
        if rng.random() < mix_prob:
            kinds = [str(rng.choice(_ROTATION_KINDS)), str(rng.choice(_TRANSLATION_KINDS))]
        else:
            kinds = [str(rng.choice(TRAJECTORY_KINDS))]
        if any(k in exclude for k in kinds):
            continue
        shrink = 0.85 ** (attempt // 2)
        amounts = [
            float(rng.uniform(*_AMOUNT_RANGES[k]) * rng.choice([-1.0, 1.0]) * shrink * (0.8 if len(kinds) > 1 else 1))
            for k in kinds
        ]
        c2w = trajectory_c2w(start_c2w, kinds, amounts, scene.centre, num_frames)
        vis = _visibility(scene, c2w, size)
        if vis.sum(1).min() >= min(5, len(scene.landmarks)) and vis.mean() >= 0.85:
            phrase = " and ".join(_motion_phrase(k, a) for k, a in zip(kinds, amounts, strict=True))
            return c2w, "+".join(kinds), phrase
    # Tiny moves always keep the scene in view; reaching here means the start pose itself is poor.
    kinds, amounts = ["pan"], [math.radians(2.0)]
    return trajectory_c2w(start_c2w, kinds, amounts, scene.centre, num_frames), "pan", "pan right"


# ----------------------------------------------------------------------------------------------------
# rendering


def render(scene: Scene, cams: torch.Tensor, K: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Render a scene along a camera trajectory.

    cams (F, 3, 4) world-to-camera; K (3, 3). Returns (3, F, H, W) float32 in [-1, 1].
    Landmarks are anti-aliased Gaussian splats (sigma = projected sphere radius) composited far to
    near; the background shades with the ray's elevation (sky above the horizon, ground below) plus a
    faint azimuth ripple, both low contrast so they never look like a landmark colour.
    """
    cams = torch.as_tensor(cams, dtype=torch.float64)
    K64 = torch.as_tensor(K, dtype=torch.float64)
    if cams.ndim != 3 or cams.shape[-2:] != (3, 4):
        raise ValueError(f"cams must be (F, 3, 4), got {tuple(cams.shape)}")
    if K64.shape != (3, 3):
        raise ValueError(f"K must be (3, 3), got {tuple(K64.shape)}")
    if height < 1 or width < 1:
        raise ValueError(f"height and width must be positive, got {height}x{width}")
    cams_np = cams.cpu().numpy()
    K_np = K64.cpu().numpy()
    F = cams_np.shape[0]
    R = cams_np[..., :3]
    t = cams_np[..., 3]

    v, u = np.meshgrid(np.arange(height, dtype=np.float64), np.arange(width, dtype=np.float64), indexing="ij")
    pix = np.stack([u, v, np.ones_like(u)], axis=-1)  # (H, W, 3)
    rays_cam = pix @ np.linalg.inv(K_np).T
    # world direction d_w = R^T d_c; as row vectors d_c @ R
    rays_w = np.einsum("hwi,fij->fhwj", rays_cam, R)
    rays_w /= np.linalg.norm(rays_w, axis=-1, keepdims=True)
    elev = -rays_w[..., 1]  # y is down, so up is -y
    azim = np.arctan2(rays_w[..., 0], rays_w[..., 2])
    blend = 1.0 / (1.0 + np.exp(-elev / 0.06))
    img = scene.ground * (1 - blend[..., None]) + scene.sky * blend[..., None]
    img = img + 0.025 * np.sin(6.0 * azim)[..., None] * (1 - blend[..., None])  # (F, H, W, 3)

    pc = np.einsum("fij,lj->fli", R, scene.landmarks) + t[:, None, :]  # (F, L, 3)
    z = pc[..., 2]
    zs = np.maximum(z, 1e-6)
    uc = K_np[0, 0] * pc[..., 0] / zs + K_np[0, 2]
    vc = K_np[1, 1] * pc[..., 1] / zs + K_np[1, 2]
    sigma = np.maximum(K_np[0, 0] * scene.radii[None] / zs, _MIN_SIGMA_PX)
    d2 = (u[None, None] - uc[..., None, None]) ** 2 + (v[None, None] - vc[..., None, None]) ** 2
    alpha = np.exp(-0.5 * d2 / sigma[..., None, None] ** 2)  # (F, L, H, W)
    alpha *= (z > 0.1)[..., None, None]
    order = np.argsort(-z, axis=1)  # far to near, per frame
    fidx = np.arange(F)
    for k in range(order.shape[1]):
        li = order[:, k]
        a = alpha[fidx, li][..., None]  # (F, H, W, 1)
        img = img * (1 - a) + a * scene.colors[li][:, None, None, :]
    out = np.clip(img, 0.0, 1.0) * 2.0 - 1.0
    return torch.from_numpy(np.ascontiguousarray(out.transpose(3, 0, 1, 2))).float()


# ----------------------------------------------------------------------------------------------------
# dataset


@dataclass
class Condition:
    """One re-rendering task: re-render source_video from target_cams.

    Videos (3, F, H, W) in [-1, 1]; cams (F, 3, 4) world-to-camera relative to the first source
    frame (source_cams[0] = [I | 0]); intrinsics (3, 3); landmarks (L, 3) world; landmark_colors
    (L, 3) in [0, 1]. `trajectory` is the target motion kind ("orbit", "pan+truck", ...),
    `source_trajectory` the source's.
    """

    condition_id: str
    scene_id: int
    split: str
    caption: str
    source_video: torch.Tensor
    source_cams: torch.Tensor
    target_cams: torch.Tensor
    target_video: torch.Tensor
    intrinsics: torch.Tensor
    landmarks: torch.Tensor
    landmark_colors: torch.Tensor
    trajectory: str
    source_trajectory: str


def make_condition(
    scene: Scene, split: str, cond_index: int, seed: int = 0, num_frames: int = 8, size: int = 32
) -> Condition:
    """Build condition `cond_index` of a scene: source trajectory from identity, and a target
    trajectory of a different kind starting from a pose near the source's first frame."""
    rng = np.random.default_rng([seed, scene.scene_id, 0xC0D, cond_index])
    K = default_intrinsics(size)
    src_c2w, src_kind, _ = sample_trajectory(rng, scene, np.eye(4), num_frames, size)
    # Target start: a small offset from the source's first camera, re-aimed near the scene centre.
    start_pos = rng.uniform([-0.25, -0.15, -0.25], [0.25, 0.15, 0.25])
    aim = scene.centre + rng.uniform([-0.3, -0.2, -0.3], [0.3, 0.2, 0.3])
    start = _look_at_c2w(start_pos, aim)
    tgt_c2w, tgt_kind, phrase = sample_trajectory(
        rng, scene, start, num_frames, size, exclude=tuple(src_kind.split("+"))
    )
    return condition_from_trajectories(
        split, scene.scene_id, cond_index, f"{phrase} around {len(scene.landmarks)} coloured spheres",
        src_c2w, tgt_c2w, K, lambda cams: render(scene, cams, K, size, size),
        torch.from_numpy(scene.landmarks).float(), torch.from_numpy(scene.colors).float(), tgt_kind, src_kind)


def condition_from_trajectories(split: str, scene_id: int, cond_index: int, caption: str, src_c2w: np.ndarray,
                                tgt_c2w: np.ndarray, K: torch.Tensor, render_fn, landmarks: torch.Tensor,
                                landmark_colors: torch.Tensor, trajectory: str, source_trajectory: str) -> Condition:
    """A Condition from its two camera-to-world trajectories (F, 4, 4) and a render_fn(w2c (F, 3, 4)) -> video;
    shared by the synthetic worlds (this one and recam.domains.camera.textured)."""
    src_cams = torch.from_numpy(c2w_to_w2c(src_c2w)).float()
    src_cams[0] = torch.eye(3, 4)  # exact identity, free of float round-off
    tgt_cams = torch.from_numpy(c2w_to_w2c(tgt_c2w)).float()
    return Condition(
        condition_id=f"{split}/s{scene_id:06d}/c{cond_index}",
        scene_id=scene_id,
        split=split,
        caption=caption,
        source_video=render_fn(src_cams),
        source_cams=src_cams,
        target_cams=tgt_cams,
        target_video=render_fn(tgt_cams),
        intrinsics=K,
        landmarks=landmarks,
        landmark_colors=landmark_colors,
        trajectory=trajectory,
        source_trajectory=source_trajectory,
    )


class SeededWorld(Dataset, abc.ABC):
    """What the synthetic worlds share: split checks, scene ids per split, index checks and the item cache.

    Item i belongs to scene i // conditions_per_scene of the split; train scenes have ids 0, 1, 2, ..., held-out
    scenes 10_000_000 + k and validation scenes 20_000_000 + k, so the splits never share a scene. Items are
    deterministic in (seed, split, i) and cached after the first render. A world implements `_make(i)`."""

    def __init__(self, split: str, num_conditions: int, seed: int, num_frames: int, conditions_per_scene: int):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if num_conditions < 1:
            raise ValueError(f"num_conditions must be >= 1, got {num_conditions}")
        if conditions_per_scene < 1:
            raise ValueError(f"conditions_per_scene must be >= 1, got {conditions_per_scene}")
        if num_frames < 2:
            raise ValueError(f"num_frames must be >= 2, got {num_frames}")
        self.split = split
        self.num_conditions = num_conditions
        self.seed = seed
        self.num_frames = num_frames
        self.conditions_per_scene = conditions_per_scene
        self._cache: dict[int, Condition] = {}

    def __len__(self) -> int:
        return self.num_conditions

    def scene_id(self, i: int) -> int:
        return i // self.conditions_per_scene + _SCENE_OFFSETS[self.split]

    @abc.abstractmethod
    def _make(self, i: int) -> Condition:
        """Build item i (deterministic in seed, split and i); a world without it cannot be constructed."""

    def __getitem__(self, i: int) -> Condition:
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"index must be an int, got {type(i).__name__}")
        i = int(i)
        if i < 0:
            i += self.num_conditions
        if not 0 <= i < self.num_conditions:
            raise IndexError(f"index {i} out of range for {self.num_conditions} conditions")
        if i not in self._cache:
            self._cache[i] = self._make(i)
        return self._cache[i]


class SyntheticWorld(SeededWorld):
    """Seeded multi-camera dataset of landmark-scene `Condition`s (SeededWorld: splits, ids, caching)."""

    def __init__(
        self,
        split: str,
        num_conditions: int,
        seed: int = 0,
        num_frames: int = 8,
        size: int = 32,
        conditions_per_scene: int = 4,
    ) -> None:
        super().__init__(split, num_conditions, seed, num_frames, conditions_per_scene)
        if size < 8:
            raise ValueError(f"size must be >= 8, got {size}")
        self.size = size
        self._scenes: dict[int, Scene] = {}

    def _make(self, i: int) -> Condition:
        sid = self.scene_id(i)
        if sid not in self._scenes:
            self._scenes[sid] = make_scene(sid, self.seed, self.size)
        return make_condition(self._scenes[sid], self.split, i % self.conditions_per_scene, self.seed,
                              self.num_frames, self.size)


def collate_conditions(conditions: list[Condition]) -> dict:
    """Stack a list of B conditions: source_video / target_video (B, 3, F, H, W), source_cams /
    target_cams (B, F, 3, 4), intrinsics (B, 3, 3); plus `conditions` and `condition_ids` lists."""
    if len(conditions) == 0:
        raise ValueError("collate_conditions got an empty list")
    for c in conditions:
        if not isinstance(c, Condition):
            raise TypeError(f"collate_conditions expects Condition items, got {type(c).__name__}")
    shapes = {tuple(c.source_video.shape) for c in conditions}
    if len(shapes) != 1:
        raise ValueError(f"conditions have different video shapes: {sorted(shapes)}")
    return {
        "source_video": torch.stack([c.source_video for c in conditions]),
        "source_cams": torch.stack([c.source_cams for c in conditions]),
        "target_cams": torch.stack([c.target_cams for c in conditions]),
        "target_video": torch.stack([c.target_video for c in conditions]),
        "intrinsics": torch.stack([c.intrinsics for c in conditions]),
        "conditions": list(conditions),
        "condition_ids": [c.condition_id for c in conditions],
    }
