"""ReCam-Tiny: a camera-conditioned flow-matching video transformer on diffusers' Wan2.1 DiT.

The design follows ReCamMaster (arXiv 2503.11647):

* the clean source video and the noisy target video are concatenated along the frame axis,
  target first, giving a (B, C, 2F, H, W) input; Wan's 3D RoPE therefore places the target frames
  at temporal positions 0..F-1 and the source frames at F..2F-1, so attention can tell them apart;
* every DiT block owns ``cam_encoder = Linear(12, dim)`` (zero-initialised) and
  ``projector = Linear(dim, dim)`` (identity-initialised). The 12 values of each frame's 3x4
  world-to-camera extrinsics are encoded and added to that frame's tokens after the block's
  modulated norm1, i.e. right before self-attention; the projector is applied to the
  self-attention output before Wan's gate. At initialisation both are no-ops, so the model is
  exactly a Wan transformer run on the concatenated video;
* the velocity is returned for the target half only.

Optional ray pathway (``plucker_rays``, off by default so real ReCamMaster checkpoints load unchanged): every
block also owns ``ray_encoder = Linear(6, dim)`` (zero-initialised), fed each token's Plücker ray, the line
through its camera centre and its patch centre in the shared world frame. Wan places tokens by RoPE alone, so
a token's features never say where in the image it sits, and a per-frame [R|t] cannot tell the model where
each token looks; a ray can. Two rays meet where their reciprocal product d1.m2 + d2.m1 is 0, a bilinear form
that one query-key product can learn, so a target token can find the source tokens that see the same point
(ray-conditioned camera control as in CameraCtrl, arXiv 2404.02101).

Everything else (patch embedding, RoPE, timestep/text condition embedder, cross-attention, FFN,
output norm/projection and unpatchify) is the parent's ``WanTransformer3DModel`` machinery. At tiny
scale there is no text encoder: a learned null context (1, L, text_dim) replaces the text tokens,
while real text embeddings can still be passed for real-size configurations.

Shapes: B batch, F frames per video, C channels, H x W pixels (or latents), D = model width.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from diffusers.configuration_utils import register_to_config
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, WanTransformerBlock

CAMERA_DIM = 12  # flattened 3x4 [R|t]
RAY_DIM = 6  # Plücker (direction, moment)

# Wan's condition embedder was trained on integer timesteps in [0, 1000); sigma in [0, 1] maps onto it.
WAN_TIMESTEP_SCALE = 1000.0


def tiny_config() -> dict:
    """Config dict of the default ReCam-Tiny model: pixel space, 32x32, F = 8, patch (1, 4, 4).

    D = 2 heads x 48 = 96, 2 blocks, FFN 3x, 377k parameters; 2 x 8 x 8 x 8 = 1024 tokens per sample.
    Measured with torch.set_num_threads(2) on a 2-core CPU, batch 8: forward ~0.085 s, forward +
    backward ~0.33 s (a third block cost ~0.13 s / ~0.46 s and trained slower in a fixed time budget).
    On a slower 2-core AVX2 machine: 0.155 s / 0.50 s running every block on all tokens, 0.118 s / 0.37 s
    with the last block trimmed to the target tokens (trim_last_block, the default).
    """
    return {
        "patch_size": (1, 4, 4),
        "num_attention_heads": 2,
        "attention_head_dim": 48,
        "in_channels": 3,
        "out_channels": 3,
        "text_dim": 32,
        "freq_dim": 64,
        "ffn_dim": 288,
        "num_layers": 2,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "image_dim": None,
        "added_kv_proj_dim": None,
        "rope_max_seq_len": 64,
        "pos_embed_seq_len": None,
        "null_text_len": 4,
    }


def wan21_1_3b_config() -> dict:
    """Config dict of the real-size ReCamMaster backbone (Wan2.1 T2V 1.3B, 16-channel VAE latents)."""
    return {
        "patch_size": (1, 2, 2),
        "num_attention_heads": 12,
        "attention_head_dim": 128,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 4096,
        "freq_dim": 256,
        "ffn_dim": 8960,
        "num_layers": 30,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "image_dim": None,
        "added_kv_proj_dim": None,
        "rope_max_seq_len": 1024,
        "pos_embed_seq_len": None,
        "null_text_len": 4,
    }


def flatten_cameras(cams: torch.Tensor) -> torch.Tensor:
    """Flatten per-frame extrinsics row-major: (B, F, 3, 4) -> (B, F, 12)."""
    if cams.ndim != 4 or cams.shape[-2:] != (3, 4):
        raise ValueError(f"cameras must have shape (B, F, 3, 4), got {tuple(cams.shape)}")
    return cams.reshape(cams.shape[0], cams.shape[1], CAMERA_DIM)


def plucker_rays(frame_cams: torch.Tensor, grid: tuple[int, int], patch: tuple[int, int],
                 focal: float) -> torch.Tensor:
    """Plücker coordinates of the ray through every token's patch centre.

    Args:
        frame_cams: (B, F', 12) flattened world-to-camera [R|t], one row per token frame.
        grid: (H', W') tokens per frame; patch: (p_h, p_w) pixels per token.
        focal: fx = fy = focal * W' * p_w pixels, principal point at the image centre in OpenCV's pixel
            convention (the synthetic world's intrinsics at focal 1).

    Returns:
        (B, F' * H' * W', 6) rays (d, m), frame-major then row-major like the patch tokens: d the unit direction
        in world coordinates, m = c x d the moment about the world origin, c the camera centre -R^T t.
    """
    (gh, gw), (ph, pw) = grid, patch
    width, height = gw * pw, gh * ph
    fx = focal * width
    dtype, device = frame_cams.dtype, frame_cams.device
    u = torch.arange(gw, dtype=dtype, device=device) * pw + (pw - 1) / 2 - (width - 1) / 2
    v = torch.arange(gh, dtype=dtype, device=device) * ph + (ph - 1) / 2 - (height - 1) / 2
    vv, uu = torch.meshgrid(v / fx, u / fx, indexing="ij")
    d_cam = torch.stack([uu, vv, torch.ones_like(uu)], dim=-1).reshape(-1, 3)  # (H'W', 3)
    d_cam = d_cam / d_cam.norm(dim=-1, keepdim=True)
    cams = frame_cams.unflatten(-1, (3, 4))
    rot, trans = cams[..., :3], cams[..., 3]  # (B, F', 3, 3), (B, F', 3)
    centre = -(rot.transpose(-1, -2) @ trans.unsqueeze(-1)).squeeze(-1)  # (B, F', 3)
    d = torch.einsum("bfji,nj->bfni", rot, d_cam)  # R^T d_cam for every token: (B, F', H'W', 3)
    m = torch.cross(centre.unsqueeze(2).expand_as(d), d, dim=-1)
    return torch.cat([d, m], dim=-1).flatten(1, 2)


def camera_block_forward(
    block: WanTransformerBlock,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    timestep_proj: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor],
    frame_cams: torch.Tensor,
    tokens_per_frame: int,
    num_out_tokens: int | None = None,
    token_rays: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Wan DiT block with ReCamMaster's camera injection.

    Args:
        block: a ``WanTransformerBlock`` carrying ``cam_encoder`` and ``projector``.
        hidden_states: (B, S, D) tokens, S = F' * tokens_per_frame, frame-major order.
        encoder_hidden_states: (B, L, D) embedded context tokens.
        timestep_proj: (B, 6, D) Wan adaLN modulation for this sample's timestep.
        rotary_emb: Wan's (cos, sin) RoPE tables for the S tokens.
        frame_cams: (B, F', 12) flattened extrinsics, one row per post-patch frame.
        tokens_per_frame: H' * W' tokens sharing each frame's camera.
        num_out_tokens: n, return only the first n tokens (None = all S). Every token still serves as a key
            and value of self-attention, but only the first n are queried and sent through the cross-attention
            and FFN: the last block needs nothing else, since only the target tokens are decoded.
        token_rays: (B, S, 6) Plücker rays (:func:`plucker_rays`), read by the block's ``ray_encoder`` where it
            has one.

    Returns:
        (B, n, D) updated tokens. With a zero cam_encoder and an identity projector and n = S this equals
        ``block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)``.
    """
    # Mirrors WanTransformerBlock.forward (Wan2.1 path, per-sample timestep); only the two camera
    # lines differ, which is why the block's own forward cannot be reused as-is.
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
        block.scale_shift_table + timestep_proj.float()
    ).chunk(6, dim=1)

    normed = (block.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa).type_as(hidden_states)
    cam_emb = block.cam_encoder(frame_cams.to(normed.dtype))  # (B, F', D)
    normed = normed + cam_emb.repeat_interleave(tokens_per_frame, dim=1)
    if getattr(block, "ray_encoder", None) is not None:
        if token_rays is None:
            raise ValueError("this block has a ray_encoder (plucker_rays) but was given no token_rays")
        normed = normed + block.ray_encoder(token_rays.to(normed.dtype))
    if num_out_tokens is None or num_out_tokens == normed.shape[1] or not can_trim_queries(block.attn1):
        attn_output = block.attn1(normed, None, None, rotary_emb)
        num_out_tokens = normed.shape[1]
    else:
        attn_output = leading_query_self_attention(block.attn1, normed, num_out_tokens, rotary_emb)
    attn_output = block.projector(attn_output)
    hidden_states = (hidden_states[:, :num_out_tokens].float() + attn_output * gate_msa).type_as(hidden_states)

    normed = block.norm2(hidden_states.float()).type_as(hidden_states)
    hidden_states = hidden_states + block.attn2(normed, encoder_hidden_states, None, None)

    normed = (block.norm3(hidden_states.float()) * (1 + c_scale_msa) + c_shift_msa).type_as(hidden_states)
    ff_output = block.ffn(normed)
    return (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)


def can_trim_queries(attn) -> bool:
    """Whether leading_query_self_attention reproduces this attention module: diffusers' plain Wan processor with
    separate q/k/v projections, no image keys and torch's default attention backend (otherwise the module's own
    forward runs on all tokens, e.g. with a kernel chosen through diffusers' attention dispatcher)."""
    return (type(attn.processor) is WanAttnProcessor and getattr(attn.processor, "_attention_backend", None) is None
            and not getattr(attn, "fused_projections", False) and attn.add_k_proj is None)


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE: rotate each pair (x[2i], x[2i+1]) of the head dim by the angle whose cos / sin the tables hold.

    x: (B, S, H, Dh); cos, sin: (1, S, 1, Dh) with each angle's value repeated for both members of its pair.
    """
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x)


def leading_query_self_attention(attn, x: torch.Tensor, n: int, rotary_emb) -> torch.Tensor:
    """Self-attention of a WanAttention module in which only the first n tokens ask: (B, S, D) -> (B, n, D).

    Equal to ``attn(x, None, None, rotary_emb)[:, :n]`` (tested) at n / S of the query-side cost; keys and values
    still come from all S tokens.
    """
    cos, sin = rotary_emb
    q = attn.norm_q(attn.to_q(x[:, :n])).unflatten(2, (attn.heads, -1))
    k = attn.norm_k(attn.to_k(x)).unflatten(2, (attn.heads, -1))
    v = attn.to_v(x).unflatten(2, (attn.heads, -1))
    q = apply_interleaved_rotary(q, cos[:, :n], sin[:, :n])
    k = apply_interleaved_rotary(k, cos, sin)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    out = out.transpose(1, 2).flatten(2, 3).type_as(q)
    return attn.to_out[1](attn.to_out[0](out))


class ReCamTransformer3DModel(WanTransformer3DModel):
    """Wan2.1 transformer re-rendering a source video along new target cameras (ReCamMaster design).

    Extra config: ``null_text_len`` L, the length of the learned null text context used when no
    text embeddings are given; ``plucker_rays`` adds the ray pathway (module docstring) and ``ray_focal`` sets
    the focal length, in image widths, its rays assume. All Wan config keys keep their meaning, so real-size
    Wan configs load.
    """

    _no_split_modules = ["WanTransformerBlock"]

    @register_to_config
    def __init__(
        self,
        patch_size: tuple[int, ...] = (1, 4, 4),
        num_attention_heads: int = 2,
        attention_head_dim: int = 48,
        in_channels: int = 3,
        out_channels: int = 3,
        text_dim: int = 32,
        freq_dim: int = 64,
        ffn_dim: int = 288,
        num_layers: int = 2,
        cross_attn_norm: bool = True,
        qk_norm: str | None = "rms_norm_across_heads",
        eps: float = 1e-6,
        image_dim: int | None = None,
        added_kv_proj_dim: int | None = None,
        rope_max_seq_len: int = 64,
        pos_embed_seq_len: int | None = None,
        null_text_len: int = 4,
        plucker_rays: bool = False,
        ray_focal: float = 1.0,
    ) -> None:
        if image_dim is not None or added_kv_proj_dim is not None:
            raise ValueError("ReCamTransformer3DModel has no image conditioning; image_dim and "
                             "added_kv_proj_dim must be None")
        if null_text_len < 1:
            raise ValueError(f"null_text_len must be >= 1, got {null_text_len}")
        if not ray_focal > 0:
            raise ValueError(f"ray_focal must be > 0 (the focal length in image widths), got {ray_focal}")
        super().__init__(
            patch_size=tuple(patch_size),
            num_attention_heads=num_attention_heads,
            attention_head_dim=attention_head_dim,
            in_channels=in_channels,
            out_channels=out_channels,
            text_dim=text_dim,
            freq_dim=freq_dim,
            ffn_dim=ffn_dim,
            num_layers=num_layers,
            cross_attn_norm=cross_attn_norm,
            qk_norm=qk_norm,
            eps=eps,
            image_dim=image_dim,
            added_kv_proj_dim=added_kv_proj_dim,
            rope_max_seq_len=rope_max_seq_len,
            pos_embed_seq_len=pos_embed_seq_len,
        )
        inner_dim = num_attention_heads * attention_head_dim
        for block in self.blocks:
            block.cam_encoder = nn.Linear(CAMERA_DIM, inner_dim)
            block.projector = nn.Linear(inner_dim, inner_dim)
            block.ray_encoder = nn.Linear(RAY_DIM, inner_dim) if plucker_rays else None
            # The block's forward becomes the camera one, and the model calls the block as a module: a wrapper's
            # hooks on the block then see every pass (FSDP, one unit per block, gathers its parameters there).
            block.forward = types.MethodType(camera_block_forward, block)
        # Small std so the null context starts near the text embedder's bias, like an empty prompt.
        self.null_text = nn.Parameter(torch.randn(1, null_text_len, text_dim) * 0.02)
        # The last block skips the source tokens' queries and FFN, whose outputs nobody reads (about a quarter of
        # a 2-block model's compute); False runs every block on all tokens, for checking that the two agree.
        self.trim_last_block = True
        self.reset_camera_modules()

    @torch.no_grad()
    def reset_camera_modules(self) -> None:
        """Zero every cam_encoder (and ray_encoder) and set every projector to the identity (ReCamMaster's init)."""
        for block in self.blocks:
            if block.ray_encoder is not None:
                nn.init.zeros_(block.ray_encoder.weight)
                nn.init.zeros_(block.ray_encoder.bias)
            nn.init.zeros_(block.cam_encoder.weight)
            nn.init.zeros_(block.cam_encoder.bias)
            nn.init.eye_(block.projector.weight)
            nn.init.zeros_(block.projector.bias)

    def _check_inputs(
        self,
        noisy_target: torch.Tensor,
        sigma: torch.Tensor,
        source_video: torch.Tensor,
        source_cams: torch.Tensor,
        target_cams: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
    ) -> None:
        cfg = self.config
        if noisy_target.ndim != 5:
            raise ValueError(f"noisy_target must be (B, C, F, H, W), got {tuple(noisy_target.shape)}")
        b, c, f, h, w = noisy_target.shape
        if c != cfg.in_channels:
            raise ValueError(f"noisy_target has {c} channels but the model expects "
                             f"in_channels={cfg.in_channels}")
        if source_video.shape != noisy_target.shape:
            raise ValueError(f"source_video shape {tuple(source_video.shape)} must equal noisy_target shape "
                             f"{tuple(noisy_target.shape)}")
        p_t, p_h, p_w = cfg.patch_size
        if f % p_t or h % p_h or w % p_w:
            raise ValueError(f"video (F, H, W) = {(f, h, w)} is not divisible by patch_size "
                             f"{tuple(cfg.patch_size)}")
        if max(2 * f // p_t, h // p_h, w // p_w) > cfg.rope_max_seq_len:
            raise ValueError(f"video of (2F, H, W) = {(2 * f, h, w)} patches exceeds rope_max_seq_len="
                             f"{cfg.rope_max_seq_len}")
        if sigma.shape != (b,):
            raise ValueError(f"sigma must have shape (B,) = ({b},), got {tuple(sigma.shape)}")
        if not torch.isfinite(sigma).all() or (sigma < 0).any() or (sigma > 1).any():
            raise ValueError(f"sigma must lie in [0, 1], got min {sigma.min().item()} "
                             f"max {sigma.max().item()}")
        for name, cams in (("source_cams", source_cams), ("target_cams", target_cams)):
            if cams.shape != (b, f, 3, 4):
                raise ValueError(f"{name} must have shape (B, F, 3, 4) = {(b, f, 3, 4)}, "
                                 f"got {tuple(cams.shape)}")
        if encoder_hidden_states is not None and (
            encoder_hidden_states.ndim != 3
            or encoder_hidden_states.shape[0] != b
            or encoder_hidden_states.shape[2] != cfg.text_dim
        ):
            raise ValueError(f"encoder_hidden_states must be (B, L, text_dim) = ({b}, L, {cfg.text_dim}), "
                             f"got {tuple(encoder_hidden_states.shape)}")

    def forward(
        self,
        noisy_target: torch.Tensor,
        sigma: torch.Tensor,
        source_video: torch.Tensor,
        source_cams: torch.Tensor,
        target_cams: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow-matching velocity (noise - x0) of the target video.

        Args:
            noisy_target: (B, C, F, H, W) x_sigma = (1 - sigma) x0 + sigma noise.
            sigma: (B,) noise level in [0, 1], 1 = pure noise.
            source_video: (B, C, F, H, W) clean source video.
            source_cams: (B, F, 3, 4) source world-to-camera extrinsics (relative to source frame 0).
            target_cams: (B, F, 3, 4) target world-to-camera extrinsics in the same world frame.
            encoder_hidden_states: optional (B, L, text_dim) text embeddings; the learned null
                context is used when None.

        Returns:
            (B, C_out, F, H, W) predicted velocity for the target half.
        """
        self._check_inputs(noisy_target, sigma, source_video, source_cams, target_cams, encoder_hidden_states)
        b, _, f, h, w = noisy_target.shape
        p_t, p_h, p_w = self.config.patch_size
        ppf, pph, ppw = f // p_t, h // p_h, w // p_w
        tokens_per_frame = pph * ppw

        hidden_states = torch.cat([noisy_target, source_video], dim=2)  # (B, C, 2F, H, W)
        rotary_emb = self.rope(hidden_states)
        hidden_states = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()

        # With temporal patches (p_t > 1) one token frame covers p_t video frames; like ReCamMaster's
        # frame subsampling, each token frame takes the camera of its first video frame.
        frame_cams = torch.cat([flatten_cameras(target_cams), flatten_cameras(source_cams)], dim=1)[:, ::p_t]
        token_rays = (plucker_rays(frame_cams.float(), (pph, ppw), (p_h, p_w), self.config.ray_focal)
                      if self.config.plucker_rays else None)

        if encoder_hidden_states is None:
            encoder_hidden_states = self.null_text.expand(b, -1, -1)
        timestep = sigma.to(torch.float32) * WAN_TIMESTEP_SCALE
        temb, timestep_proj, context, _ = self.condition_embedder(timestep, encoder_hidden_states.to(
            hidden_states.dtype))
        timestep_proj = timestep_proj.unflatten(1, (6, -1))  # (B, 6, D)

        # Only the target tokens (the first F' token frames) are decoded, so the last block computes only them.
        num_target = ppf * tokens_per_frame
        block_args = (context, timestep_proj, rotary_emb, frame_cams, tokens_per_frame)
        for i, block in enumerate(self.blocks):
            last = i == len(self.blocks) - 1
            n_out = num_target if last and self.trim_last_block else None  # camera_block_forward's num_out_tokens
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                hidden_states = self._gradient_checkpointing_func(block, hidden_states, *block_args, n_out,
                                                                  token_rays)
            else:
                hidden_states = block(hidden_states, *block_args, n_out, token_rays)
        hidden_states = hidden_states[:, :num_target]
        shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        hidden_states = (self.norm_out(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)
        hidden_states = self.proj_out(hidden_states)  # (B, S_target, p_t * p_h * p_w * C_out)

        hidden_states = hidden_states.reshape(b, ppf, pph, ppw, p_t, p_h, p_w, -1)
        hidden_states = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return hidden_states.reshape(b, -1, ppf * p_t, pph * p_h, ppw * p_w)
