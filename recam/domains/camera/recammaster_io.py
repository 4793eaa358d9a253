"""ReCamMaster / MultiCamVideo on-disk layout: captions, camera extrinsics, and an exporter for the synthetic world.

Layout::

    <root>/metadata.csv                               # columns file_name,text (file_name relative to <root>)
    <root>/<scene>/videos/cam01.mp4 ...               # one clip per camera (read with recam.domains.camera.video_io)
    <root>/<scene>/cameras/camera_extrinsics.json     # {"frame{i}": {"camNN": "[..] [..] [..] [..]"}}

Camera strings and conventions
------------------------------
Each string is a 4x4 matrix printed row by row, ``"[r00 r01 r02 0] [r10 r11 r12 0] [r20 r21 r22 0] [tx ty tz 1]"``.
It comes from Unreal Engine, which multiplies row vectors, so the printed matrix is the TRANSPOSE of a
camera-to-world matrix: rows 0-2 are the camera's forward / right / up axes (Unreal camera X, Y, Z) in world
coordinates, the last row its position in centimetres. Unreal's world is left-handed (X forward, Y right, Z up).

ReCamMaster turns it into the model's convention (:func:`unreal_to_opencv_c2w`):

1. transpose -> column-vector camera-to-world, translation in the last column;
2. reorder columns ``[1, 2, 0, 3]`` -> columns are (right, up, forward) = candidate OpenCV x, y, z;
3. negate column 1 -> (right, down, forward): OpenCV camera axes (x right, y down, z forward);
4. divide the translation by 100 -> metres.

Only the camera axes are changed, never the world's: the result expresses OpenCV camera axes in Unreal world
coordinates (metres). Because that world is left-handed its 3x3 block has determinant -1; it becomes a proper
rotation once poses are made relative to a reference camera (:func:`relative_w2c`, :func:`relative_c2w`), which is
the only way ReCamMaster ever uses them.

:func:`export_world` goes the other way for :mod:`recam.domains.camera.world` (right-handed OpenCV world = first
source camera):
it maps the world into Unreal axes (X = z, Y = x, Z = -y, a handedness flip, so stored rotations are proper
det +1 matrices as in real data), places each scene at its own offset and heading, and scales world units (read as
metres) to centimetres. Relative poses are invariant to that placement, so loading gives back the world's cameras.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import numpy as np
import torch

from recam.domains.camera import video_io

METADATA_FILE = "metadata.csv"
EXTRINSICS_FILE = Path("cameras") / "camera_extrinsics.json"
# Not part of ReCamMaster's release (its layout stores no intrinsics): recam's own addition, written by export_world
# and read by the loader when present, {"width", "height", "fx", "fy", "cx", "cy"} in the clip's own pixels (OpenCV
# convention, pixel centres at integers), shared by every camera of the scene.
INTRINSICS_FILE = Path("cameras") / "intrinsics.json"
VIDEOS_DIR = "videos"

_MATRIX_RE = re.compile(r"\s*(?:\[[^\[\]]*\]\s*){4}")
_ROW_RE = re.compile(r"\[([^\[\]]*)\]")
_FRAME_RE = re.compile(r"frame(0|[1-9]\d*)")
_CAM_RE = re.compile(r"cam\d+")
_CAM_COLUMNS = [1, 2, 0, 3]  # Unreal (forward, right, up, t) columns -> (right, up, forward, t)
# OpenCV world coordinates (x right, y down, z forward) -> Unreal world (X forward, Y right, Z up).
_CV_TO_UE_WORLD = np.array([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, -1.0, 0.0]])


# ----------------------------------------------------------------------------------------------------
# metadata.csv


def write_metadata(path: str | Path, rows: list[tuple[str, str]]) -> Path:
    """Write ``file_name,text`` rows; the csv module quotes captions containing commas, quotes or newlines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["file_name", "text"])
        writer.writerows(rows)
    return path


def read_metadata(path: str | Path) -> list[tuple[str, str]]:
    """(file_name, text) rows of a metadata.csv; extra columns are ignored."""
    path = Path(path)
    # utf-8-sig: csv files saved by spreadsheet tools often start with a byte-order mark.
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        missing = {"file_name", "text"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}; header is {reader.fieldnames}")
        rows = []
        for line, row in enumerate(reader, start=2):
            if row["file_name"] is None or row["text"] is None:
                raise ValueError(f"{path}: line {line}: expected file_name,text, got {row}")
            rows.append((row["file_name"], row["text"]))
    return rows


# ----------------------------------------------------------------------------------------------------
# matrix strings and conventions


def parse_matrix_string(s: str) -> np.ndarray:
    """``"[a b c d] [e f g h] [i j k l] [m n o p]"`` -> (4, 4) float64, rows as printed.

    The last column must be (0, 0, 0, 1) (to 1e-6): anything else is not an affine transform in Unreal's
    row-vector form, and transposing it would silently give a wrong pose.
    """
    if not isinstance(s, str) or not _MATRIX_RE.fullmatch(s):
        raise ValueError(f"expected 4 bracketed rows of 4 numbers, got {s!r}")
    rows = []
    for body in _ROW_RE.findall(s):
        parts = body.split()
        if len(parts) != 4:
            raise ValueError(f"expected 4 bracketed rows of 4 numbers, got {s!r}")
        try:
            rows.append([float(p) for p in parts])
        except ValueError:
            raise ValueError(f"expected 4 bracketed rows of 4 numbers, got {s!r}") from None
    m = np.array(rows, dtype=np.float64)
    if not np.isfinite(m).all():
        raise ValueError(f"non-finite value in matrix {s!r}")
    if np.abs(m[:, 3] - [0.0, 0.0, 0.0, 1.0]).max() > 1e-6:
        raise ValueError(f"last column must be 0 0 0 1 (translation in the last row), got {s!r}")
    return m


def format_matrix_string(m: np.ndarray | torch.Tensor) -> str:
    """(4, 4) -> the row-by-row string; repr of each float so that parsing gives back the same numbers."""
    m = np.asarray(m, dtype=np.float64)
    if m.shape != (4, 4):
        raise ValueError(f"matrix must be (4, 4), got {m.shape}")
    # + 0.0 turns -0.0 into 0.0, which only makes the files easier to read.
    return " ".join("[" + " ".join(repr(float(x) + 0.0) for x in row) + "]" for row in m)


def unreal_to_opencv_c2w(m: np.ndarray) -> np.ndarray:
    """Stored Unreal matrices (..., 4, 4) -> camera-to-world (..., 4, 4) with OpenCV camera axes, metres.

    Transpose; columns (forward, right, up) -> (right, up, forward); negate the new y column (up -> down);
    translation / 100 (cm -> m). The world axes stay Unreal's (see the module docstring).
    """
    c2w = np.swapaxes(np.asarray(m, dtype=np.float64), -1, -2)[..., _CAM_COLUMNS].copy()
    c2w[..., :3, 1] *= -1.0
    c2w[..., :3, 3] /= 100.0
    return c2w


def opencv_c2w_to_unreal(c2w: np.ndarray) -> np.ndarray:
    """Exact inverse of :func:`unreal_to_opencv_c2w`: (..., 4, 4) -> the matrices as stored."""
    c = np.array(c2w, dtype=np.float64)
    c[..., :3, 3] *= 100.0
    c[..., :3, 1] *= -1.0
    ue = np.empty_like(c)
    ue[..., _CAM_COLUMNS] = c
    return np.swapaxes(ue, -1, -2)


def _inv_rigid(m: np.ndarray) -> np.ndarray:
    # R is orthogonal even when det R = -1 (Unreal world), so R^T inverts it; avoids np.linalg.inv round-off.
    R = m[..., :3, :3]
    Rt = np.swapaxes(R, -1, -2)
    out = np.zeros_like(m)
    out[..., :3, :3] = Rt
    out[..., :3, 3:] = -Rt @ m[..., :3, 3:]
    out[..., 3, 3] = 1.0
    return out


def relative_c2w(c2w: np.ndarray, reference_c2w: np.ndarray) -> np.ndarray:
    """(F, 4, 4) camera-to-world -> (F, 3, 4) camera-to-world in the reference camera's frame.

    This is what ReCamMaster flattens to 12 numbers per pose (target poses relative to the source's first frame).
    """
    return (_inv_rigid(np.asarray(reference_c2w, dtype=np.float64)) @ np.asarray(c2w, dtype=np.float64))[..., :3, :]


def relative_w2c(c2w: np.ndarray, reference_c2w: np.ndarray) -> np.ndarray:
    """(F, 4, 4) camera-to-world -> (F, 3, 4) world-to-camera in the reference camera's frame
    (recam.domains.camera.world's
    convention: passing the reference camera's own first frame gives [I | 0] there)."""
    c2w = np.asarray(c2w, dtype=np.float64)
    return (_inv_rigid(c2w) @ np.asarray(reference_c2w, dtype=np.float64))[..., :3, :]


def cameras_to_relative_w2c(cams: dict[str, np.ndarray], reference: str = "cam01") -> dict[str, torch.Tensor]:
    """Stored extrinsics {camNN: (F, 4, 4)} -> {camNN: (F, 3, 4) float32 world-to-camera} relative to the first
    frame of camera `reference` (the source camera), ready to use like recam.domains.camera.world's cams."""
    if reference not in cams:
        raise ValueError(f"reference camera {reference!r} not among {sorted(cams)}")
    c2w = {k: unreal_to_opencv_c2w(v) for k, v in cams.items()}
    ref = c2w[reference][0]
    return {k: torch.from_numpy(relative_w2c(v, ref)).float() for k, v in c2w.items()}


# ----------------------------------------------------------------------------------------------------
# camera_extrinsics.json


def read_camera_extrinsics(path: str | Path) -> dict[str, np.ndarray]:
    """{camNN: (F, 4, 4) float64} exactly as stored (Unreal, row-vector form).

    Frames must be frame0 .. frame{F-1} without gaps and every frame must hold the cameras of frame0; any
    problem raises ValueError naming the file and the key.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path}: expected a non-empty object of frame{{i}} keys, got {type(data).__name__}")
    frames: dict[int, dict] = {}
    for key, value in data.items():
        match = _FRAME_RE.fullmatch(key)
        if match is None:
            raise ValueError(f"{path}: {key}: unexpected key, expected frame{{i}}")
        if not isinstance(value, dict) or not value:
            raise ValueError(f"{path}: {key}: expected a non-empty object of camNN keys")
        frames[int(match.group(1))] = value
    num_frames = len(frames)
    for i in range(num_frames):
        if i not in frames:
            raise ValueError(f"{path}: frame{i}: missing (frames must be frame0..frame{num_frames - 1})")
    cam_names = sorted(frames[0])
    for name in cam_names:
        if not _CAM_RE.fullmatch(name):
            raise ValueError(f"{path}: frame0/{name}: unexpected key, expected camNN")
    out = {name: np.empty((num_frames, 4, 4)) for name in cam_names}
    for i in range(num_frames):
        extra = sorted(set(frames[i]) - set(cam_names))
        if extra:
            raise ValueError(f"{path}: frame{i}/{extra[0]}: camera not present in frame0")
        for name in cam_names:
            if name not in frames[i]:
                raise ValueError(f"{path}: frame{i}/{name}: missing camera (present in frame0)")
            try:
                out[name][i] = parse_matrix_string(frames[i][name])
            except ValueError as e:
                raise ValueError(f"{path}: frame{i}/{name}: {e}") from None
    return out


def write_camera_extrinsics(path: str | Path, cams: dict[str, np.ndarray | torch.Tensor]) -> Path:
    """Write {camNN: (F, 4, 4)} (already in the stored Unreal form) as camera_extrinsics.json."""
    if not cams:
        raise ValueError("no cameras to write")
    arrays = {name: np.asarray(m, dtype=np.float64) for name, m in cams.items()}
    lengths = set()
    for name, m in arrays.items():
        if not _CAM_RE.fullmatch(name):
            raise ValueError(f"camera names must look like cam01, got {name!r}")
        if m.ndim != 3 or m.shape[1:] != (4, 4):
            raise ValueError(f"{name}: matrices must be (F, 4, 4), got {m.shape}")
        lengths.add(m.shape[0])
    if len(lengths) != 1:
        raise ValueError(f"all cameras need the same number of frames, got {sorted(lengths)}")
    num_frames = lengths.pop()
    data = {
        f"frame{i}": {name: format_matrix_string(arrays[name][i]) for name in sorted(arrays)}
        for i in range(num_frames)
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")
    return path


def write_intrinsics(path: str | Path, K: np.ndarray | torch.Tensor, height: int, width: int) -> Path:
    """Write a scene's pinhole K (3, 3) for height x width clips as intrinsics.json."""
    K = np.asarray(K, dtype=np.float64)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"width": int(width), "height": int(height), "fx": K[0, 0], "fy": K[1, 1],
                                "cx": K[0, 2], "cy": K[1, 2]}, indent=1), encoding="utf-8")
    return path


def read_intrinsics(path: str | Path) -> tuple[np.ndarray, int, int]:
    """intrinsics.json -> (K (3, 3) float64, height, width); errors name the file and what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read intrinsics: {e}") from e
    keys = ("width", "height", "fx", "fy", "cx", "cy")
    if not isinstance(data, dict) or any(k not in data for k in keys):
        raise ValueError(f"{path}: intrinsics need the keys {list(keys)}")
    try:
        values = {k: float(data[k]) for k in keys}
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: intrinsics must be numbers: {e}") from e
    if not all(math.isfinite(v) for v in values.values()) or min(values["fx"], values["fy"], values["width"],
                                                                  values["height"]) <= 0:
        raise ValueError(f"{path}: intrinsics must be finite with positive width, height, fx, fy; got {values}")
    K = np.array([[values["fx"], 0.0, values["cx"]], [0.0, values["fy"], values["cy"]], [0.0, 0.0, 1.0]])
    return K, int(values["height"]), int(values["width"])


# ----------------------------------------------------------------------------------------------------
# synthetic world <-> layout


def _placement(scene_id: int) -> np.ndarray:
    """A per-scene heading and offset in the (OpenCV-axes) world, so exported scenes are not all at the origin
    and a reader that forgets to make poses relative gets visibly wrong cameras."""
    yaw = 0.7 * (scene_id % 9) - 2.8
    c, s = math.cos(yaw), math.sin(yaw)
    M = np.eye(4)
    M[:3, :3] = [[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]]
    M[:3, 3] = [3.0 * (scene_id % 5) - 6.0, -1.5, 2.0 * (scene_id % 7)]
    return M


def _w2c_to_c2w(w2c: torch.Tensor) -> np.ndarray:
    m = np.zeros((w2c.shape[0], 4, 4))
    m[:, :3] = w2c.double().numpy()
    m[:, 3, 3] = 1.0
    return _inv_rigid(m)


def export_world(world, out_dir: str | Path, n_scenes: int, fps: int = video_io.MULTICAMVIDEO_FPS) -> list[Path]:
    """Write the first `n_scenes` scenes of a :class:`recam.domains.camera.world.SyntheticWorld` (or any dataset of
    its Conditions with ``conditions_per_scene``, e.g. recam.domains.camera.textured.TexturedWorld) in ReCamMaster's
    layout.

    Scene k holds the world's items k * conditions_per_scene ... (those sharing one scene): cam01 is the first
    item's source camera, cam02, cam03, ... each item's target camera, all in one world frame (every source
    starts at the world origin). metadata.csv gets one row per video; the source camera's text names the scene with
    the world's ``scene_description(scene_id)`` when it has one, else by its landmark count. Returns the scene folders.
    """
    out_dir = Path(out_dir)
    per_scene = world.conditions_per_scene
    if n_scenes < 1 or (n_scenes - 1) * per_scene >= len(world):
        raise ValueError(f"n_scenes must be in 1..{math.ceil(len(world) / per_scene)}, got {n_scenes}")
    to_ue_world = np.eye(4)
    to_ue_world[:3, :3] = _CV_TO_UE_WORLD
    rows: list[tuple[str, str]] = []
    scene_dirs = []
    for k in range(n_scenes):
        items = [world[i] for i in range(k * per_scene, min((k + 1) * per_scene, len(world)))]
        first = items[0]
        scene_dir = out_dir / f"scene{first.scene_id:08d}"
        describe = getattr(world, "scene_description", None)
        scene_text = describe(first.scene_id) if describe else f"{len(first.landmarks)} coloured spheres"
        entries = [(first.source_cams, first.source_video,
                    f"source camera, {first.source_trajectory} motion, {scene_text}")]
        entries += [(c.target_cams, c.target_video, c.caption) for c in items]
        world_to_ue = to_ue_world @ _placement(first.scene_id)
        cams = {}
        for j, (w2c, video, text) in enumerate(entries, start=1):
            name = f"cam{j:02d}"
            cams[name] = opencv_c2w_to_unreal(world_to_ue @ _w2c_to_c2w(w2c))
            video_path = video_io.write_video(scene_dir / VIDEOS_DIR / f"{name}.mp4", video, fps=fps, quality=10)
            rows.append((video_path.relative_to(out_dir).as_posix(), text))
        write_camera_extrinsics(scene_dir / EXTRINSICS_FILE, cams)
        write_intrinsics(scene_dir / INTRINSICS_FILE, first.intrinsics, *first.target_video.shape[-2:])
        scene_dirs.append(scene_dir)
    write_metadata(out_dir / METADATA_FILE, rows)
    return scene_dirs


def _find_metadata(scene_dir: Path) -> Path | None:
    # Real data keeps metadata.csv at the dataset root, a few levels above the scene (root/train/<set>/<scene>).
    for parent in [scene_dir, *scene_dir.parents][:5]:
        if (parent / METADATA_FILE).is_file():
            return parent / METADATA_FILE
    return None


def load_recammaster_scene(scene_dir: str | Path, metadata_path: str | Path | None = None,
                           reference: str | None = "cam01") -> dict:
    """Load one scene folder.

    Returns dict with ``cams`` {camNN: (F, 4, 4) float64 as stored}; ``w2c`` {camNN: (F, 3, 4) float32
    world-to-camera relative to the first frame of `reference`, {} when it is None}; ``videos`` {camNN:
    (3, F, H, W) float32 in [-1, 1], full clip at its own resolution}; ``captions`` {camNN: text} from metadata.csv
    (found in the scene folder or up to four levels above when not given; {} if there is none).
    """
    scene_dir = Path(scene_dir)
    cams = read_camera_extrinsics(scene_dir / EXTRINSICS_FILE)
    videos = {}
    for path in sorted((scene_dir / VIDEOS_DIR).glob("cam*.mp4")):
        videos[path.stem] = video_io.frames_to_tensor(video_io.read_frames(path))
    captions: dict[str, str] = {}
    meta = Path(metadata_path) if metadata_path is not None else _find_metadata(scene_dir)
    if meta is not None:
        wanted = (scene_dir / VIDEOS_DIR).resolve()
        for file_name, text in read_metadata(meta):
            path = (meta.parent / file_name).resolve()
            if path.parent == wanted:
                captions[path.stem] = text
    w2c = {} if reference is None else cameras_to_relative_w2c(cams, reference)
    return {"cams": cams, "w2c": w2c, "videos": videos, "captions": captions}
