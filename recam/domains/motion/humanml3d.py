"""HumanML3D from a local folder, as (motion, caption) conditions for MDM-style training and GRPO.

Folder layout (EricGuo5513/HumanML3D)::

    root/new_joint_vecs/<id>.npy   float (T, 263) features at 20 fps
    root/texts/<id>.txt            one caption per line: caption#word/UPOS word/UPOS ...#start#end
    root/Mean.npy, root/Std.npy    (263,) normalisation statistics
    root/train.txt, val.txt, test.txt (and train_val.txt, all.txt)   one id per line

Rules, following MDM's loader (Text2MotionDatasetV2) unless said otherwise:

* a caption line with ``start = end = 0`` describes the whole clip; any other span is its own sub-clip,
  ``motion[int(start * 20):int(end * 20)]`` (NaN spans count as 0, as in MDM);
* a clip whose full length is outside ``min_frames..max_clip_frames`` (40..199) is dropped with all its
  captions, sub-clip captions included; a sub-clip whose length is outside that range is dropped on its own.
  Both are counted in :attr:`HumanML3DDataset.stats` and logged;
* lengths are cropped down to a multiple of 4 frames (and to ``max_frames``): MDM samples lengths in units of
  4. MDM also shortens by one more unit a third of the time and crops at a random offset; ``crop="mdm"``
  reproduces that, while the default ``crop="start"`` keeps the first frames so that a condition's reference
  motion is the same every time it is read;
* features are normalised with Mean/Std and zero-padded to ``max_frames`` (196) *after* normalisation;
* ids starting with ``M`` are the left/right mirrored twins. They are used exactly as the split files list them
  (HumanML3D lists each twin in its original's split); a twin listed in a different split is a leak, which is
  logged and counted. ``mirrored=False`` drops the mirrored ids.

One item per caption line, not one per motion: MDM draws a random caption of a motion each time it is read,
but a GRPO condition must be fixed -- every sample of a group is generated for, and rewarded against, the same
caption -- so a condition is a (motion span, caption) pair. ``condition_id`` is
``"<id>:<start>-<end>:<line>"`` (source-clip frames of the span before cropping, and the caption's 1-based line
number in ``texts/<id>.txt``), stable as long as the files are; ``motion_id`` is the same without the line, and
groups the captions of one motion.

Motion arrays are read lazily (only their headers at construction), so the index of the full dataset costs
little memory.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from recam.domains.motion.skeleton import FPS, MAX_FRAMES, MIN_FRAMES, NUM_FEATURES

logger = logging.getLogger(__name__)

# MDM keeps clips strictly shorter than 200 frames.
MAX_CLIP_FRAMES = 199
# MDM's length unit (``unit_length``).
UNIT_LENGTH = 4
MIRROR_PREFIX = "M"
SPLIT_NAMES = ("train", "val", "test", "train_val", "all")
# Splits that must not share a motion (train_val and all overlap them by design).
DISJOINT_SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class MotionItem:
    """One (motion, caption) condition.

    Attributes:
        condition_id: ``"<id>:<start>-<end>:<line>"``, see the module docstring.
        motion_id: ``"<id>:<start>-<end>"``.
        source_id: the HumanML3D id (``"000123"``, ``"M000123"``).
        caption: the caption text as written.
        tokens: the ``word/UPOS`` tokens of the line (what the T2M evaluator's text encoder reads; it adds its
            own sos/eos and padding).
        features: [max_frames, 263] float32, normalised, zero after ``length``.
        length: valid frames (a multiple of 4).
        span: (start, end) frames of the source clip this condition covers, before cropping.
    """

    condition_id: str
    motion_id: str
    source_id: str
    caption: str
    tokens: tuple[str, ...]
    features: torch.Tensor
    length: int
    span: tuple[int, int]


@dataclass
class DatasetStats:
    """What indexing kept and dropped."""

    ids_listed: int = 0
    ids_used: int = 0
    captions: int = 0
    dropped_clips: list[tuple[str, int]] = field(default_factory=list)  # (id, frames)
    dropped_spans: list[tuple[str, int, int]] = field(default_factory=list)  # (id, line, frames)
    dropped_mirrored: int = 0
    mirror_leaks: list[tuple[str, str]] = field(default_factory=list)  # (id, other split)

    def summary(self, min_frames: int, max_clip_frames: int) -> str:
        text = (f"{self.captions} captions from {self.ids_used} of {self.ids_listed} listed ids; "
                f"dropped {len(self.dropped_clips)} clips and {len(self.dropped_spans)} sub-clip captions with "
                f"lengths outside {min_frames}..{max_clip_frames} frames")
        if self.dropped_mirrored:
            text += f"; dropped {self.dropped_mirrored} mirrored ids"
        if self.mirror_leaks:
            text += f"; {len(self.mirror_leaks)} mirrored twins listed in another split"
        return text


@dataclass(frozen=True)
class _Entry:
    source_id: str
    path: Path
    start: int
    end: int
    line: int
    caption: str
    tokens: tuple[str, ...]


def mirror_twin(motion_id: str) -> str:
    """``"000123"`` <-> ``"M000123"``."""
    return motion_id[1:] if motion_id.startswith(MIRROR_PREFIX) else MIRROR_PREFIX + motion_id


def read_split(path: Path) -> list[str]:
    """Ids of a split file, in order, without blanks or repeats."""
    if not path.is_file():
        raise FileNotFoundError(f"split file {path} does not exist")
    ids = [line.strip() for line in path.read_text().splitlines()]
    return list(dict.fromkeys(i for i in ids if i))


def parse_text_line(line: str, path: Path, line_no: int) -> tuple[str, tuple[str, ...], float, float]:
    """``caption#tokens#start#end`` -> (caption, tokens, start s, end s); errors name the file and line."""
    parts = line.rstrip("\r\n").split("#")
    where = f"{path}:{line_no}"
    if len(parts) != 4:
        raise ValueError(f"{where}: expected 'caption#word/UPOS ...#start#end' (4 '#'-separated fields), "
                         f"got {len(parts)} fields: {line.strip()!r}")
    caption, token_field, start_text, end_text = parts
    caption = caption.strip()
    if not caption:
        raise ValueError(f"{where}: empty caption")
    try:
        start, end = float(start_text), float(end_text)
    except ValueError as err:
        raise ValueError(f"{where}: start/end {start_text!r}, {end_text!r} are not numbers") from err
    # MDM reads NaN spans as 0, i.e. as the whole clip when both are NaN.
    start = 0.0 if math.isnan(start) else start
    end = 0.0 if math.isnan(end) else end
    if start < 0 or end < 0:
        # A negative start would index from the end of the clip and silently pick the wrong frames.
        raise ValueError(f"{where}: negative span {start_text!r}#{end_text!r}")
    tokens = tuple(t for t in token_field.strip().split(" ") if t)
    return caption, tokens, start, end


def _load_stat(path: Path, njoints: int, name: str) -> np.ndarray:
    if not path.is_file():
        raise FileNotFoundError(f"{name} file {path} does not exist")
    try:
        arr = np.load(path)
    except (ValueError, OSError) as err:
        raise ValueError(f"{path} is not a readable .npy file: {err}") from err
    if arr.shape != (njoints,):
        raise ValueError(f"{path}: {name} must have shape ({njoints},), got {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{path}: {name} has non-finite values")
    return arr.astype(np.float32)


def _array_header(path: Path, njoints: int) -> int:
    """Frames of a feature file, reading only its header; errors name the file."""
    try:
        arr = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as err:
        raise ValueError(f"{path} is not a readable .npy file: {err}") from err
    if arr.ndim != 2 or arr.shape[1] != njoints:
        raise ValueError(f"{path}: expected shape (T, {njoints}), got {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{path}: expected float features, got dtype {arr.dtype}")
    return int(arr.shape[0])


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        # One odd byte in a caption should not cost the whole dataset; say where it is and read it as latin-1.
        logger.warning("%s is not UTF-8 (%s); reading it as latin-1", path, err)
        return data.decode("latin-1")


def crop_length(frames: int, max_frames: int = MAX_FRAMES, unit: int = UNIT_LENGTH) -> int:
    """MDM's length: down to a multiple of ``unit``, at most ``max_frames`` (rounded down to the unit too)."""
    return min(frames, max_frames) // unit * unit


class HumanML3DDataset(torch.utils.data.Dataset):
    """HumanML3D (motion, caption) conditions; see the module docstring for the rules.

    Args:
        root: the HumanML3D folder.
        split: ``train``, ``val``, ``test``, ``train_val``, ``all`` (reads ``<split>.txt``) or a path to a
            split file.
        mean_std: ``"dataset"`` (root's Mean.npy/Std.npy), ``"none"`` (raw features) or a (mean, std) pair of
            arrays or .npy paths -- e.g. the T2M evaluator's own statistics.
        max_frames: padded length (MDM: 196).
        min_frames, max_clip_frames: clip and sub-clip lengths kept (MDM: 40..199).
        mirrored: keep the ``M`` ids listed in the split.
        crop: ``"start"`` (deterministic) or ``"mdm"`` (MDM's random length unit and offset, drawn from ``seed``;
            DataLoader workers each copy that generator, so reseed per worker with ``reseed`` in a
            ``worker_init_fn`` or they crop alike).
        njoints: features per frame.
    """

    def __init__(
        self,
        root: str | Path,
        split: str | Path = "train",
        mean_std: str | tuple = "dataset",
        max_frames: int = MAX_FRAMES,
        min_frames: int = MIN_FRAMES,
        max_clip_frames: int = MAX_CLIP_FRAMES,
        mirrored: bool = True,
        crop: str = "start",
        seed: int = 0,
        njoints: int = NUM_FEATURES,
    ):
        self.root = Path(root)
        self.max_frames = max_frames
        self.min_frames = min_frames
        self.max_clip_frames = max_clip_frames
        self.njoints = njoints
        if crop not in ("start", "mdm"):
            raise ValueError(f"crop must be 'start' or 'mdm', got {crop!r}")
        self.crop = crop
        self._rng = np.random.default_rng(seed)
        for sub in ("new_joint_vecs", "texts"):
            if not (self.root / sub).is_dir():
                raise FileNotFoundError(f"{self.root} has no {sub}/ folder; is it a HumanML3D root?")
        self.mean, self.std = self._read_stats(mean_std)

        split_path = self.root / f"{split}.txt" if str(split) in SPLIT_NAMES else Path(split)
        self.split_path = split_path
        ids = read_split(split_path)
        self.stats = DatasetStats(ids_listed=len(ids))
        self._check_mirror_leaks(ids, split_path)
        if not mirrored:
            kept = [i for i in ids if not i.startswith(MIRROR_PREFIX)]
            self.stats.dropped_mirrored = len(ids) - len(kept)
            ids = kept
        self._entries: list[_Entry] = []
        for motion_id in ids:
            self._index_motion(motion_id)
        logger.info("HumanML3D %s: %s", split_path.name, self.stats.summary(min_frames, max_clip_frames))

    # -- construction ----------------------------------------------------------------------------------

    def _read_stats(self, mean_std) -> tuple[np.ndarray | None, np.ndarray | None]:
        if isinstance(mean_std, str):
            if mean_std == "none":
                return None, None
            if mean_std != "dataset":
                raise ValueError(f"mean_std must be 'dataset', 'none' or a (mean, std) pair, got {mean_std!r}")
            pair = (self.root / "Mean.npy", self.root / "Std.npy")
        else:
            pair = tuple(mean_std)
            if len(pair) != 2:
                raise ValueError("mean_std must be a (mean, std) pair")
        out = []
        for value, name in zip(pair, ("Mean", "Std"), strict=True):
            if isinstance(value, (str, Path)):
                out.append(_load_stat(Path(value), self.njoints, name))
            else:
                arr = np.asarray(value, dtype=np.float32)
                if arr.shape != (self.njoints,) or not np.all(np.isfinite(arr)):
                    raise ValueError(f"{name} must be a finite ({self.njoints},) array, got shape {arr.shape}")
                out.append(arr)
        mean, std = out
        if np.any(std <= 0):
            where = pair[1] if isinstance(pair[1], (str, Path)) else "Std"
            raise ValueError(f"{where}: Std has {int(np.sum(std <= 0))} non-positive entries "
                             f"(first at feature {int(np.argmax(std <= 0))})")
        return mean, std

    def _check_mirror_leaks(self, ids: list[str], split_path: Path) -> None:
        # A twin counts as leaked when another disjoint split lists it but not the id itself; that test also
        # holds for the union splits (train_val, all) and for custom subsets, so no split needs special casing.
        for other in DISJOINT_SPLITS:
            other_path = self.root / f"{other}.txt"
            if not other_path.is_file() or other_path.resolve() == split_path.resolve():
                continue
            listed = set(read_split(other_path))
            for motion_id in ids:
                if mirror_twin(motion_id) in listed and motion_id not in listed:
                    self.stats.mirror_leaks.append((motion_id, other))
        if self.stats.mirror_leaks:
            logger.warning("%s: %d ids have their mirrored twin in another split, e.g. %s", split_path,
                           len(self.stats.mirror_leaks), self.stats.mirror_leaks[:3])

    def _index_motion(self, motion_id: str) -> None:
        motion_path = self.root / "new_joint_vecs" / f"{motion_id}.npy"
        text_path = self.root / "texts" / f"{motion_id}.txt"
        if not motion_path.is_file():
            raise FileNotFoundError(f"{motion_path} does not exist (id {motion_id} is listed in {self.split_path})")
        if not text_path.is_file():
            raise FileNotFoundError(f"{text_path} does not exist (id {motion_id} is listed in {self.split_path})")
        frames = _array_header(motion_path, self.njoints)
        if not self.min_frames <= frames <= self.max_clip_frames:
            self.stats.dropped_clips.append((motion_id, frames))
            return
        added = 0
        for line_no, line in enumerate(_read_text(text_path).splitlines(), start=1):
            if not line.strip():
                continue
            caption, tokens, start_s, end_s = parse_text_line(line, text_path, line_no)
            if start_s == 0.0 and end_s == 0.0:
                start, end = 0, frames
            else:
                start, end = int(start_s * FPS), min(int(end_s * FPS), frames)
                if not self.min_frames <= end - start <= self.max_clip_frames:
                    self.stats.dropped_spans.append((motion_id, line_no, max(end - start, 0)))
                    continue
            self._entries.append(_Entry(motion_id, motion_path, start, end, line_no, caption, tokens))
            added += 1
        if added:
            self.stats.ids_used += 1
            self.stats.captions += added

    def reseed(self, seed: int) -> None:
        """Restart the ``crop="mdm"`` generator (e.g. ``seed + worker_id`` in a DataLoader worker_init_fn)."""
        self._rng = np.random.default_rng(seed)

    # -- access ----------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def condition_ids(self) -> list[str]:
        return [self._condition_id(e) for e in self._entries]

    @staticmethod
    def _motion_id(entry: _Entry) -> str:
        return f"{entry.source_id}:{entry.start}-{entry.end}"

    def _condition_id(self, entry: _Entry) -> str:
        return f"{self._motion_id(entry)}:{entry.line}"

    def _crop(self, frames: int) -> tuple[int, int]:
        """(offset, length) within a span of ``frames``."""
        length = crop_length(frames, self.max_frames)
        if self.crop == "start":
            return 0, length
        # MDM: one unit shorter a third of the time, then a uniform offset.
        if self._rng.integers(3) == 2 and length > UNIT_LENGTH:
            length -= UNIT_LENGTH
        return int(self._rng.integers(0, frames - length + 1)), length

    def normalise(self, features: np.ndarray | torch.Tensor):
        if self.mean is None:
            return features
        if isinstance(features, torch.Tensor):
            return (features - torch.as_tensor(self.mean)) / torch.as_tensor(self.std)
        return (features - self.mean) / self.std

    def denormalise(self, features: np.ndarray | torch.Tensor):
        """Normalised model outputs back to HumanML3D features (for joints, rewards, the evaluator)."""
        if self.mean is None:
            return features
        if isinstance(features, torch.Tensor):
            std = torch.as_tensor(self.std, device=features.device, dtype=features.dtype)
            return features * std + torch.as_tensor(self.mean, device=features.device, dtype=features.dtype)
        return features * self.std + self.mean

    def __getitem__(self, index: int) -> MotionItem:
        entry = self._entries[index]
        motion = np.load(entry.path, mmap_mode="r")
        offset, length = self._crop(entry.end - entry.start)
        begin = entry.start + offset
        clip = np.asarray(motion[begin:begin + length], dtype=np.float32)
        if not np.all(np.isfinite(clip)):
            bad = int(np.argwhere(~np.isfinite(clip))[0, 0]) + begin
            raise ValueError(f"{entry.path}: non-finite features (first at frame {bad})")
        padded = np.zeros((self.max_frames, self.njoints), dtype=np.float32)
        padded[:length] = self.normalise(clip)
        return MotionItem(
            condition_id=self._condition_id(entry),
            motion_id=self._motion_id(entry),
            source_id=entry.source_id,
            caption=entry.caption,
            tokens=entry.tokens,
            features=torch.from_numpy(padded),
            length=length,
            span=(entry.start, entry.end),
        )


def collate_motion(items: Sequence[MotionItem]) -> dict:
    """A DataLoader ``collate_fn``: features [B, T, J], lengths [B], padding_mask [B, T] (True = padded),
    and the per-item lists (captions, tokens, condition_ids, motion_ids)."""
    features = torch.stack([it.features for it in items])
    lengths = torch.tensor([it.length for it in items], dtype=torch.long)
    frames = torch.arange(features.shape[1])
    return {
        "features": features,
        "lengths": lengths,
        "padding_mask": frames[None, :] >= lengths[:, None],
        "captions": [it.caption for it in items],
        "tokens": [it.tokens for it in items],
        "condition_ids": [it.condition_id for it in items],
        "motion_ids": [it.motion_id for it in items],
    }
