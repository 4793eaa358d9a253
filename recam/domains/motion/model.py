"""MotionDiffusionModel: a text-conditioned x0-predicting motion transformer laid out like MDM (Tevet et al. 2023).

Module and parameter names follow MDM's ``trans_enc`` architecture, so an MDM checkpoint maps onto this class key
for key (see :mod:`recam.domains.motion.loading`):

* ``input_process.poseEmbedding``  Linear(njoints -> latent), applied per frame;
* ``sequence_pos_encoder``         fixed sinusoidal encoding (interleaved sin/cos) added to [cond token, frames]
                                   followed by dropout; nothing learned, so it has no parameters here;
* ``embed_timestep.time_embed``    Sequential(Linear, SiLU, Linear) on the same sinusoid evaluated at t;
* ``embed_text``                   Linear(text_dim -> latent) on a sentence embedding (frozen CLIP in MDM);
* ``seqTransEncoder``              nn.TransformerEncoder of post-LayerNorm layers (GELU, dropout);
* ``output_process.poseFinal``     Linear(latent -> njoints).

The condition is a single token = timestep embedding + text embedding, prepended to the frame tokens; the
outputs at the frame positions are the predicted clean motion x0.

The model does not own a text encoder: callers pass a [B, text_dim] embedding from any :class:`TextEncoder`.
Dropping the text (classifier-free guidance, MDM's 10 % training dropout) is an explicit ``drop_text`` flag
rather than a coin flipped inside ``forward``: a GRPO trainer must be able to recompute exactly the
prediction it sampled with, so ``forward`` never draws random conditions itself. :meth:`random_text_drop`
draws the training dropout for callers that want MDM's behaviour.

Shapes: B batch, T frames (<= max_frames), J = njoints features per frame (263 for HumanML3D), D latent width.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin

from recam.domains.motion.skeleton import MAX_FRAMES, NUM_FEATURES

# MDM's sinusoid base; the timestep embedding reuses the sequence table, so both share it.
SINUSOID_BASE = 10000.0


def mdm_config() -> dict:
    """MDM's HumanML3D size: latent 512, 8 layers, 4 heads, FF 1024, dropout 0.1, CLIP ViT-B/32 text (512-d).

    17,880,327 parameters (17.9 M without CLIP), checked in tests against REFERENCES.md.
    """
    return {
        "latent_dim": 512,
        "num_layers": 8,
        "num_heads": 4,
        "ff_size": 1024,
        "dropout": 0.1,
        "text_dim": 512,
        "njoints": NUM_FEATURES,
        "max_frames": MAX_FRAMES,
        "cond_mask_prob": 0.1,
    }


def tiny_config() -> dict:
    """A CPU-trainable size: latent 64, 3 layers, 4 heads, FF 128, 64-d text; 146,887 parameters."""
    return {
        "latent_dim": 64,
        "num_layers": 3,
        "num_heads": 4,
        "ff_size": 128,
        "dropout": 0.1,
        "text_dim": 64,
        "njoints": NUM_FEATURES,
        "max_frames": MAX_FRAMES,
        "cond_mask_prob": 0.1,
    }


def sinusoid(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """MDM's sinusoid: [N] positions -> [N, dim], sin in even channels and cos in odd ones.

    Computed in float32 the way MDM builds its ``pe`` table, so integer positions reproduce the table stored in
    MDM checkpoints to float32 rounding; fractional positions (continuous-time samplers) are also accepted.
    """
    if dim % 2:
        raise ValueError(f"sinusoid dimension must be even, got {dim}")
    freqs = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device)
                      * (-math.log(SINUSOID_BASE) / dim))
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    out = torch.empty(positions.shape[0], dim, dtype=torch.float32, device=positions.device)
    out[:, 0::2] = torch.sin(angles)
    out[:, 1::2] = torch.cos(angles)
    return out


def padding_mask_from_lengths(lengths: torch.Tensor, num_frames: int) -> torch.Tensor:
    """[B] valid lengths -> [B, T] bool, True on padded frames (PyTorch's key-padding convention)."""
    frames = torch.arange(num_frames, device=lengths.device)
    return frames[None, :] >= lengths[:, None]


def to_mdm_layout(features: torch.Tensor) -> torch.Tensor:
    """[B, T, J] (dataset layout) -> [B, J, 1, T] (MDM's layout)."""
    return features.permute(0, 2, 1).unsqueeze(2)


def from_mdm_layout(x: torch.Tensor) -> torch.Tensor:
    """[B, J, 1, T] -> [B, T, J]."""
    return x.squeeze(2).permute(0, 2, 1)


class SequencePositionEncoding(nn.Module):
    """Adds the fixed sinusoid of each position, then dropout (MDM regularises positions the same way)."""

    def __init__(self, dim: int, dropout: float):
        super().__init__()
        self.dim = dim
        self.dropout = nn.Dropout(dropout)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(seq.shape[1], device=seq.device)
        return self.dropout(seq + sinusoid(positions, self.dim).to(seq.dtype)[None])


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.time_embed = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        first = self.time_embed[0].weight
        return self.time_embed(sinusoid(timesteps, self.dim).to(first.dtype))


class InputProcess(nn.Module):
    def __init__(self, njoints: int, dim: int):
        super().__init__()
        self.poseEmbedding = nn.Linear(njoints, dim)


class OutputProcess(nn.Module):
    def __init__(self, dim: int, njoints: int):
        super().__init__()
        self.poseFinal = nn.Linear(dim, njoints)


class MotionDiffusionModel(ModelMixin, ConfigMixin):
    """MDM-layout x0 predictor; construct from :func:`mdm_config` / :func:`tiny_config` or any such dict."""

    @register_to_config
    def __init__(
        self,
        latent_dim: int = 512,
        num_layers: int = 8,
        num_heads: int = 4,
        ff_size: int = 1024,
        dropout: float = 0.1,
        text_dim: int = 512,
        njoints: int = NUM_FEATURES,
        max_frames: int = MAX_FRAMES,
        cond_mask_prob: float = 0.1,
    ):
        super().__init__()
        if latent_dim % num_heads:
            raise ValueError(f"latent_dim {latent_dim} is not divisible by num_heads {num_heads}")
        self.input_process = InputProcess(njoints, latent_dim)
        self.sequence_pos_encoder = SequencePositionEncoding(latent_dim, dropout)
        self.embed_timestep = TimestepEmbedder(latent_dim)
        self.embed_text = nn.Linear(text_dim, latent_dim)
        layer = nn.TransformerEncoderLayer(
            d_model=latent_dim, nhead=num_heads, dim_feedforward=ff_size, dropout=dropout,
            activation="gelu", batch_first=True, norm_first=False,
        )
        # No nested tensors: in eval mode they zero the outputs at padded frames while training mode does not,
        # which would make the same weights give different predictions depending on the mode.
        self.seqTransEncoder = nn.TransformerEncoder(layer, num_layers=num_layers, enable_nested_tensor=False)
        self.output_process = OutputProcess(latent_dim, njoints)

    def random_text_drop(self, batch_size: int, generator: torch.Generator | None = None,
                         device: torch.device | str | None = None) -> torch.Tensor:
        """MDM's training-time condition dropout: [B] bool, True with probability ``cond_mask_prob``."""
        draws = torch.rand(batch_size, generator=generator)
        return (draws < self.config.cond_mask_prob).to(device if device is not None else self.device)

    def _check_inputs(self, x, timesteps, text_emb, drop_text, padding_mask) -> None:
        cfg = self.config
        if x.ndim != 4 or x.shape[1] != cfg.njoints or x.shape[2] != 1:
            raise ValueError(f"x must be [B, {cfg.njoints}, 1, T] (MDM layout), got {tuple(x.shape)}")
        batch, num_frames = x.shape[0], x.shape[3]
        if num_frames > cfg.max_frames:
            raise ValueError(f"{num_frames} frames exceed max_frames={cfg.max_frames}")
        if timesteps.shape != (batch,):
            raise ValueError(f"timesteps must be [B={batch}], got {tuple(timesteps.shape)}")
        if text_emb is not None and text_emb.shape != (batch, cfg.text_dim):
            raise ValueError(f"text_emb must be [B={batch}, text_dim={cfg.text_dim}], got {tuple(text_emb.shape)}")
        if drop_text is not None and (drop_text.shape != (batch,) or drop_text.dtype != torch.bool):
            raise ValueError(
                f"drop_text must be a [B={batch}] bool tensor, got {drop_text.dtype} {tuple(drop_text.shape)}"
            )
        if padding_mask is not None and (padding_mask.shape != (batch, num_frames) or padding_mask.dtype != torch.bool):
            raise ValueError(
                f"padding_mask must be a [B={batch}, T={num_frames}] bool tensor, "
                f"got {padding_mask.dtype} {tuple(padding_mask.shape)}"
            )

    def forward(
        self,
        x: torch.Tensor,
        timesteps: torch.Tensor,
        text_emb: torch.Tensor | None = None,
        drop_text: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict x0.

        Args:
            x: [B, J, 1, T] noisy motion (normalised features), MDM's layout.
            timesteps: [B] diffusion steps (integers in MDM; floats are embedded with the same sinusoid).
            text_emb: [B, text_dim] sentence embeddings; None means unconditional for the whole batch.
            drop_text: [B] bool, True where the text embedding is replaced by zeros (before ``embed_text``, as
                MDM does, so the unconditional token is ``embed_text.bias``).
            padding_mask: [B, T] bool, True on padded frames, which then receive no attention. The condition
                token is never masked. None attends to every frame -- what the original MDM checkpoints were
                trained with (MDM only masks frames when trained with ``mask_frames``).

        Returns:
            [B, J, 1, T] predicted clean motion; values at padded frames are meaningless.
        """
        self._check_inputs(x, timesteps, text_emb, drop_text, padding_mask)
        batch = x.shape[0]
        param = self.embed_text.weight
        if text_emb is None:
            text = torch.zeros(batch, self.config.text_dim, device=param.device, dtype=param.dtype)
        else:
            text = text_emb.to(param.dtype)
            if drop_text is not None:
                # where(), not a multiply: a NaN in a dropped row must not leak into the unconditional token.
                text = torch.where(drop_text[:, None].to(text.device), torch.zeros_like(text), text)
        cond = self.embed_timestep(timesteps) + self.embed_text(text)

        frames = self.input_process.poseEmbedding(from_mdm_layout(x).to(param.dtype))
        seq = self.sequence_pos_encoder(torch.cat([cond[:, None], frames], dim=1))
        key_padding = None
        if padding_mask is not None:
            keep_cond = torch.zeros(batch, 1, dtype=torch.bool, device=padding_mask.device)
            key_padding = torch.cat([keep_cond, padding_mask], dim=1)
        hidden = self.seqTransEncoder(seq, src_key_padding_mask=key_padding)[:, 1:]
        return to_mdm_layout(self.output_process.poseFinal(hidden))

    def guided_forward(
        self,
        x: torch.Tensor,
        timesteps: torch.Tensor,
        text_emb: torch.Tensor,
        guidance_scale: float | torch.Tensor,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Classifier-free guidance on x0 (MDM: uncond + s * (cond - uncond), s = 2.5), both passes batched."""
        batch = x.shape[0]
        drop = torch.cat([torch.zeros(batch, dtype=torch.bool), torch.ones(batch, dtype=torch.bool)]).to(x.device)
        both = self(
            x.repeat(2, 1, 1, 1), timesteps.repeat(2), text_emb.repeat(2, 1), drop_text=drop,
            padding_mask=None if padding_mask is None else padding_mask.repeat(2, 1),
        )
        cond, uncond = both[:batch], both[batch:]
        scale = torch.as_tensor(guidance_scale, dtype=cond.dtype, device=cond.device)
        if scale.ndim == 1:
            scale = scale.view(-1, 1, 1, 1)
        return uncond + scale * (cond - uncond)


def count_parameters(config: dict) -> int:
    """Parameters of a model with this config, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = MotionDiffusionModel(**config)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------
# Text encoders
# ---------------------------------------------------------------------------------------------------------


@runtime_checkable
class TextEncoder(Protocol):
    """Anything that turns captions into the [B, text_dim] sentence embeddings MotionDiffusionModel takes.

    Implementations: :class:`CLIPTextEncoder` (MDM's frozen CLIP text tower) and the small word-level encoder
    trained on the synthetic world (recam/domains/motion/evaluator.py). Whether an encoder is frozen is its own
    business; the model only needs ``text_dim`` to match its config.
    """

    text_dim: int

    def encode(self, texts: Sequence[str]) -> torch.Tensor: ...


class CallableTextEncoder:
    """Adapts any ``captions -> [B, text_dim]`` function to :class:`TextEncoder`, e.g. the synthetic world's
    word-level encoder (``TextMotionEvaluator.encode_text`` in evaluator.py) or a trainable module's forward.
    Gradients flow through unless the function itself stops them."""

    def __init__(self, fn, text_dim: int):
        self.fn = fn
        self.text_dim = int(text_dim)

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        if isinstance(texts, str):
            raise TypeError("encode takes a list of captions, not a single string")
        out = self.fn(list(texts))
        if out.shape != (len(texts), self.text_dim):
            raise ValueError(f"text encoder returned {tuple(out.shape)}, expected ({len(texts)}, {self.text_dim})")
        return out


class CLIPTextEncoder(nn.Module):
    """CLIP's text tower from a local folder, frozen, returning the projected EOT embedding as MDM uses it.

    MDM calls OpenAI CLIP's ``encode_text``, which is the final hidden state at the end-of-text token *times
    the text projection*. In transformers that is ``CLIPTextModelWithProjection(...).text_embeds``; the
    ``pooler_output`` of a plain ``CLIPTextModel`` is the same vector before the projection, i.e. not what
    MDM's ``embed_text`` was trained on. ``projected=False`` gives the pooler output for folders holding only a
    text tower without projection. MDM ran CLIP in float16 on GPU; float32 here differs by rounding only.
    """

    def __init__(self, model: nn.Module, tokenizer, *, projected: bool = True, max_length: int | None = None):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.projected = projected
        # OpenAI's tokenize(truncate=True) keeps 77 tokens with the end token last; the tokenizer does the same.
        self.max_length = max_length or model.config.max_position_embeddings

    @property
    def text_dim(self) -> int:
        cfg = self.model.config
        return cfg.projection_dim if self.projected else cfg.hidden_size

    @classmethod
    def from_folder(cls, path: str | Path, *, projected: bool = True, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> CLIPTextEncoder:
        """Load from a local folder (a full CLIP model such as ``clip-vit-base-patch32`` or a text tower alone).

        Never downloads. Raises FileNotFoundError when the folder, its config or its tokenizer files are
        missing, and ValueError when weights the encoder needs are absent from the checkpoint (which
        transformers would otherwise silently initialise at random).
        """
        from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer
        from transformers.utils import logging as hf_logging

        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"no CLIP folder at {folder}")
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder} has no config.json; expected a transformers CLIP model folder")
        if not any((folder / name).is_file() for name in ("tokenizer.json", "vocab.json")):
            raise FileNotFoundError(f"{folder} has no CLIP tokenizer (tokenizer.json or vocab.json + merges.txt)")
        tokenizer = CLIPTokenizer.from_pretrained(str(folder), local_files_only=True)
        raw = json.loads((folder / "config.json").read_text())
        if raw.get("model_type") == "clip":
            # A full CLIP folder keeps projection_dim at the top level; the text config alone would fall back to
            # 512 and mis-size the projection of any other CLIP (ViT-L/14 projects to 768).
            text_cfg = dict(raw.get("text_config") or {})
            text_cfg["projection_dim"] = raw.get("projection_dim", text_cfg.get("projection_dim", 512))
            config = CLIPTextConfig(**text_cfg)
        else:
            config = CLIPTextConfig.from_pretrained(str(folder), local_files_only=True)
        model_cls = CLIPTextModelWithProjection if projected else CLIPTextModel
        # transformers would log a table of every vision-tower key as unexpected, which is the normal case for a
        # full CLIP folder; missing and mis-sized keys are checked below and raised instead.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            model, info = model_cls.from_pretrained(str(folder), config=config, local_files_only=True,
                                                    output_loading_info=True, dtype=dtype)
        finally:
            hf_logging.set_verbosity(verbosity)
        missing = sorted(info.get("missing_keys", ()))
        mismatched = sorted(str(k) for k in info.get("mismatched_keys", ()))
        if missing or mismatched:
            hint = " (a text tower without projection: pass projected=False)" if any(
                "text_projection" in k for k in missing) else ""
            raise ValueError(f"CLIP checkpoint in {folder} lacks weights for {missing + mismatched}{hint}")
        return cls(model.to(device), tokenizer, projected=projected)

    @torch.no_grad()
    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        if isinstance(texts, str):
            raise TypeError("encode takes a list of captions, not a single string")
        batch = self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length,
                               return_tensors="pt")
        device = next(self.model.parameters()).device
        out = self.model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
        emb = out.text_embeds if self.projected else out.pooler_output
        return emb.float()
