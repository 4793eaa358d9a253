"""fidelity: visual fidelity of a generated video, so camera accuracy cannot be bought with broken frames.

fidelity = similarity * temporal_consistency, in [0, 1]:
- similarity: PSNR to the ground-truth target render (peak-to-peak 2 for [-1, 1] videos), mapped linearly from
  PSNR_FLOOR dB (0) to PSNR_CEIL dB (1) and clipped;
- temporal consistency: exp(-excess / FLICKER_SCALE), where excess is how much the mean absolute frame-to-frame
  change of the video exceeds that of the ground truth (flicker beyond the true motion).
A non-finite video scores NaN (a failed score), never 0 by accident.
"""

from __future__ import annotations

import torch

from rewards import Reward, register_reward

PSNR_FLOOR, PSNR_CEIL = 10.0, 40.0
FLICKER_SCALE = 0.05


def fidelity_terms(videos: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """videos, targets (B, 3, F, H, W) in [-1, 1] -> psnr, similarity, flicker_excess, temporal, fidelity (B,)."""
    v, g = videos.float(), targets.float()
    mse = ((v - g) ** 2).flatten(1).mean(1)
    psnr = 10.0 * torch.log10(4.0 / mse.clamp_min(1e-10))
    similarity = ((psnr - PSNR_FLOOR) / (PSNR_CEIL - PSNR_FLOOR)).clamp(0.0, 1.0)
    flicker = lambda x: (x[:, :, 1:] - x[:, :, :-1]).abs().flatten(1).mean(1)
    excess = (flicker(v) - flicker(g)).clamp_min(0.0)
    temporal = torch.exp(-excess / FLICKER_SCALE)
    fid = similarity * temporal
    fid = torch.where(torch.isfinite(v.flatten(1)).all(1), fid, torch.full_like(fid, float("nan")))
    return {"psnr": psnr, "similarity": similarity, "flicker_excess": excess, "temporal": temporal, "fidelity": fid}


def fidelity(videos: torch.Tensor, conditions: list) -> tuple[torch.Tensor, dict]:
    """fidelity_terms of videos (B, 3, F, H, W) in [-1, 1] against their conditions' target videos."""
    targets = torch.stack([c.target_video for c in conditions]).to(videos.device)
    terms = fidelity_terms(videos, targets)
    return terms.pop("fidelity").cpu(), {k: t.cpu() for k, t in terms.items()}


@register_reward("fidelity", scores="video")
def build_fidelity(config=None, device=None) -> Reward:
    """fidelity has nothing to configure or hold: the reward object is the pure function itself."""
    return fidelity
