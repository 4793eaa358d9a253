"""How cam_score treats a camera asked to stand still (issue 31, item 8): ground-truth renders scored against their own
trajectory and against their own rotations with the camera held at the first frame's position.

    python scripts/bench/bench_cam_still.py --world synthetic --conditions 64      # landmark PnP, held-out world
    python scripts/bench/bench_cam_still.py --world textured --families truck,dolly,pan,static --frames 16   # SfM

A translating render should lose to its own trajectory against a target that stands still; a render whose target
does not translate (pan, tilt, roll, static) should keep its score. Prints one line per video and a summary line.
Uses only what rewards/cam_score.py has had since before the rule, so the same script measures the code before it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rewards.cam_score import CamScore, CamScoreSettings, relative_trajectory  # noqa: E402
from rewards.pose import to_uint8_frames  # noqa: E402


def standing_still(w2c: np.ndarray) -> np.ndarray:
    """World-to-camera poses (F, 3, 4) with the same rotations and every camera centre at the first one's."""
    centre = -w2c[0, :, :3].T @ w2c[0, :, 3]
    return np.concatenate([w2c[:, :, :3], -np.einsum("fij,j->fi", w2c[:, :, :3], centre)[:, :, None]], axis=2)


def synthetic_cases(n: int):
    from recam.domains.camera.world import SyntheticWorld, collate_conditions

    conds = [SyntheticWorld("heldout", n, seed=0)[i] for i in range(n)]
    videos = collate_conditions(conds)["target_video"]
    frames = [to_uint8_frames(((v.permute(1, 2, 3, 0) + 1) / 2).numpy()) for v in videos]
    return (CamScore(CamScoreSettings()), [c.trajectory for c in conds], frames,
            [c.intrinsics.double().numpy() for c in conds], [c.target_cams.double().numpy() for c in conds], conds)


def textured_cases(families: list[str], frames_n: int, height: int, width: int):
    from recam.domains.camera import textured
    from recam.domains.camera.world import c2w_to_w2c
    from rewards.pose.sfm import SfMSettings

    scene = textured.make_textured_scene(0)
    K = textured.textured_intrinsics(height, width)
    frames, gts = [], []
    for family in families:
        w2c = torch.from_numpy(c2w_to_w2c(textured.family_trajectory(family, frames_n, scene.centre))).float()
        video = textured.render_textured(scene, w2c, K, height, width)
        frames.append(to_uint8_frames(((video.permute(1, 2, 3, 0) + 1) / 2).numpy()))
        gts.append(w2c.double().numpy())
    reward = CamScore(CamScoreSettings(estimator="sfm", max_frames=frames_n))
    reward.estimator.settings = SfMSettings(workers=2)
    return reward, families, frames, [np.asarray(K, np.float64)] * len(families), gts, [None] * len(families)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", choices=("synthetic", "textured"), default="synthetic")
    p.add_argument("--conditions", type=int, default=64, help="synthetic: held-out conditions")
    p.add_argument("--families", default="truck,dolly,pan,static", help="textured: trajectory families, scene 0")
    p.add_argument("--frames", type=int, default=16, help="textured: frames per video")
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--width", type=int, default=448)
    args = p.parse_args(argv)
    if args.world == "synthetic":
        reward, names, frames, Ks, gts, conds = synthetic_cases(args.conditions)
    else:
        reward, names, frames, Ks, gts, conds = textured_cases(args.families.split(","), args.frames, args.height,
                                                                args.width)
    estimates = reward.estimator.estimate(frames, Ks, conds)
    own = reward.score(estimates, gts)[0].numpy()
    still = reward.score(estimates, [standing_still(g) for g in gts])[0].numpy()
    moves = np.array([relative_trajectory(g, 0)[2] >= reward.settings.min_target_translation for g in gts])
    parallax = np.array([getattr(e, "parallax", np.nan) for e in estimates])  # NaN before the rule existed
    for name, e, a, b, m, x in zip(names, estimates, own, still, moves, parallax, strict=True):
        print(f"{name:16s} {'translates' if m else 'stands still':12s} {e.method:18s} own {a:.3f} "
              f"vs its rotations standing still {b:.3f} parallax {x:.4f}")
    out = {"videos": len(gts), "still_targets": int((~moves).sum()),
           "still_target_score_mean": float(own[~moves].mean()) if (~moves).any() else float("nan"),
           "still_target_score_min": float(own[~moves].min()) if (~moves).any() else float("nan"),
           "translating_own_minus_still_min": float((own - still)[moves].min()) if moves.any() else float("nan"),
           "translating_vs_still_mean": float(still[moves].mean()) if moves.any() else float("nan"),
           "still_target_parallax_max": float(np.max(parallax[~moves])) if (~moves).any() else float("nan"),
           "translating_parallax_min": float(np.min(parallax[moves])) if moves.any() else float("nan")}
    print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()))
    return out


if __name__ == "__main__":
    main()
