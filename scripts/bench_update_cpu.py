"""The CPU work of one 2,048-sample update of the GPU presets (tiny_gpu, motion_tiny_gpu) that no accelerator
removes: each sample's noise streams, drawn on the CPU so that every device sees the same numbers, and the camera
reward's landmark search, which runs on a reward thread beside the sampler.

    python scripts/bench_update_cpu.py                     # both, this machine's torch thread count
    python scripts/bench_update_cpu.py --threads 16 --repeats 5

Side by side in one run, medians over --repeats: noise drawn one stream after another (one thread) and on
--threads threads; landmarks found frame by frame and as one stack per video. Both arms of each pair give the same
numbers (tests/test_engine.py, tests/test_cam_score.py). Seconds are scaled to 2,048 samples.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config.grpo import get_config  # noqa: E402
from recam.domains.motion.skeleton import MAX_FRAMES, NUM_FEATURES  # noqa: E402  (the motion domain's sample)
from recam.engine.rollout import per_sample_noise  # noqa: E402
from rewards.pose import landmarks, to_uint8_frames  # noqa: E402
from scripts.bench_model import timed  # noqa: E402  (median of repeats after a warm-up)

UPDATE = 2048


def noise_shapes() -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """Per preset: (samples per sampling batch, draws per sample, one draw's shape)."""
    cam, motion = get_config("tiny_gpu"), get_config("motion_tiny_gpu")
    return {"tiny_gpu": (cam.sample.batch_size, cam.sample.num_steps + 1, (3, cam.data.num_frames, cam.data.size,
                                                                          cam.data.size)),
            "motion_tiny_gpu": (motion.sample.batch_size, motion.sample.num_steps + 1,
                                                  (NUM_FEATURES, 1, MAX_FRAMES))}


def bench_noise(threads: int, repeats: int) -> dict:
    out = {}
    for preset, (batch, draws, shape) in noise_shapes().items():
        keys = [(0, 0, i) for i in range(batch)]
        row = {"batch": batch, "draws": draws, "shape": list(shape)}
        for name, workers in (("one_thread_s", 1), ("threads_s", threads)):
            call = functools.partial(per_sample_noise, keys, draws, shape, workers=workers)
            row[name] = timed(call, repeats) * UPDATE / batch
        row["speedup"] = row["one_thread_s"] / row["threads_s"]
        out[preset] = row
    return out


def bench_landmarks(videos: int, repeats: int) -> dict:
    from recam.domains.camera.world import SyntheticWorld

    world = SyntheticWorld("train", videos, seed=0)
    conds = [world[i] for i in range(videos)]
    frames = [to_uint8_frames(((c.target_video.permute(1, 2, 3, 0) + 1) / 2).numpy()).astype(np.float64) / 255.0
              for c in conds]
    colors = [c.landmark_colors.double().numpy() for c in conds]

    def per_frame():
        for video, col in zip(frames, colors, strict=True):
            for frame in video:
                landmarks.find_landmarks(frame, col)

    def stacked():
        for video, col in zip(frames, colors, strict=True):
            landmarks.find_landmarks(video, col)

    row = {"videos": videos, "frames": int(frames[0].shape[0]), "size": int(frames[0].shape[1])}
    row["per_frame_s"] = timed(per_frame, repeats) * UPDATE / videos
    row["stacked_s"] = timed(stacked, repeats) * UPDATE / videos
    row["speedup"] = row["per_frame_s"] / row["stacked_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--videos", type=int, default=64, help="landmark videos timed (scaled to 2,048)")
    ap.add_argument("--out", type=Path, default=None, help="also write the results here as JSON")
    args = ap.parse_args()
    result = {"threads": args.threads, "repeats": args.repeats, "torch": torch.__version__,
              "noise": bench_noise(args.threads, args.repeats), "landmarks": bench_landmarks(args.videos, args.repeats)}
    for preset, row in result["noise"].items():
        print(f"noise {preset}: {row['one_thread_s']:.2f} s on one thread, {row['threads_s']:.2f} s on "
              f"{args.threads} ({row['speedup']:.2f}x) per {UPDATE} samples")
    lm = result["landmarks"]
    print(f"landmark search: {lm['per_frame_s']:.2f} s frame by frame, {lm['stacked_s']:.2f} s as stacks "
          f"({lm['speedup']:.2f}x) per {UPDATE} videos")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
