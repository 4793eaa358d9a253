"""ReCamMaster layout: matrix strings, Unreal <-> OpenCV conventions, extrinsics json, metadata.csv, world export."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from recam.domains.camera import recammaster_io as rio
from recam.domains.camera.world import SyntheticWorld


def _random_rotation(rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    return q if np.linalg.det(q) > 0 else -q


def _random_unreal(rng: np.random.Generator, frames: int) -> np.ndarray:
    """(F, 4, 4) matrices in the stored form: rotation block, zero last column, translation (cm) in the last row."""
    out = np.zeros((frames, 4, 4))
    for f in range(frames):
        out[f, :3, :3] = _random_rotation(rng).T
        out[f, 3, :3] = rng.uniform(-500, 500, size=3)
        out[f, 3, 3] = 1.0
    return out


def test_matrix_string_parse_and_format():
    s = "[1 0 0 0] [0 0.5 -2e-3 0]  [0 3 1 0] [10.5 -20 300 1]"
    m = rio.parse_matrix_string(s)
    assert m.shape == (4, 4) and m.dtype == np.float64
    assert m[1, 2] == -0.002 and m[3, 0] == 10.5 and m[3, 3] == 1.0
    again = rio.parse_matrix_string(rio.format_matrix_string(m))
    np.testing.assert_array_equal(again, m)
    assert re.fullmatch(r"(\[\S+ \S+ \S+ \S+\] ){3}\[\S+ \S+ \S+ \S+\]", rio.format_matrix_string(m))


def test_extrinsics_write_read_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    cams = {"cam01": _random_unreal(rng, 5), "cam02": _random_unreal(rng, 5), "cam10": _random_unreal(rng, 5)}
    path = rio.write_camera_extrinsics(tmp_path / "cameras" / "camera_extrinsics.json", cams)
    data = json.loads(path.read_text())
    assert list(data) == [f"frame{i}" for i in range(5)] and sorted(data["frame3"]) == ["cam01", "cam02", "cam10"]
    back = rio.read_camera_extrinsics(path)
    assert sorted(back) == sorted(cams)
    for name, m in cams.items():
        assert back[name].shape == (5, 4, 4)
        np.testing.assert_allclose(back[name], m, atol=1e-5)


def test_unreal_to_opencv_known_pose():
    # An Unreal camera at (100, 200, 300) cm with identity rotation looks along world X with Y right and Z up.
    stored = np.eye(4)
    stored[3, :3] = [100.0, 200.0, 300.0]
    c2w = rio.unreal_to_opencv_c2w(stored)
    np.testing.assert_allclose(c2w[:3, 0], [0, 1, 0])  # OpenCV x (right) = Unreal Y
    np.testing.assert_allclose(c2w[:3, 1], [0, 0, -1])  # OpenCV y (down) = -Unreal Z
    np.testing.assert_allclose(c2w[:3, 2], [1, 0, 0])  # OpenCV z (forward) = Unreal X
    np.testing.assert_allclose(c2w[:3, 3], [1.0, 2.0, 3.0])  # cm -> m
    np.testing.assert_allclose(c2w[3], [0, 0, 0, 1])


def test_convention_round_trip_and_relative_poses():
    rng = np.random.default_rng(1)
    stored = _random_unreal(rng, 6)
    c2w = rio.unreal_to_opencv_c2w(stored)
    np.testing.assert_allclose(rio.opencv_c2w_to_unreal(c2w), stored, atol=1e-6)
    np.testing.assert_allclose(rio.unreal_to_opencv_c2w(rio.opencv_c2w_to_unreal(c2w)), c2w, atol=1e-6)
    # Unreal's world is left-handed: absolute OpenCV-axes poses are reflections, relative ones proper rotations.
    np.testing.assert_allclose(np.linalg.det(c2w[:, :3, :3]), -1.0, atol=1e-9)
    rel = rio.relative_w2c(c2w, c2w[0])
    np.testing.assert_allclose(rel[0], np.eye(3, 4), atol=1e-9)
    np.testing.assert_allclose(np.linalg.det(rel[:, :3, :3]), 1.0, atol=1e-9)
    rel_c2w = rio.relative_c2w(c2w, c2w[0])
    for f in range(6):  # the two helpers are inverses of each other
        w2c = np.vstack([rel[f], [0, 0, 0, 1]])
        np.testing.assert_allclose(w2c @ np.vstack([rel_c2w[f], [0, 0, 0, 1]]), np.eye(4), atol=1e-9)


def test_metadata_quoting_round_trip(tmp_path):
    rows = [("a/videos/cam01.mp4", "pan left, then stop"), ("b/videos/cam02.mp4", 'a "quoted", multi\nline caption')]
    path = rio.write_metadata(tmp_path / "metadata.csv", rows)
    assert path.read_text().splitlines()[0] == "file_name,text"
    assert rio.read_metadata(path) == rows


def test_export_world_then_load_recovers_cameras_videos_captions(tmp_path):
    world = SyntheticWorld("train", num_conditions=4, seed=3, conditions_per_scene=2)
    scene_dirs = rio.export_world(world, tmp_path, n_scenes=2)
    assert [d.name for d in scene_dirs] == ["scene00000000", "scene00000001"]
    assert (tmp_path / "metadata.csv").is_file()
    for k, scene_dir in enumerate(scene_dirs):
        conds = [world[2 * k], world[2 * k + 1]]
        scene = rio.load_recammaster_scene(scene_dir)
        assert sorted(scene["cams"]) == ["cam01", "cam02", "cam03"]
        assert all(m.shape == (8, 4, 4) for m in scene["cams"].values())
        # Stored poses are absolute (each scene is placed away from the origin) and proper Unreal rotations.
        assert np.abs(scene["cams"]["cam01"][0, 3, :3]).max() > 10.0
        np.testing.assert_allclose(np.linalg.det(scene["cams"]["cam02"][:, :3, :3]), 1.0, atol=1e-5)

        expected = {"cam01": conds[0].source_cams, "cam02": conds[0].target_cams, "cam03": conds[1].target_cams}
        videos = {"cam01": conds[0].source_video, "cam02": conds[0].target_video, "cam03": conds[1].target_video}
        for name in expected:
            w2c = scene["w2c"][name]
            assert w2c.shape == (8, 3, 4) and w2c.dtype == torch.float32
            torch.testing.assert_close(w2c, expected[name], atol=1e-4, rtol=0)
            # The same through the public helpers, from the raw stored matrices.
            ref = rio.unreal_to_opencv_c2w(scene["cams"]["cam01"][0])
            manual = rio.relative_w2c(rio.unreal_to_opencv_c2w(scene["cams"][name]), ref)
            np.testing.assert_allclose(manual, expected[name].double().numpy(), atol=1e-4)

            video = scene["videos"][name]
            assert video.shape == (3, 8, 32, 32) and video.min() >= -1 and video.max() <= 1
            assert (video - videos[name]).abs().mean() < 0.1  # x264 is lossy

        assert scene["captions"]["cam02"] == conds[0].caption
        assert scene["captions"]["cam03"] == conds[1].caption
        assert "," in scene["captions"]["cam01"]  # survives csv quoting


def test_export_world_rejects_too_many_scenes(tmp_path):
    world = SyntheticWorld("heldout", num_conditions=2, conditions_per_scene=2)
    with pytest.raises(ValueError, match="n_scenes"):
        rio.export_world(world, tmp_path, n_scenes=2)


def _write_json(tmp_path, data) -> str:
    path = tmp_path / "cameras" / "camera_extrinsics.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


_GOOD = rio.format_matrix_string(np.eye(4))


def _frames(n: int) -> dict:
    return {f"frame{i}": {"cam01": _GOOD, "cam02": _GOOD} for i in range(n)}


def test_corrupt_json_names_file(tmp_path):
    path = _write_json(tmp_path, '{"frame0": {"cam01": "[1 0 0 0]"')
    with pytest.raises(ValueError, match=re.escape(path) + ": invalid JSON"):
        rio.read_camera_extrinsics(path)


def test_missing_frame_names_file_and_key(tmp_path):
    data = _frames(5)
    del data["frame3"]
    path = _write_json(tmp_path, data)
    with pytest.raises(ValueError, match=re.escape(path) + ": frame3: missing"):
        rio.read_camera_extrinsics(path)


def test_missing_camera_names_file_and_key(tmp_path):
    data = _frames(4)
    del data["frame2"]["cam02"]
    path = _write_json(tmp_path, data)
    with pytest.raises(ValueError, match=re.escape(path) + ": frame2/cam02: missing camera"):
        rio.read_camera_extrinsics(path)


@pytest.mark.parametrize(
    "bad",
    [
        "[1 0 0 0] [0 1 0 0] [0 0 1 0]",  # 3 rows
        "[1 0 0 0] [0 1 0] [0 0 1 0] [0 0 0 1]",  # short row
        "[1 0 0 0] [0 1 0 0] [0 0 1 0] [0 0 x 1]",  # not a number
        "1 0 0 0 0 1 0 0 0 0 1 0 0 0 0 1",  # no brackets
    ],
)
def test_malformed_matrix_names_file_and_key(tmp_path, bad):
    data = _frames(4)
    data["frame3"]["cam02"] = bad
    path = _write_json(tmp_path, data)
    with pytest.raises(ValueError, match=re.escape(path) + r": frame3/cam02: expected 4 bracketed rows of 4 numbers"):
        rio.read_camera_extrinsics(path)


def test_column_major_matrix_is_rejected(tmp_path):
    # Translation in the last column means the writer did not use Unreal's row-vector form; transposing it
    # would silently put the position in the bottom row, so the reader refuses.
    m = np.eye(4)
    m[:3, 3] = [1.0, 2.0, 3.0]
    data = _frames(2)
    data["frame1"]["cam01"] = rio.format_matrix_string(m)
    path = _write_json(tmp_path, data)
    with pytest.raises(ValueError, match=re.escape(path) + ": frame1/cam01: last column"):
        rio.read_camera_extrinsics(path)
    assert math.isclose(rio.parse_matrix_string(rio.format_matrix_string(m.T))[3, 2], 3.0)
