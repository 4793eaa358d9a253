"""The synthetic text-to-motion world: skeleton, HumanML3D features, procedural motions, captions, splits."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from recam.domains.motion import features as F
from recam.domains.motion import skeleton as sk
from recam.domains.motion import synth as S
from recam.domains.motion import world as W
from recam.domains.motion.synth import MotionSpec

# One short clip of every kind (and both sides where there are sides), with a non-trivial heading.
ALL_KINDS = [
    MotionSpec("walk", 80, speed=1.3, heading_deg=30.0),
    MotionSpec("run", 60, speed=3.2, heading_deg=-50.0),
    MotionSpec("walk_backward", 60, speed=0.8, heading_deg=100.0),
    MotionSpec("sidestep", 60, speed=0.5, side="left", heading_deg=10.0),
    MotionSpec("turn", 70, side="right", turn_deg=360.0, heading_deg=170.0),
    MotionSpec("jump", 70, speed=1.0, repetitions=1, heading_deg=-120.0),
    MotionSpec("squat", 60, repetitions=1, heading_deg=45.0),
    MotionSpec("kick", 60, side="left", repetitions=1, heading_deg=-20.0),
    MotionSpec("wave", 60, side="right", repetitions=3, heading_deg=75.0),
    MotionSpec("raise_arms", 60, side="both", heading_deg=0.0),
    MotionSpec("walk_then_turn", 130, speed=1.2, side="left", turn_deg=180.0, heading_deg=-90.0),
    MotionSpec("walk_and_wave", 70, speed=1.0, side="left", repetitions=2, heading_deg=200.0),
]


SYMMETRIC_BONES = (sk.BONE_LENGTHS + sk.BONE_LENGTHS[sk.MIRROR_INDEX]) / 2


@pytest.fixture(scope="module")
def clips():
    return [(spec, S.make_motion(spec)) for spec in ALL_KINDS]


def test_skeleton_tables_agree():
    assert len(sk.JOINT_NAMES) == sk.NUM_JOINTS == 22
    assert (sk.JOINT_NAMES[7], sk.JOINT_NAMES[11], sk.JOINT_NAMES[21]) == ("left_ankle", "right_foot", "right_wrist")
    assert list(sk.PARENTS) == [-1, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 12, 13, 14, 16, 17, 18, 19]
    assert sk.CONTACT_JOINTS == (7, 10, 8, 11)
    # Mirroring is an involution that swaps every left joint with its right twin.
    assert np.array_equal(sk.MIRROR_INDEX[sk.MIRROR_INDEX], np.arange(22))
    for a, b in sk.LEFT_RIGHT_PAIRS:
        assert sk.JOINT_NAMES[a].replace("left", "right") == sk.JOINT_NAMES[b]
    rest = sk.rest_pose()
    np.testing.assert_allclose(sk.bone_lengths(rest), sk.BONE_LENGTHS, atol=1e-12)
    assert rest[:, 1].min() == 0.0 and rest[1, 0] > 0 > rest[2, 0]  # the body's left is +x


def test_generated_bone_lengths_equal_reference_every_frame(clips):
    for spec, joints in clips:
        assert joints.shape == (spec.num_frames, 22, 3), spec
        assert np.isfinite(joints).all(), spec
        np.testing.assert_allclose(sk.bone_lengths(joints), np.broadcast_to(sk.BONE_LENGTHS, joints.shape[:2]),
                                   atol=1e-9, err_msg=str(spec))


def test_feature_layout(clips):
    for spec, joints in clips:
        f = F.joints_to_features(joints)
        assert f.shape == (spec.num_frames - 1, 263)
        assert np.isfinite(f).all()
        assert set(np.unique(f[:, F.CONTACTS])) <= {0.0, 1.0}
        assert (f[:, 3] > 0.3).all(), spec  # root height above the floor
        # ric y is absolute height; feet are the lowest joints and touch the floor at some point.
        ric = f[:, F.RIC].reshape(-1, 21, 3)
        assert ric[..., 1].min() > -1e-9
        # 6D rotations are the first two columns of rotation matrices: unit and orthogonal.
        r6 = f[:, F.ROT6D].reshape(-1, 21, 6)
        np.testing.assert_allclose(np.linalg.norm(r6[..., :3], axis=-1), 1.0, atol=1e-9)
        np.testing.assert_allclose(np.sum(r6[..., :3] * r6[..., 3:], axis=-1), 0.0, atol=1e-9)
    # Standing still: every foot in contact, no velocity.
    wave = S.make_motion(MotionSpec("wave", 60, side="left", repetitions=2))
    f = F.joints_to_features(wave)
    assert (f[:5, F.CONTACTS] == 1).all()
    np.testing.assert_allclose(f[:5, F.LOCAL_VEL], 0.0, atol=1e-9)


def test_features_to_joints_round_trip(clips):
    for spec, joints in clips:
        f = F.joints_to_features(joints)
        canon = F.canonicalise(joints)[:-1]  # the last frame only ends the last velocities
        rec64 = F.features_to_joints(torch.from_numpy(f)).numpy()
        assert np.abs(rec64 - canon).max() < 1e-9, spec
        rec32 = F.features_to_joints(torch.from_numpy(f).float()).numpy()
        assert np.abs(rec32 - canon).max() < 1e-4, spec
    # Batched: (B, T, 263) -> (B, T, 22, 3), each item as alone.
    batch = np.stack([F.joints_to_features(j[:50]) for _, j in clips[:3]])
    rec = F.features_to_joints(torch.from_numpy(batch))
    assert rec.shape == (3, 49, 22, 3)
    np.testing.assert_allclose(rec[1].numpy(), F.features_to_joints(torch.from_numpy(batch[1])).numpy(), atol=1e-12)


def test_canonicalisation_faces_plus_z(clips):
    for spec, joints in clips:
        c = F.canonicalise(joints)
        assert abs(c[..., 1].min()) < 1e-12
        np.testing.assert_allclose(c[0, 0, [0, 2]], 0.0, atol=1e-12)
        # Facing recomputed independently: normal of the hips+shoulders "across" vector, by hand.
        across = (c[0, 2] - c[0, 1]) + (c[0, 17] - c[0, 16])
        forward = np.cross([0.0, 1.0, 0.0], across)
        assert forward[2] > 0 and abs(np.arctan2(forward[0], forward[2])) < 1e-9, spec
        # Canonical form is invariant to where the clip was in the world.
        yaw, shift = 1.234, np.array([3.0, 0.7, -2.0])
        moved = joints @ sk.rot_y(yaw).T + shift
        np.testing.assert_allclose(F.canonicalise(moved), c, atol=1e-9)
        np.testing.assert_allclose(F.joints_to_features(moved), F.joints_to_features(joints), atol=1e-9)
    # A standing body built facing `heading` is turned back by exactly -heading (with left/right symmetric bones:
    # the reference skeleton's slightly different hips and shoulders tilt its hips+shoulders facing by ~0.3 mrad).
    joints, _ = S.synthesize(MotionSpec("squat", 60, heading_deg=63.0), SYMMETRIC_BONES)
    expected = (joints - joints[0, 0] * np.array([1.0, 0.0, 1.0])) @ sk.rot_y(np.radians(-63.0)).T
    expected[..., 1] -= joints[..., 1].min()
    np.testing.assert_allclose(F.canonicalise(joints), expected, atol=1e-9)


@pytest.mark.parametrize(
    "kind,speed,side,direction",
    [("walk", 0.7, "none", (0, 1)), ("walk", 1.8, "none", (0, 1)), ("run", 3.0, "none", (0, 1)),
     ("walk_backward", 0.8, "none", (0, -1)), ("sidestep", 0.5, "left", (1, 0)), ("sidestep", 0.5, "right", (-1, 0))],
)
def test_speed_recovered_from_root_velocity_features(kind, speed, side, direction):
    spec = MotionSpec(kind, 197, speed=speed, side=side, heading_deg=40.0)
    f = F.joints_to_features(S.make_motion(spec))
    _, root = F.recover_root(torch.from_numpy(f))
    root = root.numpy()
    seconds = (len(f) - 1) / sk.FPS
    measured = np.linalg.norm(root[-1, [0, 2]] - root[0, [0, 2]]) / seconds
    assert abs(measured - speed) < 0.03 * speed, (measured, speed)
    # In the root frame the body moves the way the spec says (+z forward, +x its left).
    mean_vel = f[:, 1:3].mean(axis=0) * sk.FPS
    np.testing.assert_allclose(mean_vel, np.array(direction) * speed, atol=0.05 * speed)


def test_planted_feet_do_not_slide():
    for spec in (MotionSpec("walk", 150, speed=1.4), MotionSpec("run", 100, speed=3.4),
                 MotionSpec("turn", 60, side="left", turn_deg=90.0), MotionSpec("kick", 60, side="right")):
        c = F.canonicalise(S.make_motion(spec))
        for j in (10, 11):
            low = (c[:-1, j, 1] < 0.05) & (c[1:, j, 1] < 0.05)
            speed = np.linalg.norm(np.diff(c[:, j][:, [0, 2]], axis=0), axis=-1) * sk.FPS
            assert np.mean(low & (speed > 0.5)) < 0.03, spec
            assert c[:, j, 1].min() > -1e-9


@pytest.mark.parametrize(
    "left",
    [MotionSpec("wave", 60, side="left", repetitions=3), MotionSpec("kick", 60, side="left", repetitions=1),
     MotionSpec("raise_arms", 60, side="left"), MotionSpec("turn", 60, side="left", turn_deg=90.0),
     MotionSpec("sidestep", 50, speed=0.5, side="left")],
)
def test_left_mirrored_is_right(left):
    right = MotionSpec(**{**left.__dict__, "side": "right"})
    # With left/right symmetric bones the mirror image of the left motion is exactly the right motion ...
    jl, _ = S.synthesize(left, SYMMETRIC_BONES)
    jr, _ = S.synthesize(right, SYMMETRIC_BONES)
    np.testing.assert_allclose(sk.mirror_joints(jl), jr, atol=1e-9)
    # ... and with the reference skeleton (whose sides differ by up to 9 mm per bone) it is within a few cm.
    diff = np.abs(F.canonicalise(sk.mirror_joints(S.make_motion(left))) - F.canonicalise(S.make_motion(right)))
    assert diff.max() < 0.04


_SIDE_WORDS = {"left": ("left", "counterclockwise"), "right": ("right", "clockwise")}


def test_captions_name_sides_correctly():
    for kind, sides in S.KIND_SIDES.items():
        for side in sides:
            if side == "none":
                continue
            spec = MotionSpec(kind, 100, speed=S.SPEED_RANGES.get(kind, (0.0, 0.0))[0], side=side,
                              turn_deg=90.0 if "turn" in kind else 0.0, repetitions=2)
            for text in S.caption_templates(spec):
                words = set(re.findall(r"[a-z]+", text.format(s="a person")))
                if side == "both":
                    assert words & {"both", "arms"} and not words & {"left", "right"}, text
                    continue
                other = "right" if side == "left" else "left"
                assert words & set(_SIDE_WORDS[side]), text
                assert not words & set(_SIDE_WORDS[other]), text
    # Captions without sides say none.
    for spec in (MotionSpec("walk", speed=1.0), MotionSpec("jump"), MotionSpec("squat")):
        assert all(not re.search(r"\b(left|right)\b", t) for t in S.caption_templates(spec))
    # Speed words follow the speed.
    assert any("slowly" in t for t in S.caption_templates(MotionSpec("walk", speed=0.6)))
    assert not any("slow" in t for t in S.caption_templates(MotionSpec("walk", speed=1.8)))
    text = S.caption(MotionSpec("turn", side="left", turn_deg=90.0), np.random.default_rng(1))
    assert text == S.caption(MotionSpec("turn", side="left", turn_deg=90.0), np.random.default_rng(1))


def test_splits_are_disjoint_by_parameters():
    keys = {split: {W.parameter_key(W.MotionWorld(split, 400, seed=5).spec(i)) for i in range(400)}
            for split in W.SPLITS}
    assert not keys["train"] & keys["validation"]
    assert not keys["train"] & keys["held_out"]
    assert not keys["validation"] & keys["held_out"]
    assert all(any(rule(k) for _, rule in W.HELD_OUT_RULES) for k in keys["held_out"])
    assert not any(any(rule(k) for _, rule in W.HELD_OUT_RULES) for k in keys["train"])
    # Every rule has examples in the held-out split, and every kind is trained.
    assert all(any(rule(k) for k in keys["held_out"]) for _, rule in W.HELD_OUT_RULES)
    assert {k[0] for k in keys["train"]} == set(S.KINDS)


def test_world_items_and_determinism():
    world = W.MotionWorld("train", 6, seed=3)
    again = W.MotionWorld("train", 50, seed=3)
    other = W.MotionWorld("train", 6, seed=4)
    for i in range(len(world)):
        a, b = world[i], again[i]
        assert a.condition_id == b.condition_id and a.caption == b.caption and a.spec == b.spec
        np.testing.assert_array_equal(a.features, b.features)
        assert a.features.shape == (sk.MAX_FRAMES, 263) and a.features.dtype == np.float32
        assert sk.MIN_FRAMES <= a.length <= sk.MAX_FRAMES
        assert not a.features[a.length:].any()
        assert a.joints.shape == (a.length, 22, 3)
        # The normalised features decode to the canonical joints.
        rec = F.features_to_joints(torch.from_numpy(world.denormalise(a.features[: a.length]))).numpy()
        assert np.abs(rec - a.joints).max() < 2e-3
    assert [world[i].spec for i in range(6)] != [other[i].spec for i in range(6)]
    assert len({world[i].condition_id for i in range(6)}) == 6
    with pytest.raises(IndexError):
        world[6]


def test_a_cached_world_is_the_per_item_builder_s_bit_for_bit(tmp_path):
    """The first world with a cache folder builds every item (the per-item builder, MotionWorld._build) and writes
    them; a second reads them back: the same items to the bit, Mean/Std too, without building one."""
    n = 12
    reference = W.MotionWorld("train", n, seed=3)
    first = W.MotionWorld("train", n, seed=3, cache_dir=tmp_path)
    first[5]  # one access builds the whole world
    assert first.cache_path().exists() and len(first._items) == n
    W.reference_mean_std.cache_clear()
    second = W.MotionWorld("train", n, seed=3, cache_dir=tmp_path)
    second._build = None  # reading the cache must build nothing
    for i in range(n):
        a, b = reference[i], second[i]
        assert (a.condition_id, a.caption, a.length, a.spec) == (b.condition_id, b.caption, b.length, b.spec)
        for x, y in ((a.features, b.features), (a.joints, b.joints)):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(second.mean, reference.mean)
    np.testing.assert_array_equal(second.std, reference.std)
    assert second._packed is None  # every item unpacked: the cache's arrays are let go
    # another size, seed or split is another file; a file that is not a cache of this builder is never read
    assert W.MotionWorld("train", n + 1, seed=3, cache_dir=tmp_path).cache_path() != first.cache_path()
    assert all(f.name.endswith(f"-{W.builder_fingerprint()}.npz") for f in tmp_path.iterdir())


def test_a_world_built_on_processes_is_the_per_item_builder_s(tmp_path):
    """build_all(workers) (scripts/tools/build_motion_world.py) builds on spawned processes what the per-item builder
    builds here, to the bit, and writes the cache the next world reads."""
    n = 6
    reference = W.MotionWorld("held_out", n, seed=2)
    pooled = W.MotionWorld("held_out", n, seed=2, cache_dir=tmp_path)
    pooled.build_all(workers=2)
    assert pooled.cache_path().exists()
    for i in range(n):
        a, b = reference[i], pooled[i]
        assert (a.condition_id, a.caption, a.length, a.spec) == (b.condition_id, b.caption, b.length, b.spec)
        np.testing.assert_array_equal(a.features, b.features)
        np.testing.assert_array_equal(a.joints, b.joints)


def test_mean_std_like_humanml3d():
    mean, std = W.reference_mean_std()
    assert mean.shape == std.shape == (263,) and (std > 0).all()
    for group in F.STD_GROUPS:
        assert np.ptp(std[group]) == 0.0  # one std per group
    # Per-group averaging by hand on random data.
    data = [np.random.default_rng(0).normal(size=(30, 263)) * np.arange(1, 264)]
    m, s = F.mean_std(data)
    np.testing.assert_allclose(m, data[0].mean(0))
    np.testing.assert_allclose(s[F.RIC], data[0].std(0)[F.RIC].mean())
    assert F.mean_std([np.zeros((4, 263))])[1].tolist() == [1.0] * 263


_SAMPLE = os.environ.get("RECAM_HUMANML3D_SAMPLE")


@pytest.mark.skipif(not _SAMPLE, reason="set RECAM_HUMANML3D_SAMPLE to a folder with new_joints/ and new_joint_vecs/")
def test_against_a_real_humanml3d_clip():
    folder = Path(_SAMPLE)
    clip = sorted((folder / "new_joint_vecs").glob("*.npy"))[0].name
    vecs = np.load(folder / "new_joint_vecs" / clip).astype(np.float64)
    joints = np.load(folder / "new_joints" / clip).astype(np.float64)
    np.testing.assert_allclose(F.features_to_joints(torch.from_numpy(vecs)).numpy(), joints, atol=1e-5)
    # `new_joints` are canonical joints of the clip less its last frame; recomputing features from them agrees
    # wherever the smoothing of the facing (sigma 20 frames) does not reach the missing frame.
    ours = F.joints_to_features(joints)
    np.testing.assert_allclose(ours[:100], vecs[:100], atol=1e-4)
