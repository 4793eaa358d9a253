"""The space the policy samples in: pixels (the embedded default) or the Wan VAE's latents (real scale).

A codec maps videos (B, 3, F, H, W) in [-1, 1] to the tensors the transformer denoises and back:

* :class:`PixelCodec` -- the identity; ReCam-Tiny denoises pixels directly.
* :class:`WanVAECodec` -- diffusers' ``AutoencoderKLWan`` through :mod:`recam.domains.camera.loading` (posterior
mode, latents
  standardised with the VAE config's ``latents_mean`` / ``latents_std``): 4x in time (F = 1 + 4n frames ->
  1 + n latent frames) and 8x in space, ``z_dim`` channels.

Cameras follow the latent frames: latent frame i stands for video frame i x temporal factor (frames 0, 4, ...,
F - 1), whose pose conditions it, as in ReCamMaster (:meth:`latent_cams`).
"""

from __future__ import annotations

import torch

from recam.domains.camera.video_io import camera_frame_indices


class PixelCodec:
    """Identity codec: the policy samples videos directly (3 channels, no compression)."""

    latent_channels = 3
    temporal_factor = 1
    spatial_factor = 1

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        return video

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents

    def latent_shape(self, video_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(video_shape)

    def latent_cams(self, cams: torch.Tensor) -> torch.Tensor:
        return cams


class WanVAECodec:
    """Wan VAE latents. ``vae`` is an ``AutoencoderKLWan`` (see :func:`recam.domains.camera.loading.load_wan_vae`);
    it stays frozen
    and in eval mode; encode/decode run without gradients on the VAE's device and dtype."""

    def __init__(self, vae) -> None:
        self.vae = vae.eval().requires_grad_(False)
        self.latent_channels = int(vae.config.z_dim)
        self.temporal_factor = int(vae.config.scale_factor_temporal or 4)
        self.spatial_factor = int(vae.config.scale_factor_spatial or 8)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        """From a local VAE folder or a Wan -Diffusers pipeline folder (its ``vae/`` subfolder)."""
        from recam.domains.camera.loading import load_wan_vae

        return cls(load_wan_vae(path, dtype=dtype, device=device))

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """(B, 3, F, H, W) in [-1, 1] -> (B, z, 1 + (F - 1) / 4, H / 8, W / 8) standardised latents, float32."""
        from recam.domains.camera.loading import encode_video

        return encode_video(self.vae, video).float()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Standardised latents -> (B, 3, F, H, W) video in [-1, 1], float32."""
        from recam.domains.camera.loading import decode_latents

        return decode_latents(self.vae, latents).float()

    def latent_shape(self, video_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the latents of a video shape (3, F, H, W), with or without leading batch dimensions."""
        *lead, c, f, h, w = video_shape
        t, s = self.temporal_factor, self.spatial_factor
        if c != 3 or (f - 1) % t or h % s or w % s:
            raise ValueError(f"video shape {tuple(video_shape)}: need 3 channels, F = 1 + {t}k frames and H, W "
                             f"divisible by {s}")
        return (*lead, self.latent_channels, 1 + (f - 1) // t, h // s, w // s)

    def latent_cams(self, cams: torch.Tensor) -> torch.Tensor:
        """(B, F, 3, 4) per-video-frame cameras -> (B, 1 + (F - 1) / 4, 3, 4): frames 0, 4, ..., F - 1."""
        return cams[:, camera_frame_indices(cams.shape[1], self.temporal_factor)]



def encode_once(codec, videos: torch.Tensor, keys: list, cache: dict) -> torch.Tensor:
    """codec.encode(videos) (B, 3, F, H, W), encoding each distinct key once: the k copies of a group share a source
    video, and the training pass asks for it again. `cache` (key -> encoded video) carries the results between
    calls; the caller decides its lifetime (the trainer keeps one epoch's)."""
    first = {}  # key -> its first row in this batch, for keys not yet cached
    for row, key in enumerate(keys):
        if key not in cache and key not in first:
            first[key] = row
    if first:
        encoded = codec.encode(videos[list(first.values())])
        cache.update(zip(first, encoded, strict=True))
    return torch.stack([cache[key] for key in keys])
