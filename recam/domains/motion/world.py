"""A synthetic text-to-motion world in HumanML3D's representation: captioned clips with ground-truth parameters.

Splits are disjoint by motion parameters.  Every spec has a parameter key (kind, side, speed on a 0.1 m/s grid,
turn angle, repetitions); nuisances (heading, gait phase, lead-in, clip length, caption wording) are not part of it.

* held_out: keys matching `HELD_OUT_RULES`, combinations never seen in training: 135-degree turns (between the
  trained 90 and 180), fast backwards walking (fast forward walking and slow backwards walking are trained),
  walking while waving the *left* hand (left waves alone and right waves while walking are trained), and three
  forward jumps in a row (one or two forward jumps, and three jumps in place, are trained).
* validation: the other keys whose stable hash falls in `VALIDATION_PERCENT` percent (e.g. walking at 1.3 m/s when
  training has 1.2 and 1.4): unseen values inside the training ranges.
* train: the rest.

Item i of a split is drawn from `numpy.random.default_rng([seed, split index, i])` (specs are redrawn until their
key belongs to the split), so items are deterministic in (seed, split, i) and independent of num_conditions.
Features are normalised by one Mean/Std for every world (256 training motions from a fixed seed, computed once per
process), like HumanML3D's dataset-wide Mean.npy/Std.npy.

Building an item takes 5-15 ms (synth.make_motion, then the features), so 4,096 of them cost a process's first
epoch 20-60 s. With a cache folder (config motion.world_cache), a world and the Mean/Std are built once per
machine and builder: the first access of an item builds every item of the world and writes them as one .npz
(arrays and strings, no pickle) named by the split, seed, size and a fingerprint of the code that builds them
(BUILDER_FILES, numpy's version); later processes read it (about 0.5 s for 4,096). The items are those of the
per-item builder, bit for bit (tests/test_motion_world.py).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from recam.domains.motion import skeleton as sk
from recam.domains.motion import synth
from recam.domains.motion.features import canonicalise, joints_to_features, mean_std
from recam.domains.motion.synth import MotionSpec

SPLITS: tuple[str, ...] = ("train", "validation", "held_out")
VALIDATION_PERCENT = 15
STATS_SEED = 20240601
STATS_MOTIONS = 256

# Relative frequency of each kind when sampling (locomotion is most of HumanML3D).
KIND_WEIGHTS: dict[str, float] = {
    "walk": 3.0, "run": 1.5, "walk_backward": 1.0, "sidestep": 1.0, "turn": 1.5, "jump": 1.0, "squat": 0.8,
    "kick": 1.0, "wave": 1.0, "raise_arms": 1.0, "walk_then_turn": 1.5, "walk_and_wave": 1.0,
}
TURN_ANGLES: dict[str, tuple[int, ...]] = {"turn": (45, 90, 135, 180, 360), "walk_then_turn": (90, 135, 180)}
REPETITIONS: dict[str, tuple[int, ...]] = {
    "jump": (1, 2, 3), "squat": (1, 2, 3), "kick": (1, 2, 3), "wave": (2, 3, 4, 5), "raise_arms": (1, 2),
    "walk_and_wave": (2, 3, 4, 5),
}
JUMP_SPEEDS: tuple[float, ...] = (0.0, 0.0, 0.0, 0.5, 1.0, 1.5)


@dataclass(frozen=True)
class MotionCondition:
    """One world item.  features: (MAX_FRAMES, 263) float32, normalised, zeros after `length` rows;
    joints: (length, 22, 3) canonical joints (what `features_to_joints` recovers from the denormalised features)."""

    condition_id: str
    caption: str
    features: np.ndarray
    length: int
    joints: np.ndarray
    spec: MotionSpec


def parameter_key(spec: MotionSpec) -> tuple:
    """The parameters that define a motion's content (and its split)."""
    speed = round(spec.speed, 1) if spec.kind in synth.SPEED_RANGES else 0.0
    return (spec.kind, spec.side, speed, int(round(spec.turn_deg)), spec.repetitions)


HELD_OUT_RULES = (
    ("135-degree turns", lambda k: k[3] == 135),
    ("fast backwards walking", lambda k: k[0] == "walk_backward" and k[2] >= synth.SPEED_WORD_BOUNDS[k[0]][1]),
    ("walking while waving the left hand", lambda k: k[0] == "walk_and_wave" and k[1] == "left"),
    ("three forward jumps", lambda k: k[0] == "jump" and k[2] > 0 and k[4] == 3),
)


def split_of(spec: MotionSpec) -> str:
    key = parameter_key(spec)
    if any(rule(key) for _, rule in HELD_OUT_RULES):
        return "held_out"
    if zlib.crc32(repr(key).encode()) % 100 < VALIDATION_PERCENT:
        return "validation"
    return "train"


def sample_spec(rng: np.random.Generator) -> MotionSpec:
    """A random spec: content parameters from the grids above, nuisances continuous; clip length fits the content."""
    kinds = list(KIND_WEIGHTS)
    p = np.array([KIND_WEIGHTS[k] for k in kinds])
    kind = kinds[int(rng.choice(len(kinds), p=p / p.sum()))]
    sides = synth.KIND_SIDES[kind]
    side = sides[int(rng.integers(len(sides)))]
    speed = 0.0
    if kind == "jump":
        speed = float(JUMP_SPEEDS[int(rng.integers(len(JUMP_SPEEDS)))])
    elif kind in synth.SPEED_RANGES:
        lo, hi = synth.SPEED_RANGES[kind]
        grid = np.round(np.arange(lo, hi + 1e-9, 0.1), 1)
        speed = float(grid[int(rng.integers(len(grid)))])
    turn = TURN_ANGLES.get(kind, (0,))
    turn_deg = float(turn[int(rng.integers(len(turn)))])
    reps_choices = REPETITIONS.get(kind, (1,))
    reps = int(reps_choices[int(rng.integers(len(reps_choices)))])
    lead = int(rng.integers(4, 17))
    heading = float(rng.uniform(-180.0, 180.0))
    phase = float(rng.uniform(0.0, 1.0))
    # Clip lengths in joint frames; features have one row fewer, within MDM's [MIN_FRAMES, MAX_FRAMES].
    lo_frames, hi_frames = sk.MIN_FRAMES + 1, sk.MAX_FRAMES + 1
    draft = MotionSpec(kind=kind, speed=speed, side=side, turn_deg=turn_deg, repetitions=reps, lead_frames=lead,
                       num_frames=hi_frames, heading_deg=heading, gait_phase=phase)
    need = synth.min_frames(draft)
    if kind in ("walk", "run", "walk_backward", "sidestep"):
        frames = int(rng.integers(lo_frames, hi_frames + 1))
    else:
        frames = need + int(rng.integers(0, 31))
    frames = int(np.clip(max(frames, need), lo_frames, hi_frames))
    if need > hi_frames:
        raise AssertionError(f"{draft} needs {need} frames")
    return MotionSpec(kind=kind, speed=speed, side=side, turn_deg=turn_deg, repetitions=reps, lead_frames=lead,
                      num_frames=frames, heading_deg=heading, gait_phase=phase)


def sample_split_spec(rng: np.random.Generator, split: str, max_draws: int = 10_000) -> MotionSpec:
    for _ in range(max_draws):
        spec = sample_spec(rng)
        if split_of(spec) == split:
            return spec
    raise RuntimeError(f"no {split} spec in {max_draws} draws")


def motion_features(spec: MotionSpec) -> tuple[np.ndarray, np.ndarray]:
    """(features (T-1, 263) float64 unnormalised, canonical joints (T-1, 22, 3)) of a spec."""
    joints = synth.make_motion(spec)
    feats = joints_to_features(joints)
    return feats, canonicalise(joints)[: len(feats)]


# what decides an item, bit for bit: a cache written by other code than this is never read
BUILDER_FILES = ("world.py", "synth.py", "features.py", "skeleton.py")
SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(MotionSpec))


@functools.lru_cache(maxsize=1)
def builder_fingerprint() -> str:
    h = hashlib.sha256(np.__version__.encode())
    for name in BUILDER_FILES:
        h.update((Path(__file__).parent / name).read_bytes())
    return h.hexdigest()[:16]


def _write_npz(path: Path, arrays: dict) -> None:
    """Written beside and renamed into place: processes building the same world at once never read half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


@functools.lru_cache(maxsize=4)
def reference_mean_std(cache_dir: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Mean/Std (263,) of every world: HumanML3D's procedure on `STATS_MOTIONS` training motions (fixed seed);
    read from / written to cache_dir when given."""
    path = Path(cache_dir) / f"mean_std-{builder_fingerprint()}.npz" if cache_dir else None
    if path is not None and path.exists():
        with np.load(path, allow_pickle=False) as z:
            mean, std = z["mean"], z["std"]
    else:
        feats = []
        for i in range(STATS_MOTIONS):
            rng = np.random.default_rng([STATS_SEED, i])
            feats.append(motion_features(sample_split_spec(rng, "train"))[0])
        mean, std = mean_std(feats)
        if path is not None:
            _write_npz(path, {"mean": mean, "std": std})
    mean.setflags(write=False)
    std.setflags(write=False)
    return mean, std


def _build_items(job: tuple) -> list[MotionCondition]:
    """Items of a world in a pool process: (split, num_conditions, seed, mean, std, indices) -> their items."""
    split, n, seed, mean, std, indices = job
    world = MotionWorld(split, n, seed, stats=(mean, std))  # no cache: this process builds, its parent writes
    return [world._build(i) for i in indices]


class MotionWorld(torch.utils.data.Dataset):
    """`num_conditions` captioned synthetic motions of one split; items are built on first access and kept. With
    cache_dir, the first access reads the whole world from the cache, or builds it all and writes it there."""

    def __init__(self, split: str, num_conditions: int, seed: int = 0, cache_dir: str | Path | None = None,
                 stats: tuple[np.ndarray, np.ndarray] | None = None):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.split = split
        self.num_conditions = int(num_conditions)
        self.seed = int(seed)
        self.cache_dir = str(cache_dir) if cache_dir else None
        # stats: reference_mean_std()'s, handed to a pool process that would otherwise rebuild them
        self.mean, self.std = reference_mean_std(self.cache_dir) if stats is None else stats
        self._items: dict[int, MotionCondition] = {}
        self._packed: dict[str, np.ndarray] | None = None  # the cache's arrays, until every item is unpacked
        self._complete = False  # every item is in _items or _packed

    def cache_path(self) -> Path | None:
        if not self.cache_dir:
            return None
        return Path(self.cache_dir) / f"{self.split}-s{self.seed}-n{self.num_conditions}-{builder_fingerprint()}.npz"

    def build_all(self, workers: int = 0) -> None:
        """Every item, from the cache when it has this world, else built (and written there when caching); with
        workers > 1, the items missing are built on that many spawned processes (scripts/tools/build_motion_world.py:
        a fresh machine's cache built before the runs that read it)."""
        if self._complete:
            return
        self._complete = True
        path = self.cache_path()
        if path is not None and path.exists():
            with np.load(path, allow_pickle=False) as z:
                self._packed = {k: z[k] for k in z.files}
            self._offsets = np.concatenate([[0], np.cumsum(self._packed["lengths"])])
            return
        missing = [i for i in range(self.num_conditions) if i not in self._items]
        if workers > 1 and len(missing) > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            chunks = [missing[k::workers * 4] for k in range(min(len(missing), workers * 4))]
            job = (self.split, self.num_conditions, self.seed, self.mean, self.std)
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                for chunk, built in zip(chunks, pool.map(_build_items, [(*job, c) for c in chunks]), strict=True):
                    self._items.update(zip(chunk, built, strict=True))
        items = [self._items[i] if i in self._items else self._build(i) for i in range(self.num_conditions)]
        packed = {
            "features": np.concatenate([it.features[:it.length] for it in items]) if items
            else np.zeros((0, sk.NUM_FEATURES), np.float32),
            "joints": np.concatenate([it.joints for it in items]) if items
            else np.zeros((0, sk.NUM_JOINTS, 3), np.float32),
            "lengths": np.array([it.length for it in items], np.int64),
            "captions": np.array([it.caption for it in items], dtype=str),
            **{f"spec_{k}": np.array([getattr(it.spec, k) for it in items]) for k in SPEC_FIELDS},
        }
        for i, it in enumerate(items):
            self._items[i] = it
        if path is not None:
            _write_npz(path, packed)

    def _unpack(self, i: int) -> MotionCondition:
        p = self._packed
        start, length = int(self._offsets[i]), int(p["lengths"][i])
        features = np.zeros((sk.MAX_FRAMES, sk.NUM_FEATURES), dtype=np.float32)
        features[:length] = p["features"][start:start + length]
        spec = MotionSpec(**{k: p[f"spec_{k}"][i].item() for k in SPEC_FIELDS})
        return MotionCondition(condition_id=self._condition_id(i), caption=str(p["captions"][i]), features=features,
                               length=length, joints=p["joints"][start:start + length].copy(), spec=spec)

    def _condition_id(self, i: int) -> str:
        return f"synth-{self.split}-s{self.seed}-{i:06d}"

    def __len__(self) -> int:
        return self.num_conditions

    def spec(self, i: int) -> MotionSpec:
        return sample_split_spec(self._rng(i), self.split)

    def _rng(self, i: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, SPLITS.index(self.split), i])

    def __getitem__(self, i: int) -> MotionCondition:
        if not 0 <= i < self.num_conditions:
            raise IndexError(i)
        if i not in self._items:
            if self.cache_dir:
                self.build_all()
            self._items[i] = self._unpack(i) if self._packed is not None else self._build(i)
            if self._packed is not None and len(self._items) == self.num_conditions:
                self._packed = None  # every item has its own arrays now
        return self._items[i]

    def _build(self, i: int) -> MotionCondition:
        rng = self._rng(i)
        spec = sample_split_spec(rng, self.split)
        text = synth.caption(spec, rng)
        feats, joints = motion_features(spec)
        length = len(feats)
        padded = np.zeros((sk.MAX_FRAMES, sk.NUM_FEATURES), dtype=np.float32)
        padded[:length] = (feats - self.mean) / self.std
        return MotionCondition(
            condition_id=self._condition_id(i),
            caption=text,
            features=padded,
            length=length,
            joints=joints.astype(np.float32),
            spec=spec,
        )

    def denormalise(self, features):
        """Features in HumanML3D units from normalised ones (numpy or torch, (..., 263))."""
        if isinstance(features, torch.Tensor):
            return features * torch.as_tensor(self.std, dtype=features.dtype, device=features.device) + torch.as_tensor(
                self.mean, dtype=features.dtype, device=features.device)
        return features * self.std + self.mean
