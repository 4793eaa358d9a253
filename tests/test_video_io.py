"""Video I/O: mp4 round trip, ReCamMaster frame sampling, resizing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recam.domains.camera import video_io as vio


def _pattern(frames: int, height: int, width: int) -> np.ndarray:
    # Smooth gradients that move with time: lossy x264 keeps them close, and every frame differs.
    yy, xx = np.mgrid[:height, :width]
    out = np.empty((frames, height, width, 3), np.uint8)
    for f in range(frames):
        out[f, ..., 0] = (xx * 4 + f * 12) % 256
        out[f, ..., 1] = (yy * 5 + f * 3) % 256
        out[f, ..., 2] = 60 + 10 * f
    return out


def test_recammaster_sampling_indices():
    assert vio.frame_indices() == list(range(81))
    cams = vio.camera_frame_indices()
    assert cams == list(range(0, 81, 4)) and len(cams) == 21 and cams[-1] == 80
    # One pose per Wan latent frame: 1 + (81 - 1) / 4 = 21.
    assert len(cams) == 1 + (vio.RECAMMASTER_NUM_FRAMES - 1) // 4
    assert vio.frame_indices(5, start=3, interval=2) == [3, 5, 7, 9, 11]
    with pytest.raises(ValueError, match="multiple of stride 4"):
        vio.camera_frame_indices(80)


def test_mp4_round_trip_pads_odd_sizes(tmp_path):
    frames = _pattern(10, 33, 47)
    path = vio.write_video(tmp_path / "out" / "sample.mp4", frames, fps=15, quality=10)
    back = vio.read_frames(path)
    assert back.shape == (10, 34, 48, 3)  # padded to even for libx264
    err = np.abs(back[:, :33, :47].astype(float) - frames.astype(float))
    assert err.mean() < 6.0
    # Frame order survives: each decoded frame is closest to its own source frame.
    per_pair = np.array([[np.abs(back[i, :33, :47].astype(float) - frames[j]).mean() for j in range(10)]
                         for i in range(10)])
    assert (per_pair.argmin(axis=1) == np.arange(10)).all()


def test_tensor_write_and_read_video_layout(tmp_path):
    frames = _pattern(12, 40, 64)
    video = vio.frames_to_tensor(frames)
    assert video.shape == (3, 12, 40, 64) and video.min() >= -1 and video.max() <= 1
    assert np.array_equal(vio.tensor_to_frames(video), frames)

    scene = tmp_path / "scene7"
    vio.write_video(vio.scene_video_path(scene, 3), video)
    assert (scene / "videos" / "cam03.mp4").is_file()

    clip = vio.read_scene_video(scene, 3, num_frames=9, height=40, width=64)
    assert clip.shape == (3, 9, 40, 64) and clip.dtype == torch.float32
    assert -1 <= clip.min() and clip.max() <= 1
    assert (clip - video[:, :9]).abs().mean() < 0.05

    strided = vio.read_video(scene / "videos" / "cam03.mp4", num_frames=3, height=40, width=64, start=1, interval=4)
    assert strided.shape == (3, 3, 40, 64)
    assert (strided - video[:, [1, 5, 9]]).abs().mean() < 0.05

    with pytest.raises(ValueError, match="has 12 frames, but frame 80 was requested"):
        vio.read_video(scene / "videos" / "cam03.mp4")


def test_resize_center_crop_covers_then_crops():
    frames = torch.zeros(2, 3, 60, 100)
    frames[..., :, 40:60] = 1.0  # a vertical stripe in the middle
    out = vio.resize_center_crop(frames, 48, 48)
    # scale = max(48/100, 48/60) = 0.8 -> 48 x 80, centre crop columns 16..64: the stripe lands at 16..32.
    assert out.shape == (2, 3, 48, 48)
    column = out[0, 0, 24]
    assert column[20:28].min() > 0.9 and column[:12].max() < 0.1 and column[36:].max() < 0.1
    up = vio.resize_center_crop(torch.rand(1, 3, 10, 10), 20, 30)
    assert up.shape == (1, 3, 20, 30)
