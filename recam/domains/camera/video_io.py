"""Video I/O for real data: ReCamMaster/MultiCamVideo clips in, generated samples out (mp4 via imageio-ffmpeg).

Dataset layout (MultiCamVideo, as ReCamMaster's training script reads it)::

    <root>/train/<...>/<scene>/videos/cam01.mp4 ... cam10.mp4   # 81 frames each, 15 fps
    <root>/train/<...>/<scene>/cameras/camera_extrinsics.json    # parsed by recam.domains.camera.recammaster_io
    <root>/metadata.csv                                          # file_name,text

Frame sampling, following ReCamMaster:

* video: frames ``start, start + interval, ...`` -- 81 consecutive frames by default (interval 1). The Wan VAE
  compresses time 4x causally, so 81 frames become 1 + 80 / 4 = 21 latent frames;
* cameras: every 4th of those 81 frames, ``0, 4, ..., 80`` -> 21 poses, one per latent frame
  (:func:`camera_frame_indices`);
* each frame is resized so that it covers (H, W) = (480, 832) keeping its aspect ratio (bilinear,
  antialiased), centre-cropped to (H, W) and mapped to [-1, 1].

Camera parsing is not done here: recam.domains.camera.recammaster_io owns camera_extrinsics.json.
"""

from __future__ import annotations

from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import torch
import torch.nn.functional as F

RECAMMASTER_NUM_FRAMES = 81
RECAMMASTER_CAMERA_STRIDE = 4
RECAMMASTER_HEIGHT = 480
RECAMMASTER_WIDTH = 832
MULTICAMVIDEO_FPS = 15


def frame_indices(num_frames: int = RECAMMASTER_NUM_FRAMES, start: int = 0, interval: int = 1) -> list[int]:
    """Indices of the video frames read for one clip."""
    if num_frames < 1 or start < 0 or interval < 1:
        raise ValueError(f"need num_frames >= 1, start >= 0, interval >= 1; got {num_frames}, {start}, {interval}")
    return [start + i * interval for i in range(num_frames)]


def camera_frame_indices(num_frames: int = RECAMMASTER_NUM_FRAMES,
                         stride: int = RECAMMASTER_CAMERA_STRIDE) -> list[int]:
    """Positions (within the clip) whose camera poses condition the model: 0, stride, ..., num_frames - 1.

    With the defaults, 81 frames -> 21 poses, matching the 21 latent frames of the Wan VAE; ``num_frames - 1``
    must therefore be a multiple of ``stride``.
    """
    if num_frames < 1 or stride < 1 or (num_frames - 1) % stride:
        raise ValueError(f"num_frames - 1 = {num_frames - 1} must be a non-negative multiple of stride {stride}")
    return list(range(0, num_frames, stride))


def scene_video_path(scene_dir: str | Path, cam: int) -> Path:
    """``<scene>/videos/camNN.mp4`` (cameras are numbered from 1 in MultiCamVideo)."""
    return Path(scene_dir) / "videos" / f"cam{cam:02d}.mp4"


def resize_center_crop(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(F, 3, h, w) float frames -> (F, 3, height, width): scale to cover, then centre-crop.

    The scale is max(width / w, height / h) and the resized size (round(h s), round(w s)), as in ReCamMaster's
    data loader, so no black bars and no stretching.
    """
    if frames.ndim != 4 or frames.shape[1] != 3:
        raise ValueError(f"frames must be (F, 3, h, w), got {tuple(frames.shape)}")
    h, w = frames.shape[-2:]
    scale = max(width / w, height / h)
    new_h, new_w = max(height, round(h * scale)), max(width, round(w * scale))
    if (new_h, new_w) != (h, w):
        frames = F.interpolate(frames, size=(new_h, new_w), mode="bilinear", align_corners=False,
                               antialias=new_h < h or new_w < w)
    top, left = (new_h - height) // 2, (new_w - width) // 2
    return frames[:, :, top:top + height, left:left + width]


def resize_center_crop_intrinsics(K: np.ndarray, h: int, w: int, height: int, width: int) -> np.ndarray:
    """Pinhole K (3, 3) of an h x w clip -> K of the same clip after resize_center_crop to height x width.

    Same sizes as resize_center_crop; a pixel edge at u maps to u * new_w / w, so a pixel centre (edge + 0.5) maps
    as u' = (u + 0.5) * new_w / w - 0.5, less the crop offset."""
    scale = max(width / w, height / h)
    new_h, new_w = max(height, round(h * scale)), max(width, round(w * scale))
    sx, sy = new_w / w, new_h / h
    top, left = (new_h - height) // 2, (new_w - width) // 2
    out = np.array(K, dtype=np.float64)
    out[0, 0], out[1, 1] = K[0, 0] * sx, K[1, 1] * sy
    out[0, 2] = (K[0, 2] + 0.5) * sx - 0.5 - left
    out[1, 2] = (K[1, 2] + 0.5) * sy - 0.5 - top
    return out


def read_frames(path: str | Path, indices: list[int] | None = None) -> np.ndarray:
    """The requested frames (all when None) of a video file as uint8 (F, H, W, 3).

    Decoding stops after the last requested index. Raises ValueError naming the file when it is too short.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no video at {path}")
    wanted = None if indices is None else sorted(set(indices))
    last = None if wanted is None else wanted[-1]
    kept: dict[int, np.ndarray] = {}
    count = 0
    reader = imageio.get_reader(str(path), format="ffmpeg")
    try:
        for i, frame in enumerate(reader):
            count = i + 1
            if wanted is None or i in wanted:
                kept[i] = np.asarray(frame)[..., :3]
            if last is not None and i >= last:
                break
    finally:
        reader.close()
    if indices is None:
        if not kept:
            raise ValueError(f"{path} contains no frames")
        return np.stack([kept[i] for i in sorted(kept)])
    if last is not None and count <= last:
        raise ValueError(f"{path} has {count} frames, but frame {last} was requested")
    return np.stack([kept[i] for i in indices])


def frames_to_tensor(frames: np.ndarray) -> torch.Tensor:
    """uint8 (F, H, W, 3) -> float32 (3, F, H, W) in [-1, 1]."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 (F, H, W, 3), got {frames.dtype} {frames.shape}")
    video = torch.from_numpy(frames).permute(3, 0, 1, 2).float()
    return video / 127.5 - 1.0


def tensor_to_frames(video: torch.Tensor) -> np.ndarray:
    """float (3, F, H, W) in [-1, 1] -> uint8 (F, H, W, 3); values outside [-1, 1] are clipped."""
    if video.ndim != 4 or video.shape[0] != 3:
        raise ValueError(f"video must be (3, F, H, W), got {tuple(video.shape)}")
    scaled = ((video.detach().float().cpu().clamp(-1, 1) + 1.0) * 127.5).round()
    return scaled.to(torch.uint8).permute(1, 2, 3, 0).numpy()


def read_video(
    path: str | Path,
    num_frames: int = RECAMMASTER_NUM_FRAMES,
    height: int = RECAMMASTER_HEIGHT,
    width: int = RECAMMASTER_WIDTH,
    start: int = 0,
    interval: int = 1,
) -> torch.Tensor:
    """A clip as ReCamMaster feeds it to the VAE: float32 (3, num_frames, height, width) in [-1, 1]."""
    frames = read_frames(path, frame_indices(num_frames, start, interval))
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).float()  # (F, 3, h, w), 0..255
    video = resize_center_crop(video, height, width)
    return (video / 127.5 - 1.0).clamp(-1.0, 1.0).permute(1, 0, 2, 3).contiguous()


def read_scene_video(scene_dir: str | Path, cam: int, **kwargs) -> torch.Tensor:
    """:func:`read_video` of ``<scene>/videos/camNN.mp4``."""
    return read_video(scene_video_path(scene_dir, cam), **kwargs)


def pad_to_even(frames: np.ndarray) -> np.ndarray:
    """Replicate the last row/column so H and W are even (libx264 with yuv420p needs even sizes)."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if not (pad_h or pad_w):
        return frames
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")


def write_video(path: str | Path, video: torch.Tensor | np.ndarray, fps: int = MULTICAMVIDEO_FPS,
                quality: float = 8.0) -> Path:
    """Write an mp4 (libx264, yuv420p).

    Args:
        path: output file; parent folders are created.
        video: float (3, F, H, W) in [-1, 1], or uint8 (F, H, W, 3).
        fps: frames per second (MultiCamVideo is 15).
        quality: imageio-ffmpeg quality 0..10 (10 best).
    """
    frames = tensor_to_frames(video) if isinstance(video, torch.Tensor) else np.asarray(video)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"video must be float (3, F, H, W) or uint8 (F, H, W, 3), got {frames.dtype} {frames.shape}")
    frames = pad_to_even(frames)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # macro_block_size=1: imageio would otherwise resize to multiples of 16; evenness is handled above.
    writer = imageio.get_writer(str(path), format="ffmpeg", fps=fps, codec="libx264", quality=quality,
                                pixelformat="yuv420p", macro_block_size=1)
    try:
        for frame in frames:
            writer.append_data(frame)
    finally:
        writer.close()
    return path
