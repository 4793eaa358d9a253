"""ReCamMaster-layout multi-camera data as a dataset of :class:`recam.domains.camera.world.Condition`, like the
SyntheticWorld.

Layout (recam/domains/camera/recammaster_io.py)::

    <root>/.../<scene>/videos/cam01.mp4 ... camNN.mp4      # one clip per camera, same length
    <root>/.../<scene>/cameras/camera_extrinsics.json       # {"frame{i}": {"camNN": "[..] [..] [..] [..]"}}
    metadata.csv                                            # file_name,text; in <root> or up to 4 levels above

A scene is any folder under ``root`` holding a ``videos/`` folder with ``camNN.mp4`` files. A condition is
(scene, source camera, target camera), source != target: re-render the source camera's clip along the target
camera's trajectory. Every ordered pair of a scene's cameras is a condition, or only pairs whose source is in
``source_cams`` when given (e.g. ``("cam01",)``).

Per condition (:meth:`ReCamMasterDataset.__getitem__`):

* source_video / target_video (3, F, H, W) in [-1, 1]: frames 0, interval, ..., (F - 1) x interval of the two
  clips, resized to cover (H, W) and centre-cropped (recam.domains.camera.video_io.read_video, ReCamMaster's
  sampling). Multi-
  camera data films every camera at once, so the target camera's clip is the ground truth;
* source_cams / target_cams (F, 3, 4) world-to-camera extrinsics of the same frames, relative to the source
  camera's first frame (source_cams[0] = [I | 0]; recam.domains.camera.recammaster_io.cameras_to_relative_w2c);
* caption: metadata.csv's text of the target clip (the source clip's text when the target has none, else "");
* condition_id ``"<split>/<scene path relative to root>/<src>-<tgt>"`` (e.g. ``train/f18/scene1/cam01-cam03``):
  it depends only on the scene's path and the camera names, never on which other scenes exist;
* scene_id: an int from the SHA-1 of the scene's relative path (stable across machines and dataset versions).

Fields real data does not have, with placeholders so that Condition stays one type:

* ``landmarks`` / ``landmark_colors``: empty (0, 3) tensors. cam_score estimates poses on real footage with
  structure-from-motion or a served estimator (reward.cam.estimator); its landmark estimator is refused for
  data.source = "recammaster" by the camera checks (recam/domains/camera/checks.py);
* ``intrinsics``: the layout stores none. Read from the scene's cameras/intrinsics.json when it has one (recam's
  own addition, written by recammaster_io.export_world; adjusted to the loaded resize and crop); otherwise a
  pinhole with the horizontal field of view ``hfov_deg`` (config data.hfov_deg), and with 0 there the placeholder
  fx = fy = W (53.1 degrees). cam_score's SfM holds the intrinsics fixed, so a wrong focal length costs accuracy:
  set data.hfov_deg (or write intrinsics.json) when it is known;
* ``trajectory`` / ``source_trajectory``: the camera names (real data has no motion-kind labels).

Split: scenes are ordered by the SHA-1 of their relative path; the first ``num_heldout_scenes`` are held out, the
rest train. Deterministic, independent of directory listing order, and mixes the dataset's sub-folders.

Loading is lazy: the constructor only lists folders and reads metadata.csv; videos and camera files are read in
``__getitem__``, with a small LRU cache of finished conditions (the k copies of a group and the training pass
ask for the same condition several times). A missing or corrupt file raises an error naming the file.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import os
import re
from collections import OrderedDict
from pathlib import Path

import torch
from torch.utils.data import Dataset

from recam.domains.camera import recammaster_io, video_io
from recam.domains.camera.world import Condition

_CAM_VIDEO_RE = re.compile(r"cam\d+\.mp4")
REAL_SPLITS = ("train", "heldout")  # real data has no validation split yet (config eval.select_by needs one)
MAX_METADATA_LEVELS = 4  # metadata.csv is looked for in root and this many folders above it


def find_scenes(root: Path) -> list[Path]:
    """Scene folders under root (folders holding a videos/ folder), sorted; does not descend into scenes."""
    scenes = []
    for dirpath, dirnames, _ in os.walk(root, followlinks=True):
        if recammaster_io.VIDEOS_DIR in dirnames:
            scenes.append(Path(dirpath))
            dirnames[:] = []  # a scene's own sub-folders hold no further scenes
        else:
            dirnames.sort()
    return sorted(scenes)


def find_metadata(root: Path) -> Path | None:
    for folder in [root, *root.parents][: MAX_METADATA_LEVELS + 1]:
        if (folder / recammaster_io.METADATA_FILE).is_file():
            return folder / recammaster_io.METADATA_FILE
    return None


def placeholder_intrinsics(height: int, width: int, hfov_deg: float = 0.0) -> torch.Tensor:
    """Pinhole K (3, 3) for an H x W frame when the scene has no intrinsics.json: fx = fy from the horizontal field of
    view hfov_deg (0: fx = fy = W), centre ((W-1)/2, (H-1)/2)."""
    f = float(width) if hfov_deg <= 0 else width / (2.0 * math.tan(math.radians(hfov_deg) / 2.0))
    return torch.tensor([[f, 0.0, (width - 1) / 2.0],
                         [0.0, f, (height - 1) / 2.0],
                         [0.0, 0.0, 1.0]], dtype=torch.float32)


def _scene_hash(rel: str) -> str:
    return hashlib.sha1(rel.encode("utf-8")).hexdigest()


class ReCamMasterDataset(Dataset):
    """Conditions (scene, source camera, target camera) of one split of a ReCamMaster-layout folder.

    Args:
        root: folder searched (recursively) for scene folders.
        split: "train" or "heldout".
        num_frames, height, width, frame_interval: clip sampling (recam.domains.camera.video_io.read_video); frames 0,
            interval, ... must exist in every clip and in camera_extrinsics.json.
        num_heldout_scenes: scenes held out (see the module docstring); at least one scene must remain to train.
        source_cams: camera names allowed as source; None or empty = every camera.
        max_conditions: > 0 keeps that many conditions, evenly strided over the split (ids unchanged); 0 = all.
        cache_size: finished conditions kept in memory (least recently used are dropped).
    """

    def __init__(self, root: str | Path, split: str = "train", num_frames: int = video_io.RECAMMASTER_NUM_FRAMES,
                 height: int = video_io.RECAMMASTER_HEIGHT, width: int = video_io.RECAMMASTER_WIDTH,
                 frame_interval: int = 1, num_heldout_scenes: int = 1, source_cams: tuple[str, ...] | None = None,
                 max_conditions: int = 0, cache_size: int = 8, hfov_deg: float = 0.0) -> None:
        if split not in REAL_SPLITS:
            raise ValueError(f"split must be one of {REAL_SPLITS}, got {split!r}")
        if num_frames < 1 or height < 1 or width < 1 or frame_interval < 1:
            raise ValueError(f"need num_frames, height, width, frame_interval >= 1; got {num_frames}, {height}, "
                             f"{width}, {frame_interval}")
        self.root = Path(root).absolute()
        if not self.root.is_dir():
            raise FileNotFoundError(f"ReCamMaster data folder {self.root} does not exist")
        self.split = split
        self.num_frames, self.height, self.width, self.frame_interval = num_frames, height, width, frame_interval
        self.frames = video_io.frame_indices(num_frames, 0, frame_interval)
        self.cache_size = cache_size
        self.hfov_deg = hfov_deg
        self._cache: OrderedDict[tuple, Condition] = OrderedDict()

        scenes = find_scenes(self.root)
        if not scenes:
            raise ValueError(f"no ReCamMaster scenes under {self.root}: expected folders holding "
                             f"{recammaster_io.VIDEOS_DIR}/camNN.mp4 and {recammaster_io.EXTRINSICS_FILE}")
        if not 0 <= num_heldout_scenes < len(scenes):
            raise ValueError(f"num_heldout_scenes={num_heldout_scenes} must be in 0..{len(scenes) - 1}: {self.root} "
                             f"holds {len(scenes)} scene(s) and at least one must remain for training")
        by_hash = sorted(scenes, key=lambda s: _scene_hash(s.relative_to(self.root).as_posix()))
        heldout = set(by_hash[:num_heldout_scenes])
        self.scenes = [s for s in scenes if (s in heldout) == (split == "heldout")]
        if not self.scenes:
            raise ValueError(f"split {split!r} of {self.root} has no scenes (num_heldout_scenes={num_heldout_scenes})")

        # Per scene: its camera names; conditions are enumerated lazily from cumulative counts.
        wanted = tuple(source_cams) if source_cams else None
        self._pairs: list[list[tuple[str, str]]] = []
        for scene in self.scenes:
            extrinsics = scene / recammaster_io.EXTRINSICS_FILE
            if not extrinsics.is_file():
                raise FileNotFoundError(f"{extrinsics} is missing (scene {scene} has videos but no cameras)")
            cams = sorted(p.name[:-4] for p in (scene / recammaster_io.VIDEOS_DIR).iterdir()
                          if _CAM_VIDEO_RE.fullmatch(p.name))
            if len(cams) < 2:
                raise ValueError(f"{scene / recammaster_io.VIDEOS_DIR}: need at least two camNN.mp4 clips, "
                                 f"found {cams}")
            sources = cams if wanted is None else [c for c in wanted if c in cams]
            if wanted is not None and len(sources) != len(wanted):
                missing = [c for c in wanted if c not in cams]
                raise ValueError(f"{scene / recammaster_io.VIDEOS_DIR}: source camera(s) {missing} have no clip")
            self._pairs.append([(s, t) for s in sources for t in cams if t != s])
        self._starts = [0]
        for pairs in self._pairs:
            self._starts.append(self._starts[-1] + len(pairs))
        total = self._starts[-1]
        if max_conditions and max_conditions < total:
            self._positions = [j * total // max_conditions for j in range(max_conditions)]
        else:
            self._positions = None
        self._num = len(self._positions) if self._positions is not None else total

        self.metadata_path = find_metadata(self.root)
        if self.metadata_path is None:
            raise FileNotFoundError(f"no {recammaster_io.METADATA_FILE} in {self.root} or the "
                                    f"{MAX_METADATA_LEVELS} folders above it")
        self._captions = self._read_captions(self.metadata_path)

    # ---- index -------------------------------------------------------------------------------------------

    def _read_captions(self, meta: Path) -> dict[str, str]:
        """{video path relative to root: text} for the rows of metadata.csv that lie under root."""
        captions = {}
        base = meta.parent.absolute()
        for file_name, text in recammaster_io.read_metadata(meta):
            rel = os.path.relpath(os.path.normpath(base / file_name), self.root)
            if not rel.startswith(".."):
                captions[Path(rel).as_posix()] = text
        return captions

    def __len__(self) -> int:
        return self._num

    def locate(self, i: int) -> tuple[Path, str, str]:
        """(scene folder, source camera, target camera) of item i, without reading anything."""
        if not isinstance(i, int):
            try:
                i = int(i)  # numpy / 0-d tensor indices
            except TypeError:
                raise TypeError(f"index must be an int, got {type(i).__name__}") from None
        if i < 0:
            i += self._num
        if not 0 <= i < self._num:
            raise IndexError(f"index {i} out of range for {self._num} conditions")
        flat = self._positions[i] if self._positions is not None else i
        s = bisect.bisect_right(self._starts, flat) - 1  # the scene whose conditions hold `flat`
        src, tgt = self._pairs[s][flat - self._starts[s]]
        return self.scenes[s], src, tgt

    def condition_id(self, i: int) -> str:
        """The stable id of item i, without reading any video."""
        scene, src, tgt = self.locate(i)
        return f"{self.split}/{scene.relative_to(self.root).as_posix()}/{src}-{tgt}"

    # ---- items -------------------------------------------------------------------------------------------

    def _cameras(self, scene: Path, src: str, tgt: str) -> tuple[torch.Tensor, torch.Tensor]:
        path = scene / recammaster_io.EXTRINSICS_FILE
        try:
            cams = recammaster_io.read_camera_extrinsics(path)  # ValueErrors already name the file
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read camera extrinsics: {e}") from e
        for name in (src, tgt):
            if name not in cams:
                raise ValueError(f"{path}: no camera {name!r} (has {sorted(cams)}), but {name}.mp4 exists")
        available = len(cams[src])
        if self.frames[-1] >= available:
            raise ValueError(f"{path}: {available} frames, but frame {self.frames[-1]} is needed "
                             f"(num_frames={self.num_frames}, frame_interval={self.frame_interval})")
        w2c = recammaster_io.cameras_to_relative_w2c({src: cams[src][self.frames], tgt: cams[tgt][self.frames]},
                                                     reference=src)
        return w2c[src], w2c[tgt]

    def _video(self, scene: Path, cam: str) -> torch.Tensor:
        path = scene / recammaster_io.VIDEOS_DIR / f"{cam}.mp4"
        try:
            return video_io.read_video(path, self.num_frames, self.height, self.width, 0, self.frame_interval)
        except FileNotFoundError:
            raise
        except ValueError as e:
            if str(path) in str(e):
                raise
            raise ValueError(f"{path}: cannot read video: {e}") from e
        except Exception as e:  # a corrupt file fails inside ffmpeg with errors that do not name it
            raise ValueError(f"{path}: cannot read video: {type(e).__name__}: {e}") from e

    def _intrinsics(self, scene: Path) -> torch.Tensor:
        path = scene / recammaster_io.INTRINSICS_FILE
        if not path.is_file():
            return placeholder_intrinsics(self.height, self.width, self.hfov_deg)
        K, h, w = recammaster_io.read_intrinsics(path)
        K = video_io.resize_center_crop_intrinsics(K, h, w, self.height, self.width)
        return torch.from_numpy(K).float()

    def _caption(self, scene: Path, cam: str) -> str:
        rel = (scene / recammaster_io.VIDEOS_DIR / f"{cam}.mp4").relative_to(self.root).as_posix()
        return self._captions.get(rel, "")

    def __getitem__(self, i: int) -> Condition:
        scene, src, tgt = self.locate(i)
        key = (scene, src, tgt)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        source_cams, target_cams = self._cameras(scene, src, tgt)
        rel = scene.relative_to(self.root).as_posix()
        cond = Condition(
            condition_id=f"{self.split}/{rel}/{src}-{tgt}",
            scene_id=int(_scene_hash(rel)[:12], 16),
            split=self.split,
            caption=self._caption(scene, tgt) or self._caption(scene, src),
            source_video=self._video(scene, src),
            source_cams=source_cams,
            target_cams=target_cams,
            target_video=self._video(scene, tgt),
            intrinsics=self._intrinsics(scene),
            landmarks=torch.zeros(0, 3),
            landmark_colors=torch.zeros(0, 3),
            trajectory=tgt,
            source_trajectory=src,
        )
        if self.cache_size > 0:
            self._cache[key] = cond
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return cond
