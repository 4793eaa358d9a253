"""vae: the Wan VAE from its config (random init, fp32 as the camera domain loads it) encoding and decoding one
81 x 480 x 832 clip."""

from __future__ import annotations

import torch

from scripts.device_stages import Context
from scripts.device_stages.timing import peak_gib, reset_peak, timed

SIZES = {"full": {"config": {}, "clip": (3, 81, 480, 832)}, "tiny": {"config": {"base_dim": 8}, "clip": (3, 5, 32, 32)}}
CAP = {"full": 40, "tiny": 60}
KEYS = ("clip", "encode_s", "latent_shape", "decode_s", "peak_memory_gib")


def run(device: torch.device, size: dict, ctx: Context) -> dict:
    from diffusers import AutoencoderKLWan

    from recam.domains.camera.codec import WanVAECodec

    torch.manual_seed(0)
    codec = WanVAECodec(AutoencoderKLWan(**size["config"]).to(device))  # fp32, as the camera domain loads it
    clip = torch.rand(1, *size["clip"], generator=torch.Generator().manual_seed(0)).mul(2).sub(1).to(device)
    reset_peak(device)
    out = {"clip": list(size["clip"])}
    latents = []
    out["encode_s"] = timed(lambda: latents.append(codec.encode(clip)), device)
    out["latent_shape"] = list(latents[0].shape[1:])
    out["decode_s"] = timed(lambda: codec.decode(latents[0]), device)
    out["peak_memory_gib"] = peak_gib(device)
    return out
