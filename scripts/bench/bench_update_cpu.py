"""The host's seconds per update of the GPU presets (tiny_gpu: 2,048 samples, motion_tiny_gpu: 16,384), with the
noise drawn on the device (recam.engine.rollout.KeyedNoise): what an accelerator cannot take off the host.

    python scripts/bench/bench_update_cpu.py                     # this machine's torch thread count
    python scripts/bench/bench_update_cpu.py --threads 16 --repeats 5 --out host.json

What stays on the host, per 2,048 samples, medians over --repeats:
  noise keys   three key words per sample (SeedSequence), for the sample streams and the shared starts
  pnp          the camera reward's pose estimation past the landmark search: with reward.cam.pnp="torch" (the
               default) the PnP solve runs on the device and the host only turns its poses into estimates
               (reasons, parallax: pnp_host_s); with "opencv", PnP per frame on the processes cam_score uses
               (pnp_processes_s; one per core; threads are timed beside them)
  records      the epoch record of the update (rewards, advantages (N, T), the reward's per-sample details) built
               and written as the run log writes it, and the group-relative advantages
and, side by side, the work that moved to the device (timed here on the CPU, which stands in for it): the noise
draws a rollout reads (1 + T of S + 1) against the up-front CPU streams of every draw, the landmark search and
the batched PnP solve (on 2,048 videos at once, and on CUDA where there is one).
The host total is the sum of the first three; the target is under 0.5 s per 2,048 samples for both domains.
Motion's synthetic world: its 4,096 training motions built per item (once, cold) against read back from the
world cache (motion.world_cache; medians over --repeats), what a process's first epoch costs with and without it.
Both noise paths are tested for what they draw in tests/test_device_noise.py, the landmark search against its
numpy reference in tests/test_cam_score.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from config.grpo import get_config  # noqa: E402
from recam.domains.motion.skeleton import MAX_FRAMES, NUM_FEATURES  # noqa: E402  (the motion domain's sample)
from recam.engine import records  # noqa: E402
from recam.engine.reward_runner import RewardDetails, masked_group_advantages  # noqa: E402
from recam.engine.rollout import KeyedNoise, per_sample_noise  # noqa: E402
from rewards.pose import landmarks, to_uint8_frames  # noqa: E402
from scripts.bench.bench_model import timed  # noqa: E402  (median of repeats after a warm-up)

UPDATE = 2048


def noise_shapes() -> dict[str, dict]:
    """Per preset: samples per sampling batch, draws per sample and of them those a rollout reads (the initial x
    and the T trained steps'), one draw's shape, and T."""
    from config.validate import validate

    out = {}
    for preset in ("tiny_gpu", "motion_tiny_gpu"):
        c = get_config(preset)
        T = validate(c, 1).plan.trained_steps
        shape = ((3, c.data.num_frames, c.data.size, c.data.size) if preset == "tiny_gpu"
                 else (NUM_FEATURES, 1, MAX_FRAMES))
        out[preset] = {"batch": c.sample.batch_size, "draws": c.sample.num_steps + 1, "read": 1 + T,
                       "shape": shape, "T": T, "per_update": c.sample.batch_size * c.sample.num_batches_per_epoch}
    return out


def bench_noise(threads: int, repeats: int, rows: int) -> dict:
    """Keys (host) for a whole sampling batch; draws timed on `rows` samples and scaled (on a GPU they are device
    work; the up-front CPU streams are what the GPU presets drew before)."""
    out = {}
    for preset, p in noise_shapes().items():
        keys = [(0, 0, i) for i in range(p["batch"])]
        starts = [(0, 0, i // 4, 1) for i in range(p["batch"])]
        row = {k: (list(v) if k == "shape" else v) for k, v in p.items()}
        keyed = functools.partial(KeyedNoise, keys, p["draws"], p["shape"], "cpu", starts)
        row["keys_s"] = timed(keyed, repeats) * UPDATE / p["batch"]
        noise = KeyedNoise(keys[:rows], p["draws"], p["shape"], "cpu", starts[:rows])
        def draws(noise=noise, read=p["read"]):
            return [noise.draw(j) for j in range(read)]
        row["device_draws_s"] = timed(draws, repeats) * UPDATE / rows
        for name, workers in (("cpu_streams_one_thread_s", 1), ("cpu_streams_threads_s", threads)):
            call = functools.partial(per_sample_noise, keys[:rows], p["draws"], p["shape"], workers=workers)
            row[name] = timed(call, repeats) * UPDATE / rows
        out[preset] = row
    return out


def _epoch_record_inputs(n: int, T: int, domain: str):
    """An update's gathered rewards, groups and reward details with the camera's or motion's keys and shapes."""
    g = torch.Generator().manual_seed(0)
    index = torch.arange(n // 4).repeat_interleave(4)
    if domain == "camera":
        rewards = {"cam_score": torch.rand(n, generator=g), "fidelity": torch.rand(n, generator=g)}
        frames = 8
        numbers = {f"cam_score/{k}": torch.rand(n, generator=g) for k in (
            "rot_err_sum", "trans_err_sum", "cammc_sum", "rot_err_placed_mean", "trans_err_placed_mean",
            "cammc_placed_mean", "placed_fraction", "frames_ok", "failed_frames", "rotation_only",
            "translation_scored", "static_target_parallax", "seconds", "seconds_pnp")}
        lists = {"cam_score/method": ["landmarks"] * n, "cam_score/failure_reason": [None] * n,
                 "cam_score/translation": ["scored"] * n,
                 "cam_score/rot_err_per_frame": [[0.1234] * frames for _ in range(n)],
                 "cam_score/trans_err_per_frame": [[0.1234] * frames for _ in range(n)],
                 "cam_score/confidence": [{"landmarks_found_mean": 9.5, "frames_ok": 8.0, "parallax": 0.1}] * n}
    else:
        rewards = {k: torch.rand(n, generator=g) for k in ("motion_alignment", "motion_physics")}
        numbers = {f"motion_physics/{k}": torch.rand(n, generator=g) for k in (
            "skating", "floating", "penetration", "jitter")}
        numbers["motion_alignment/text_motion_cosine"] = torch.rand(n, generator=g)
        lists = {}
    rewards["avg"] = sum(rewards.values()) / len(rewards)
    return index, rewards, RewardDetails(numbers=numbers, lists=lists, counts={})


def bench_records(repeats: int) -> dict:
    """The update's group-relative advantages, and its epoch record built and written as RunLog writes it."""
    import tempfile

    out = {}
    for preset, p in noise_shapes().items():
        domain = "camera" if preset == "tiny_gpu" else "motion"
        index, rewards, details = _epoch_record_inputs(p["per_update"], p["T"], domain)
        keep = torch.ones(len(index), dtype=torch.bool)

        def update_records(index=index, rewards=rewards, keep=keep, details=details, T=p["T"]):
            adv, _, stats = masked_group_advantages(rewards["avg"], index, keep, "group", 1e-4)
            record = records.verification_record(0, 0, {}, [f"c{i}" for i in index.tolist()], index, rewards,
                                                 adv[:, None].expand(-1, T), stats, 1.0, details)
            with tempfile.TemporaryFile("w") as f:
                f.write(json.dumps({"type": "epoch", **record}) + "\n")

        out[preset] = {"samples": p["per_update"], "records_s": timed(update_records, repeats) * UPDATE /
                       p["per_update"]}
    return out


def bench_landmarks(videos: int, repeats: int, workers: int | None = None) -> dict:
    """The camera reward's landmark work, timed on `videos` of the synthetic world and scaled to 2,048 videos.

    The search: numpy frame by frame and as one stack per video (the host path, what cam_score does with videos on
    the CPU), and torch as one batch of all the videos (find_landmarks_torch, what it does with videos on an
    accelerator), here on the CPU and, where there is one, on CUDA (frames already there; the time includes
    bringing uv and found to the host). Then PnP of the found landmarks on the host, video after video and on a
    thread pool of `workers` (LandmarkEstimator's default: min(videos, os.cpu_count())), the pool's start included,
    and on reward.cam.pnp="opencv"'s processes; beside them the batched torch solve (the default) on the CPU and on
    CUDA, and its host share. The searches give the same numbers to the bit (tests/test_cam_score.py), as do the
    OpenCV arms; the torch solve's poses are OpenCV's within tests/test_pnp_torch.py's measured tolerances."""
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

    # what cam_score does with a sampling batch of tiny_gpu (1,024 videos): PnP on its estimator's spawned
    # processes, handed over in as many pieces as estimate_device_frames cuts (the videos repeated: PnP's cost does
    # not depend on which video it solves)
    estimator = landmarks.LandmarkEstimator()
    pooled = get_config("tiny_gpu").sample.batch_size
    jobs = [(*found_np[b % videos], Ks[b % videos], points[b % videos], 0.0) for b in range(pooled)]

    def pnp_processes():
        return list(estimator.pool().map(landmarks._solve, jobs,
                                         chunksize=max(1, pooled // (4 * estimator.processes))))

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
    # the batched torch solve (reward.cam.pnp="torch") on a whole update's videos at once (the 64 repeated), on the
    # CPU and on CUDA; and the host's part after it, turning the poses into estimates
    tiled = [b % videos for b in range(UPDATE)]
    L = max(len(p) for p in points)
    uv_all, found_all = np.full((UPDATE, row["frames"], L, 2), np.nan), np.zeros((UPDATE, row["frames"], L), bool)
    for i, b in enumerate(tiled):
        uv_all[i, :, :len(points[b])], found_all[i, :, :len(points[b])] = found_np[b]
    K_all, pts_all = [Ks[b] for b in tiled], [points[b] for b in tiled]

    def solve_torch(device):
        uv_t, found_t = torch.from_numpy(uv_all).to(device), torch.from_numpy(found_all).to(device)

        def run():
            out = landmarks.solve_videos_torch(uv_t, found_t, K_all, pts_all)
            if device != "cpu":
                torch.cuda.synchronize()
            return out
        return run

    row["pnp_torch_cpu_s"] = timed(solve_torch("cpu"), repeats)
    row["pnp_torch_cuda_s"] = timed(solve_torch("cuda"), repeats) if torch.cuda.is_available() else None
    solved = landmarks.solve_videos_torch(torch.from_numpy(uv_all), torch.from_numpy(found_all), K_all, pts_all)
    row["pnp_host_s"] = timed(functools.partial(landmarks.estimates_from_poses, *solved, pts_all), repeats)
    row["pnp_one_thread_s"] = timed(pnp_one_thread, repeats) * UPDATE / videos
    row["pnp_threads_s"] = timed(pnp_threads, repeats) * UPDATE / videos
    t0 = time.perf_counter()
    estimator.pool().submit(int).result()  # the processes' start, once per run: not part of an update
    row["pnp_pool_start_s"], row["pnp_processes"] = time.perf_counter() - t0, estimator.processes
    row["pnp_processes_s"] = timed(pnp_processes, repeats) * UPDATE / pooled
    estimator.close()
    return row


def landmark_line(lm: dict) -> str:
    cuda = "" if lm["torch_cuda_s"] is None else f", {lm['torch_cuda_s']:.2f} s on {lm['cuda_device']}"
    pnp_cuda = "" if lm["pnp_torch_cuda_s"] is None else f", {lm['pnp_torch_cuda_s']:.3f} s on {lm['cuda_device']}"
    return (f"landmark search per {UPDATE} videos: numpy {lm['per_frame_s']:.2f} s frame by frame, "
            f"{lm['stacked_s']:.2f} s as stacks; torch batched {lm['torch_cpu_s']:.2f} s on the CPU "
            f"(torch threads: {lm['torch_threads']}){cuda}. PnP on the host {lm['pnp_one_thread_s']:.2f} s on one "
            f"thread, {lm['pnp_threads_s']:.2f} s on {lm['pnp_workers']} threads, {lm['pnp_processes_s']:.2f} s on "
            f"{lm['pnp_processes']} processes (started once in {lm['pnp_pool_start_s']:.1f} s). Batched torch PnP "
            f"(the default) {lm['pnp_torch_cpu_s']:.2f} s on the CPU{pnp_cuda}, then {lm['pnp_host_s']:.3f} s on "
            f"the host: {lm['pnp_one_thread_s'] / lm['pnp_torch_cpu_s']:.1f}x OpenCV's one thread on the CPU, the "
            f"host's share {lm['pnp_processes_s'] / lm['pnp_host_s']:.0f}x smaller than OpenCV on processes")


def host_seconds(result: dict) -> dict:
    """Per preset, the host's seconds per 2,048 samples: noise keys, records and (camera) PnP on the processes
    cam_score uses."""
    out = {}
    for preset in result["noise"]:
        parts = {"noise_keys": result["noise"][preset]["keys_s"], "records": result["records"][preset]["records_s"]}
        if preset == "tiny_gpu":
            parts["pnp"] = result["landmarks"]["pnp_host_s"]
        out[preset] = {**parts, "total": sum(parts.values())}
        if preset == "tiny_gpu":  # beside it, the host's total with reward.cam.pnp="opencv"
            out[preset]["total_opencv"] = out[preset]["total"] - parts["pnp"] + result["landmarks"]["pnp_processes_s"]
    return out


def bench_motion_world(conditions: int, repeats: int) -> dict:
    """The motion domain's synthetic training world (motion_tiny_gpu: 4,096 motions), every item accessed as a first
    epoch does: built per item with no cache (once: what each process paid before), then read from a world cache
    written by that build (a fresh world each repeat, its Mean/Std read from the cache too)."""
    import tempfile

    from recam.domains.motion import world as W

    with tempfile.TemporaryDirectory() as folder:
        W.reference_mean_std.cache_clear()
        start = time.perf_counter()
        cold = W.MotionWorld("train", conditions, 0, cache_dir=folder)
        for i in range(conditions):
            cold[i]
        build_s = time.perf_counter() - start

        def read():
            W.reference_mean_std.cache_clear()
            world = W.MotionWorld("train", conditions, 0, cache_dir=folder)
            for i in range(conditions):
                world[i]

        size = sum(f.stat().st_size for f in Path(folder).iterdir())
        return {"conditions": conditions, "build_s": build_s, "cached_s": timed(read, repeats),
                "cache_mb": size / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--videos", type=int, default=64, help="landmark videos timed (scaled to 2,048)")
    ap.add_argument("--rows", type=int, default=16, help="samples whose noise draws are timed (scaled to 2,048)")
    ap.add_argument("--motion-conditions", type=int, default=4096, help="motions in the world built (0: skip)")
    ap.add_argument("--out", type=Path, default=None, help="also write the results here as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {"threads": args.threads, "repeats": args.repeats, "torch": torch.__version__,
              "noise": bench_noise(args.threads, args.repeats, args.rows), "records": bench_records(args.repeats),
              "landmarks": bench_landmarks(args.videos, args.repeats)}
    result["host"] = host_seconds(result)
    if args.motion_conditions:
        result["motion_world"] = bench_motion_world(args.motion_conditions, args.repeats)
    result["load_average"] = list(__import__("os").getloadavg())
    for preset, row in result["noise"].items():
        print(f"noise {preset}: keys {row['keys_s']:.3f} s (host); the {row['read']} draws a rollout reads "
              f"{row['device_draws_s']:.2f} s (device work, here on the CPU); up-front CPU streams of all "
              f"{row['draws']} {row['cpu_streams_one_thread_s']:.2f} s on one thread, "
              f"{row['cpu_streams_threads_s']:.2f} s on {args.threads}")
    print(landmark_line(result["landmarks"]))
    for preset, row in result["host"].items():
        parts = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if not k.startswith("total"))
        opencv = f"; {row['total_opencv']:.3f} s with reward.cam.pnp=opencv" if "total_opencv" in row else ""
        print(f"host {preset}: {row['total']:.3f} s per {UPDATE} samples ({parts}){opencv}")
    if "motion_world" in result:
        mw = result["motion_world"]
        print(f"motion world of {mw['conditions']}: built per item {mw['build_s']:.1f} s (once), read from its cache "
              f"{mw['cached_s']:.2f} s ({mw['cache_mb']:.0f} MiB)")
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in result['load_average'])}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
