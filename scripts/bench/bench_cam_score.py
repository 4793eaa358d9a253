"""Accuracy and cost of cam_score's SfM estimator on the textured world: ground-truth renders of every trajectory
family under each degradation, scored against their own trajectory, against another family's, and against a
camera that turns as theirs does but stands still (the first frame's position throughout: for a translating
family the whole of its translation is then error, for pan, tilt, roll and static it is their own trajectory).

    python scripts/bench/bench_cam_score.py --scenes 2 --frames 16 --height 256 --width 448 \
        --out docs/cam_score_bench.json

Prints one row per (family, degradation) (median over scenes; RotErr and TransErr are means over the placed frames,
RotErr sum CamI2V's sum with unplaced frames at 180 deg) and the seconds per video per SfM stage (median and 90th
percentile over all videos), and writes every number to --out. The numbers in docs/results.md come from it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recam.domains.camera import textured  # noqa: E402
from recam.domains.camera.world import c2w_to_w2c  # noqa: E402
from rewards.cam_score import CamScore, CamScoreSettings, relative_trajectory  # noqa: E402
from rewards.pose import to_uint8_frames  # noqa: E402
from rewards.pose.sfm import SfMSettings  # noqa: E402
from scripts.bench.bench_cam_still import standing_still  # noqa: E402

FAMILIES = ("orbit", "dolly", "truck", "pedestal", "zoom", "orbit+truck", "pan", "tilt", "roll", "static")


def render_cases(scene_ids, families, degradations, frames, height, width):
    """Every (scene, family, degradation): uint8 frames, intrinsics, ground-truth world-to-camera poses."""
    cases = []
    for sid in scene_ids:
        scene = textured.make_textured_scene(sid)
        K = textured.textured_intrinsics(height, width)
        for family in families:
            w2c = torch.from_numpy(c2w_to_w2c(textured.family_trajectory(family, frames, scene.centre))).float()
            video = textured.render_textured(scene, w2c, K, height, width)
            for kind in degradations:
                degraded, scale = textured.degrade(video, kind, seed=sid)
                frames_u8 = to_uint8_frames(((degraded.permute(1, 2, 3, 0) + 1.0) / 2.0).numpy())
                cases.append({"scene": sid, "family": family, "degradation": kind, "frames": frames_u8,
                              "K": np.asarray(textured.scale_intrinsics(K, scale), np.float64),
                              "gt": w2c.double().numpy()})
    return cases


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenes", type=int, default=2)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--width", type=int, default=448)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-features", type=int, default=SfMSettings.max_features)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    families = tuple(args.families.split(","))
    t0 = time.perf_counter()
    cases = render_cases(range(args.scenes), families, textured.DEGRADATIONS, args.frames, args.height, args.width)
    render_s = time.perf_counter() - t0
    reward = CamScore(CamScoreSettings(estimator="sfm", max_frames=args.frames))
    reward.estimator.settings = SfMSettings(workers=args.workers, max_features=args.max_features)
    t0 = time.perf_counter()
    estimates = reward.estimator.estimate([c["frames"] for c in cases], [c["K"] for c in cases])
    sfm_wall = time.perf_counter() - t0
    own, d_own = reward.score(estimates, [c["gt"] for c in cases])
    # The same estimates against the next family's trajectory (same scene, same degradation).
    step = len(textured.DEGRADATIONS)
    n_fam = len(families)
    other = [cases[(i // (step * n_fam)) * step * n_fam + ((i // step + 1) % n_fam) * step + i % step]["gt"]
             for i in range(len(cases))]
    wrong, _ = reward.score(estimates, other)
    still, _ = reward.score(estimates, [standing_still(c["gt"]) for c in cases])

    rows = []
    for i, (c, e) in enumerate(zip(cases, estimates, strict=True)):
        rows.append({"scene": c["scene"], "family": c["family"], "degradation": c["degradation"],
                     "method": e.method, "frames_ok": int(e.ok.sum()), "score": float(own[i]),
                     "score_vs_other_family": float(wrong[i]), "score_vs_still": float(still[i]),
                     # means over the placed frames (the keys predate the sums)
                     "rot_err_deg": float(d_own["rot_err_placed_mean"][i]),
                     "trans_err": float(d_own["trans_err_placed_mean"][i]),
                     "rot_err_sum_deg": float(d_own["rot_err_sum"][i]),
                     "placed_fraction": float(d_own["placed_fraction"][i]),
                     "parallax": float(e.parallax), "target_translates": bool(
                         relative_trajectory(c["gt"], 0)[2] >= reward.settings.min_target_translation),
                     "max_frame_rot_err_deg":
                     max((x for x in d_own["rot_err_per_frame"][i] if x is not None), default=float("nan")),
                     "seconds": e.seconds, "confidence": e.confidence})
    print(f"{len(cases)} videos ({args.scenes} scenes x {n_fam} families x {step} degradations), "
          f"{args.frames} frames at {args.height}x{args.width}; render {render_s:.1f} s, SfM wall {sfm_wall:.1f} s "
          f"on {args.workers} worker(s)")
    print(f"{'family':12s} {'degradation':11s} {'method':18s} {'RotErr':>7s} {'max':>6s} {'sum':>7s} {'placed':>6s} "
          f"{'TransErr':>8s} {'parallax':>8s} {'score':>6s} {'vs other':>8s} {'vs still':>8s}")
    for family in families:
        for kind in textured.DEGRADATIONS:
            sel = [r for r in rows if r["family"] == family and r["degradation"] == kind]
            med = {k: float(np.nanmedian([r[k] for r in sel])) if any(np.isfinite(r[k]) for r in sel) else
                   float("nan") for k in ("rot_err_deg", "max_frame_rot_err_deg", "rot_err_sum_deg",
                                          "placed_fraction", "trans_err", "parallax", "score",
                                          "score_vs_other_family", "score_vs_still")}
            methods = "/".join(sorted({r["method"] for r in sel}))
            print(f"{family:12s} {kind:11s} {methods:18s} {med['rot_err_deg']:7.3f} "
                  f"{med['max_frame_rot_err_deg']:6.2f} {med['rot_err_sum_deg']:7.2f} {med['placed_fraction']:6.2f} "
                  f"{med['trans_err']:8.3f} {med['parallax']:8.4f} {med['score']:6.3f} "
                  f"{med['score_vs_other_family']:8.3f} {med['score_vs_still']:8.3f}")
    stages = sorted({k for r in rows for k in r["seconds"]})
    timing = {s: {"median": float(np.median([r["seconds"][s] for r in rows if s in r["seconds"]])),
                  "p90": float(np.percentile([r["seconds"][s] for r in rows if s in r["seconds"]], 90)),
                  "videos": sum(s in r["seconds"] for r in rows)} for s in stages}
    print("seconds per video by stage (median / p90 over the videos that ran the stage):")
    for s, t in timing.items():
        print(f"  {s:9s} {t['median']:6.2f} / {t['p90']:6.2f}  ({t['videos']} videos)")
    summary = {
        "median_rot_err_deg": float(np.nanmedian([r["rot_err_deg"] for r in rows])),
        "worst_frame_rot_err_deg": float(np.nanmax([r["max_frame_rot_err_deg"] for r in rows])),
        "own_beats_other_family": float(np.mean([r["score"] > r["score_vs_other_family"] for r in rows])),
        "fallback_share": float(np.mean([r["method"] == "sfm_rotation_only" for r in rows])),
        # a translating video against its rotations standing still, and a video whose target does not translate
        "translating_own_minus_still_min": float(min((r["score"] - r["score_vs_still"] for r in rows
                                                      if r["target_translates"]), default=float("nan"))),
        "still_target_score_min": float(min((r["score"] for r in rows if not r["target_translates"]),
                                            default=float("nan"))),
    }
    print(json.dumps(summary))
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "python": platform.python_version(),
              "render_seconds": render_s, "sfm_wall_seconds": sfm_wall, "timing": timing, "summary": summary,
              "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
