"""Textured synthetic world: determinism, splits, texture richness, coverage along every trajectory family, geometric
consistency of the renders, degradations, and export to / reload from ReCamMaster's layout."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
import torch

from recam.domains.camera import recammaster_io as rio
from recam.domains.camera import textured as tx
from recam.domains.camera.data import ReCamMasterDataset
from recam.domains.camera.world import (
    _AMOUNT_RANGES,
    _ROTATION_KINDS,
    _SCENE_OFFSETS,
    _TRANSLATION_KINDS,
    TRAJECTORY_KINDS,
    _look_at_c2w,
    c2w_to_w2c,
    collate_conditions,
    project_points,
    trajectory_c2w,
)

FAMILIES = ["static", *TRAJECTORY_KINDS, *(f"{r}+{t}" for r in _ROTATION_KINDS for t in _TRANSLATION_KINDS)]


@pytest.fixture(scope="module")
def scenes():
    return [tx.make_textured_scene(k, 0) for k in range(2)]


def w2c(c2w: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(c2w_to_w2c(c2w)).float()


def to_uint8(video: torch.Tensor) -> np.ndarray:
    return ((video.permute(1, 2, 3, 0).numpy() + 1.0) * 127.5).round().clip(0, 255).astype(np.uint8)


def sample(img: np.ndarray, uv: np.ndarray) -> np.ndarray:
    """Bilinear samples (L, C) of img (H, W, C) at pixel coordinates uv (L, 2)."""
    m = uv.astype(np.float32).reshape(-1, 1, 2)
    return cv2.remap(img, m[..., 0], m[..., 1], cv2.INTER_LINEAR).reshape(len(uv), -1)


# ----------------------------------------------------------------------------------------------------- dataset


def test_items_are_deterministic_and_well_formed():
    kw = dict(num_frames=4, height=32, width=56, conditions_per_scene=2)
    world = tx.TexturedWorld("train", 3, seed=0, **kw)
    again = tx.TexturedWorld("train", 3, seed=0, **kw)
    for i in range(3):
        c, d = world[i], again[i]
        assert torch.equal(c.source_video, d.source_video) and torch.equal(c.target_video, d.target_video)
        assert torch.equal(c.source_cams, d.source_cams) and torch.equal(c.target_cams, d.target_cams)
        assert (c.caption, c.trajectory, c.source_trajectory) == (d.caption, d.trajectory, d.source_trajectory)
        assert c.source_video.shape == c.target_video.shape == (3, 4, 32, 56) and c.source_video.dtype == torch.float32
        assert c.source_video.min() >= -1 and c.source_video.max() <= 1
        assert torch.equal(c.source_cams[0], torch.eye(3, 4))
        assert c.source_cams.shape == c.target_cams.shape == (4, 3, 4)
        # The target starts near the source's first pose: within 0.25 / 0.15 units, looking roughly the same way.
        start = np.linalg.inv(np.vstack([c.target_cams[0].double().numpy(), [0, 0, 0, 1]]))
        assert np.all(np.abs(start[:3, 3]) <= [0.26, 0.16, 0.26])
        assert math.degrees(math.acos(start[2, 2])) < 15
        assert not set(c.trajectory.split("+")) & set(c.source_trajectory.split("+"))
        assert {*c.trajectory.split("+"), *c.source_trajectory.split("+")} <= set(TRAJECTORY_KINDS)
        torch.testing.assert_close(c.intrinsics, tx.textured_intrinsics(32, 56))
        assert c.landmarks.shape == c.landmark_colors.shape == (0, 3)
        assert c.scene_id == world.scene_id(i) and c.condition_id == f"train/s{c.scene_id:06d}/c{i % 2}"
        assert c.caption.endswith(world.scene_description(c.scene_id)) and "textured room" in c.caption
    assert world[0] is world[0]  # cached
    assert world[-1] is world[2]
    collate_conditions([world[0], world[1]])
    other = tx.TexturedWorld("train", 1, seed=1, **kw)[0]
    assert not torch.equal(other.source_video, world[0].source_video)
    with pytest.raises(IndexError):
        world[3]
    with pytest.raises(ValueError, match="split"):
        tx.TexturedWorld("test", 1)


def test_splits_never_share_a_scene():
    ids = {}
    for split in ("train", "val", "heldout"):
        world = tx.TexturedWorld(split, 40, conditions_per_scene=4)
        ids[split] = {world.scene_id(i) for i in range(len(world))}
        assert min(ids[split]) == _SCENE_OFFSETS[split] and len(ids[split]) == 10
    assert not ids["train"] & ids["val"] and not ids["train"] & ids["heldout"] and not ids["val"] & ids["heldout"]
    # Different scene ids give different rooms.
    a, b = tx.make_textured_scene(_SCENE_OFFSETS["train"]), tx.make_textured_scene(_SCENE_OFFSETS["heldout"])
    assert not np.allclose(a.room_hi, b.room_hi)


# ----------------------------------------------------------------------------------------------------- texture


def test_texture_is_rich_enough_for_sift(scenes):
    sift = cv2.SIFT_create()
    for scene in scenes:
        c2w = tx.family_trajectory("orbit+dolly", 4, scene.centre)[[0, 3]]
        for (h, w), minimum in (((256, 448), 300), ((128, 224), 80)):
            frames = to_uint8(tx.render_textured(scene, w2c(c2w), tx.textured_intrinsics(h, w), h, w))
            for frame in frames:
                count = len(sift.detect(cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY), None))
                assert count > minimum, (scene.scene_id, h, w, count)


def test_render_is_fast_enough(scenes):
    import time

    cams = w2c(tx.family_trajectory("orbit+dolly", 16, scenes[0].centre))
    K = tx.textured_intrinsics(256, 448)
    start = time.perf_counter()
    video = tx.render_textured(scenes[0], cams, K, 256, 448)
    seconds = time.perf_counter() - start
    assert video.shape == (3, 16, 256, 448) and torch.isfinite(video).all()
    assert seconds < 4.0, seconds  # ~0.4 s measured on 2 CPU cores; generous for loaded CI machines


# ----------------------------------------------------------------------------------------------------- geometry


def test_every_family_keeps_the_view_filled(scenes):
    """Largest amounts of every family, both signs, from the world origin and from target-like start poses: every
    camera stays inside the room and clear of objects, and every pixel of every frame sees a surface."""
    h, w = 12, 21
    K = tx.textured_intrinsics(h, w)
    for scene in scenes:
        starts = [np.eye(4), _look_at_c2w(np.array([0.25, 0.15, 0.25]), scene.centre + [0.3, 0.2, 0.3]),
                  _look_at_c2w(np.array([-0.25, -0.15, -0.25]), scene.centre - [0.3, 0.2, 0.3])]
        for family in FAMILIES:
            kinds = tx.parse_family(family)
            amount = None if not kinds else [_AMOUNT_RANGES[k][1] * (0.8 if len(kinds) > 1 else 1.0) for k in kinds]
            for sign in (1.0, -1.0):
                for start in starts:
                    c2w = tx.family_trajectory(family, 5, scene.centre, sign, amount, start)
                    assert tx.trajectory_is_clear(scene, c2w), (scene.scene_id, family, sign)
                    video, depth = tx.render_textured(scene, w2c(c2w), K, h, w, return_depth=True)
                    assert torch.isfinite(depth).all() and depth.min() > 0.2, (scene.scene_id, family, sign)
                    assert torch.isfinite(video).all()
    # Dataset-style random draws are clear too.
    rng = np.random.default_rng(0)
    for _ in range(20):
        c2w, kind, phrase = tx.sample_family(rng, scenes[0], np.eye(4), 8)
        assert tx.trajectory_is_clear(scenes[0], c2w) and phrase


def test_pure_rotation_frames_are_related_by_the_rotation_homography(scenes):
    """A camera turning about its centre sees the same colours along the same rays: frame f warped by K R K^-1
    (R = frame f's world-to-camera rotation, world = frame 0) matches frame 0."""
    h, w = 128, 224
    K = tx.textured_intrinsics(h, w)
    Kn = K.double().numpy()
    c2w = trajectory_c2w(np.eye(4), ["pan", "tilt"], [math.radians(10), math.radians(-6)], scenes[1].centre, 3)
    cams = w2c(c2w)
    frames = to_uint8(tx.render_textured(scenes[1], cams, K, h, w)).astype(np.float32)

    def warp_error(R: np.ndarray) -> float:
        H = Kn @ R @ np.linalg.inv(Kn)  # frame-0 pixel -> frame-2 pixel
        flags = cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP
        warped = cv2.warpPerspective(frames[2], H, (w, h), flags=flags)
        valid = cv2.warpPerspective(np.ones((h, w), np.float32), H, (w, h), flags=flags)
        valid = cv2.erode(valid, np.ones((5, 5), np.uint8)) > 0.999
        assert valid.mean() > 0.6
        return float(np.abs(warped - frames[0])[valid].mean())

    right = warp_error(cams[2, :, :3].double().numpy())
    wrong = warp_error(cams[1, :, :3].double().numpy())
    assert right < 4.0 and right < wrong / 5, (right, wrong)  # in 0..255 intensity units


def test_renders_agree_with_project_points(scenes):
    """Surface points seen in frame 0 (its rendered depth, unprojected) land, by world.project_points, where frame k
    renders the same depth and the same colour (up to occlusion at a few pixels)."""
    h, w = 64, 112
    K = tx.textured_intrinsics(h, w)
    scene = scenes[0]
    c2w = tx.family_trajectory("orbit+dolly", 3, scene.centre)
    cams = w2c(c2w)
    video, depth = tx.render_textured(scene, cams, K, h, w, return_depth=True)
    frames = to_uint8(video).astype(np.float32)
    v, u = np.mgrid[2:h - 2:3, 2:w - 2:3]
    uv0 = np.stack([u.ravel(), v.ravel()], axis=1).astype(np.float64)
    z0 = depth[0].numpy()[v.ravel(), u.ravel()].astype(np.float64)
    rays = np.c_[uv0, np.ones(len(uv0))] @ np.linalg.inv(K.double().numpy()).T
    points = torch.from_numpy(rays * z0[:, None]).float()  # frame 0 is the world frame (start pose = identity)
    uv, z = project_points(points, cams, K)
    uv2, z2 = uv[2].double().numpy(), z[2].double().numpy()
    inside = (uv2[:, 0] > 1) & (uv2[:, 0] < w - 2) & (uv2[:, 1] > 1) & (uv2[:, 1] < h - 2)
    assert inside.mean() > 0.5
    nearest = np.round(uv2[inside]).astype(int)
    rel = depth[2].numpy()[nearest[:, 1], nearest[:, 0]] / z2[inside] - 1.0
    visible = np.abs(rel) < 0.02
    # The camera moves a lot (orbit and dolly): a quarter of the points are hidden behind nearer objects (rendered
    # depth smaller), but none may be rendered farther than it is -- that would be a hole or misplaced geometry.
    assert visible.mean() > 0.6 and (rel > 0.02).mean() < 0.02, (visible.mean(), (rel > 0.02).mean())
    colour_k = sample(frames[2], uv2[inside][visible])
    colour_0 = frames[0][v.ravel()[inside][visible], u.ravel()[inside][visible]]
    shuffled = colour_0[np.random.default_rng(0).permutation(len(colour_0))]
    err, baseline = np.abs(colour_k - colour_0).mean(), np.abs(shuffled - colour_0).mean()
    assert err < 6.0 and err < baseline / 5, (err, baseline)


# ----------------------------------------------------------------------------------------------------- trajectories


def test_family_trajectories():
    centre = np.array([0.0, 0.0, 4.5])
    static = tx.family_trajectory("static", 5, centre)
    np.testing.assert_array_equal(static, np.broadcast_to(np.eye(4), (5, 4, 4)))
    start = _look_at_c2w(np.array([0.1, 0.0, 0.0]), centre)
    np.testing.assert_array_equal(tx.family_trajectory("static", 3, centre, start_c2w=start)[2], start)
    pan = tx.family_trajectory("pan", 6, centre)
    np.testing.assert_allclose(pan, trajectory_c2w(np.eye(4), ["pan"], [0.5 * sum(_AMOUNT_RANGES["pan"])], centre, 6))
    np.testing.assert_allclose(tx.family_trajectory("pan", 6, centre, sign=-1), tx.family_trajectory(
        "pan", 6, centre, amount=-0.5 * sum(_AMOUNT_RANGES["pan"])))
    mix = tx.family_trajectory("orbit+dolly", 4, centre, amount=[0.3, 1.0], start_c2w=start)
    np.testing.assert_allclose(mix, trajectory_c2w(start, ["orbit", "dolly"], [0.3, 1.0], centre, 4))
    np.testing.assert_allclose(mix[0], start, atol=1e-12)
    with pytest.raises(ValueError, match="one amount per motion"):
        tx.family_trajectory("orbit+dolly", 4, centre, amount=0.3)
    for bad in ("spin", "pan+pan", "pan+"):
        with pytest.raises(ValueError, match="unknown trajectory family"):
            tx.family_trajectory(bad, 4, centre)
    assert tx.family_phrase("pan+truck", [0.1, -0.5]) == "pan right and truck left"
    assert tx.family_phrase("static", []) == "static camera"


# ----------------------------------------------------------------------------------------------------- degradations


def test_degradations_and_intrinsics_scaling():
    rng = np.random.default_rng(0)
    video = torch.from_numpy(rng.uniform(-1, 1, (3, 2, 16, 24)).astype(np.float32))
    frames = to_uint8(video)
    clean, s = tx.degrade(video, "clean")
    assert clean is video and s == 1.0
    for kind in ("blur", "noise"):
        out, s = tx.degrade(video, kind)
        assert s == 1.0 and out.shape == video.shape and out.dtype == torch.float32
        assert out.min() >= -1 and out.max() <= 1 and not torch.equal(out, video)
        out8, _ = tx.degrade(frames, kind)
        assert out8.dtype == np.uint8 and out8.shape == frames.shape
    blur, _ = tx.degrade(video, "blur")
    assert blur.std() < 0.5 * video.std()  # white noise loses most of its energy to a 1.5 px blur
    flat = torch.zeros(3, 2, 16, 24)
    noisy, _ = tx.degrade(flat, "noise", seed=3)
    assert abs(noisy.std().item() - 2 * tx.NOISE_SIGMA) < 0.01  # [-1, 1] is twice the [0, 1] range
    assert torch.equal(noisy, tx.degrade(flat, "noise", seed=3)[0])
    assert not torch.equal(noisy, tx.degrade(flat, "noise", seed=4)[0])
    low, s = tx.degrade(video, "lowres")
    assert s == 0.5 and low.shape == (3, 2, 8, 12)
    torch.testing.assert_close(low[:, :, 0, 0], video[:, :, :2, :2].mean(dim=(-1, -2)), atol=1e-5, rtol=0)
    low8, _ = tx.degrade(frames, "lowres")
    assert low8.shape == (2, 8, 12, 3)
    with pytest.raises(ValueError, match="even"):
        tx.degrade(video[..., :23], "lowres")
    with pytest.raises(ValueError, match="kind"):
        tx.degrade(video, "jpeg")

    K = tx.textured_intrinsics(256, 448)
    assert K[0, 0] == K[1, 1] == pytest.approx(0.9 * 448) and (K[0, 2], K[1, 2]) == (223.5, 127.5)
    K2 = tx.scale_intrinsics(K, 0.5)
    assert isinstance(K2, torch.Tensor) and torch.equal(K2, tx.textured_intrinsics(128, 224))
    assert isinstance(tx.scale_intrinsics(K.numpy(), 2.0), np.ndarray)
    # A point's pixel in the half-size image is where its full-size pixel's extent lands: u' = (u + 0.5) s - 0.5.
    X = torch.tensor([[0.3, -0.2, 2.0]])
    cam = torch.eye(3, 4)[None]
    uv, _ = project_points(X, cam, K)
    uv_half, _ = project_points(X, cam, K2)
    torch.testing.assert_close(uv_half, (uv + 0.5) * 0.5 - 0.5)


# ----------------------------------------------------------------------------------------------------- export


def test_export_then_reload_as_recammaster_data(tmp_path):
    frames, h, w, per_scene = 8, 64, 112, 2
    world = tx.TexturedWorld("train", 2 * per_scene, seed=0, num_frames=frames, height=h, width=w,
                             conditions_per_scene=per_scene)
    scene_dirs = rio.export_world(world, tmp_path, 2)
    for k, scene_dir in enumerate(scene_dirs):
        scene = rio.load_recammaster_scene(scene_dir)
        first = world[k * per_scene]
        assert scene["captions"]["cam01"] == (f"source camera, {first.source_trajectory} motion, "
                                              f"{world.scene_description(first.scene_id)}")
    for split in ("train", "heldout"):
        ds = ReCamMasterDataset(tmp_path, split, num_frames=frames, height=h, width=w, num_heldout_scenes=1,
                                source_cams=("cam01",))
        assert len(ds) == per_scene
        for i in range(len(ds)):
            scene_dir, src, tgt = ds.locate(i)
            k = scene_dirs.index(scene_dir)
            item, first = world[k * per_scene + int(tgt.removeprefix("cam")) - 2], world[k * per_scene]
            c = ds[i]
            torch.testing.assert_close(c.source_cams, first.source_cams, atol=1e-5, rtol=0)
            torch.testing.assert_close(c.target_cams, item.target_cams, atol=1e-5, rtol=0)
            assert c.caption == item.caption
            assert c.target_video.shape == item.target_video.shape == (3, frames, h, w)
            # x264 is lossy, and more so on fine texture than on the sphere world's flat shading.
            assert (c.target_video - item.target_video).abs().mean() < 0.08
            assert (c.source_video - first.source_video).abs().mean() < 0.08


def test_mip_levels_stay_aligned_with_the_texture(scenes):
    """Every mip level, sampled on the same surface grid, shows the texture at the same place: a shift between levels
    would move features whenever the level changes from one view to another (e.g. along a dolly)."""
    scene = scenes[0]
    floor = 3  # the room's max-y face; at least 11 x 13 units, so the grid stays inside its texture
    n = 256
    dens = float(scene.density[floor])
    g = (np.arange(n, dtype=np.float32) + 40.5) / dens  # level-0 texel centres
    u, v = (a.ravel() for a in np.meshgrid(g, g))
    surf = np.full(len(u), floor, np.int64)

    def grey(level: int) -> np.ndarray:
        rgb = tx._sample_level(scene, surf, np.full(len(u), level, np.int64), u, v)
        return np.ascontiguousarray(rgb.mean(axis=1).reshape(n, n), dtype=np.float64)

    base = grey(0)
    for level in (1, 2, 3):
        # Compare with level 0 smoothed about as much, so both carry the same frequencies.
        smooth = cv2.GaussianBlur(base, (0, 0), 0.9 * 2 ** level)
        (dx, dy), _ = cv2.phaseCorrelate(smooth, grey(level), cv2.createHanningWindow((n, n), cv2.CV_64F))
        assert math.hypot(dx, dy) < 0.2, (level, dx, dy)  # level-0 texels
