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


def bench_landmarks(videos: int, repeats: int, workers: int | None = None) -> dict:
    """The camera reward's landmark work, timed on `videos` of the synthetic world and scaled to 2,048 videos.

    The search: numpy frame by frame and as one stack per video (the host path, what cam_score does with videos on
    the CPU), and torch as one batch of all the videos (find_landmarks_torch, what it does with videos on an
    accelerator), here on the CPU and, where there is one, on CUDA (frames already there; the time includes
    bringing uv and found to the host). Then PnP of the found landmarks on the host, video after video and on a
    thread pool of `workers` (LandmarkEstimator's default: min(videos, os.cpu_count())), the pool's start included.
    Every arm gives the same numbers to the bit (tests/test_cam_score.py)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from recam.domains.camera.world import SyntheticWorld
    from rewards.cam_score import to_uint8_frames_torch

    world = SyntheticWorld("train", videos, seed=0)
    conds = [world[i] for i in range(videos)]
    # as cam_score quantises them: (F, H, W, 3) views of each (3, F, H, W) video
    batch = (torch.stack([c.target_video for c in conds]).permute(0, 2, 3, 4, 1) + 1.0) / 2.0
    frames = [to_uint8_frames(v.numpy()).astype(np.float64) / 255.0 for v in batch]
    frames_u8 = to_uint8_frames_torch(batch)
    colors = [c.landmark_colors.double().numpy() for c in conds]
    points = [c.landmarks.double().numpy() for c in conds]
    Ks = [c.intrinsics.double().numpy() for c in conds]
    workers = workers or min(videos, os.cpu_count() or 1)

    def per_frame():
        for video, col in zip(frames, colors, strict=True):
            for frame in video:
                landmarks.find_landmarks(frame, col)

    def stacked():
        return [landmarks.find_landmarks(video, col) for video, col in zip(frames, colors, strict=True)]

    def batched(on: torch.Tensor):
        def run():
            uv, found = landmarks.find_landmarks_torch(on, colors)
            return uv.cpu(), found.cpu()
        return run

    found_np = stacked()

    def pnp(b: int):
        uv, found = found_np[b]
        return landmarks.poses_from_landmarks(uv, found, Ks[b], points[b])

    def pnp_one_thread():
        return [pnp(b) for b in range(videos)]

    def pnp_threads():
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(pnp, range(videos)))

    row = {"videos": videos, "frames": int(frames[0].shape[0]), "size": int(frames[0].shape[1]),
           "torch_threads": torch.get_num_threads(), "pnp_workers": workers}
    row["per_frame_s"] = timed(per_frame, repeats) * UPDATE / videos
    row["stacked_s"] = timed(stacked, repeats) * UPDATE / videos
    row["speedup"] = row["per_frame_s"] / row["stacked_s"]
    row["torch_cpu_s"] = timed(batched(frames_u8), repeats) * UPDATE / videos
    row["torch_cuda_s"] = None
    if torch.cuda.is_available():
        on_gpu = frames_u8.cuda()
        row["torch_cuda_s"] = timed(batched(on_gpu), repeats) * UPDATE / videos
        row["cuda_device"] = torch.cuda.get_device_name()
    row["pnp_one_thread_s"] = timed(pnp_one_thread, repeats) * UPDATE / videos
    row["pnp_threads_s"] = timed(pnp_threads, repeats) * UPDATE / videos
    return row


PNP_KEY = "pnp_threads_s"  # the host's PnP seconds in bench_landmarks' row: on the pool cam_score uses


def LANDMARK_LINE(lm: dict) -> str:  # noqa: N802  (main's name for it)
    cuda = "" if lm["torch_cuda_s"] is None else f", {lm['torch_cuda_s']:.2f} s on {lm['cuda_device']}"
    return (f"landmark search per {UPDATE} videos: numpy {lm['per_frame_s']:.2f} s frame by frame, "
            f"{lm['stacked_s']:.2f} s as stacks; torch batched {lm['torch_cpu_s']:.2f} s on the CPU "
            f"(torch threads: {lm['torch_threads']}){cuda}. PnP on the host {lm['pnp_one_thread_s']:.2f} s on one "
            f"thread, {lm['pnp_threads_s']:.2f} s on {lm['pnp_workers']}")


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
