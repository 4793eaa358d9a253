"""Loading real weights from local folders (no hub access) into the project's classes.

Three sources are supported:

* a Wan2.1 transformer in diffusers layout (``config.json`` + ``diffusion_pytorch_model.safetensors``,
  or shards listed in ``diffusion_pytorch_model.safetensors.index.json``), e.g. the ``transformer/``
  folder of ``Wan2.1-T2V-1.3B-Diffusers`` -> :func:`load_wan_transformer`;
* a ReCamMaster checkpoint in DiffSynth-Studio's key layout (``step20000.ckpt`` is a pickled
  ``state_dict`` of DiffSynth's ``WanModel`` with ``cam_encoder``/``projector`` added to every block),
  or a plain DiffSynth / original-Wan DiT -> :func:`load_recammaster_checkpoint`;
* the Wan VAE (diffusers ``AutoencoderKLWan``) -> :func:`load_wan_vae`, :func:`encode_video`,
  :func:`decode_latents`.

Strictness: a checkpoint either fills every parameter of :class:`ReCamTransformer3DModel` or the load fails
with :class:`CheckpointMismatchError` naming the missing, unexpected and wrongly-shaped keys. The only keys a
checkpoint may lack are the ReCam additions that a plain Wan checkpoint cannot have, and those are initialised
the way the model's constructor does and listed in the returned :class:`LoadReport`:

* every block's ``cam_encoder`` (zeros) and ``projector`` (identity) -- all of them or none: a checkpoint
  holding some blocks' camera modules but not others is rejected;
* ``null_text``, the learned empty-prompt context (a fresh N(0, 0.02^2) draw); real-size runs pass T5 text
  embeddings instead, so it only matters when no text is given.

The model is built on the meta device and the checkpoint tensors are assigned into it, so a 14B load needs
memory for the weights once, not twice.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from accelerate import init_empty_weights
from safetensors.torch import load_file

from recam.domains.camera.model import ReCamTransformer3DModel, wan21_1_3b_config

logger = logging.getLogger(__name__)

DIFFUSERS_CONFIG_NAME = "config.json"
DIFFUSERS_WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"

# Wan2.1 uses 128-dim heads at every size (1.3B: 12 x 128, 14B: 40 x 128); the head count is not recoverable
# from weight shapes, so DiffSynth-layout configs are inferred with this unless the caller says otherwise.
WAN_HEAD_DIM = 128

CAMERA_KEY_RE = re.compile(r"blocks\.(\d+)\.(cam_encoder|projector)\.(weight|bias)")
NULL_TEXT_KEY = "null_text"

# DiffSynth-Studio (= original Wan2.1 repository) key -> diffusers WanTransformer3DModel key.
#
# Placeholders: ``{i}`` a block index, ``{p}`` ``weight`` or ``bias``. Each entry is matched against the
# whole key, so the table is a bijection between the two layouts and :func:`diffusers_to_diffsynth_key` is its
# exact inverse. Facts behind the less obvious rows:
#
# * Wan's ``text_embedding`` is Sequential(Linear, GELU, Linear) and ``time_embedding`` is
#   Sequential(Linear, SiLU, Linear): indices 0 and 2 hold weights; ``time_projection`` is
#   Sequential(SiLU, Linear), index 1.
# * Wan's block applies ``norm3`` (the affine LayerNorm) before cross-attention and ``norm2`` (no affine, no
#   keys) before the FFN; diffusers names them the other way round, so ``norm3`` maps to ``norm2``. diffusers'
#   own single-file converter does the same swap.
# * ``modulation`` (1, 6, D) per block and ``head.modulation`` (1, 2, D) are diffusers' ``scale_shift_table``s;
#   ``head.norm`` has no affine parameters.
# * ReCamMaster's ``cam_encoder`` Linear(12, D) and ``projector`` Linear(D, D) keep their names.
DIFFSYNTH_TO_DIFFUSERS: dict[str, str] = {
    "patch_embedding.{p}": "patch_embedding.{p}",
    "text_embedding.0.{p}": "condition_embedder.text_embedder.linear_1.{p}",
    "text_embedding.2.{p}": "condition_embedder.text_embedder.linear_2.{p}",
    "time_embedding.0.{p}": "condition_embedder.time_embedder.linear_1.{p}",
    "time_embedding.2.{p}": "condition_embedder.time_embedder.linear_2.{p}",
    "time_projection.1.{p}": "condition_embedder.time_proj.{p}",
    "blocks.{i}.self_attn.q.{p}": "blocks.{i}.attn1.to_q.{p}",
    "blocks.{i}.self_attn.k.{p}": "blocks.{i}.attn1.to_k.{p}",
    "blocks.{i}.self_attn.v.{p}": "blocks.{i}.attn1.to_v.{p}",
    "blocks.{i}.self_attn.o.{p}": "blocks.{i}.attn1.to_out.0.{p}",
    "blocks.{i}.self_attn.norm_q.weight": "blocks.{i}.attn1.norm_q.weight",
    "blocks.{i}.self_attn.norm_k.weight": "blocks.{i}.attn1.norm_k.weight",
    "blocks.{i}.cross_attn.q.{p}": "blocks.{i}.attn2.to_q.{p}",
    "blocks.{i}.cross_attn.k.{p}": "blocks.{i}.attn2.to_k.{p}",
    "blocks.{i}.cross_attn.v.{p}": "blocks.{i}.attn2.to_v.{p}",
    "blocks.{i}.cross_attn.o.{p}": "blocks.{i}.attn2.to_out.0.{p}",
    "blocks.{i}.cross_attn.norm_q.weight": "blocks.{i}.attn2.norm_q.weight",
    "blocks.{i}.cross_attn.norm_k.weight": "blocks.{i}.attn2.norm_k.weight",
    "blocks.{i}.norm3.{p}": "blocks.{i}.norm2.{p}",
    "blocks.{i}.ffn.0.{p}": "blocks.{i}.ffn.net.0.proj.{p}",
    "blocks.{i}.ffn.2.{p}": "blocks.{i}.ffn.net.2.{p}",
    "blocks.{i}.modulation": "blocks.{i}.scale_shift_table",
    "blocks.{i}.cam_encoder.{p}": "blocks.{i}.cam_encoder.{p}",
    "blocks.{i}.projector.{p}": "blocks.{i}.projector.{p}",
    "head.head.{p}": "proj_out.{p}",
    "head.modulation": "scale_shift_table",
}

_PLACEHOLDERS = {"{i}": r"(?P<i>\d+)", "{p}": r"(?P<p>weight|bias)"}


def _template_regex(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for placeholder, group in _PLACEHOLDERS.items():
        pattern = pattern.replace(re.escape(placeholder), group)
    return re.compile(pattern)


_FORWARD_RULES = [(_template_regex(src), dst) for src, dst in DIFFSYNTH_TO_DIFFUSERS.items()]
_INVERSE_RULES = [(_template_regex(dst), src) for src, dst in DIFFSYNTH_TO_DIFFUSERS.items()]


def _apply_rules(key: str, rules: list[tuple[re.Pattern, str]]) -> str | None:
    for regex, template in rules:
        match = regex.fullmatch(key)
        if match is not None:
            return template.format(**match.groupdict())
    return None


def diffsynth_to_diffusers_key(key: str) -> str | None:
    """The diffusers name of a DiffSynth/Wan DiT key, or None when the table has no row for it."""
    return _apply_rules(key, _FORWARD_RULES)


def diffusers_to_diffsynth_key(key: str) -> str | None:
    """Inverse of :func:`diffsynth_to_diffusers_key`."""
    return _apply_rules(key, _INVERSE_RULES)


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fill the model exactly; the message lists every offending key."""

    def __init__(self, source: str, missing=(), unexpected=(), shape_mismatch=(), detail: str = ""):
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.shape_mismatch = sorted(shape_mismatch)
        lines = [f"checkpoint {source} does not match ReCamTransformer3DModel; nothing was loaded."]
        if detail:
            lines.append(detail)
        if self.missing:
            lines.append(f"missing keys ({len(self.missing)}): " + ", ".join(self.missing))
        if self.unexpected:
            lines.append(f"unexpected keys ({len(self.unexpected)}): " + ", ".join(self.unexpected))
        if self.shape_mismatch:
            lines.append(f"shape mismatches ({len(self.shape_mismatch)}): " + "; ".join(self.shape_mismatch))
        super().__init__("\n".join(lines))


@dataclass
class LoadReport:
    """What a load did: where from, in which layout, how many tensors, and which keys were initialised."""

    source: str
    layout: str
    num_loaded: int
    initialised: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)

    def summary(self) -> str:
        text = f"loaded {self.num_loaded} tensors from {self.source} ({self.layout} layout)"
        if self.initialised:
            text += f"; initialised {len(self.initialised)} absent ReCam keys: " + ", ".join(self.initialised)
        return text


# ---------------------------------------------------------------------------------------------------------
# Reading state dicts
# ---------------------------------------------------------------------------------------------------------


def _read_weights_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(str(path))
    if path.suffix in {".ckpt", ".pt", ".pth", ".bin"}:
        # weights_only: a checkpoint is data, never code to run.
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
        # Lightning / DeepSpeed wrappers put the tensors one level down.
        for wrapper in ("state_dict", "module"):
            if isinstance(obj, Mapping) and set(obj) == {wrapper}:
                obj = obj[wrapper]
        if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise ValueError(f"{path} does not hold a flat state dict of tensors")
        return dict(obj)
    raise ValueError(f"unsupported weights file {path}: expected .safetensors, .ckpt, .pt, .pth or .bin")


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint: a single weights file, or a folder with one safetensors file or a
    ``*.safetensors.index.json`` listing shards (diffusers and original-Wan releases both shard this way)."""
    path = Path(path)
    if path.is_file():
        return _read_weights_file(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise ValueError(f"{path} holds several shard indexes, cannot tell which to load: {[p.name for p in indexes]}")
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = path / shard
            if not shard_path.is_file():
                raise FileNotFoundError(f"shard {shard} listed in {indexes[0].name} is missing from {path}")
            state.update(load_file(str(shard_path)))
        listed = set(weight_map)
        if listed != set(state):
            raise CheckpointMismatchError(
                str(path),
                missing=listed - set(state),
                unexpected=set(state) - listed,
                detail=f"shards disagree with {indexes[0].name}",
            )
        return state
    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise FileNotFoundError(
            f"{path}: expected one .safetensors file or a shard index, found {[p.name for p in files] or 'none'}"
        )
    return load_file(str(files[0]))


# ---------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------


def _model_init_keys() -> set[str]:
    import inspect

    return {name for name in inspect.signature(ReCamTransformer3DModel.__init__).parameters if name != "self"}


def recam_config_from_diffusers(config: Mapping) -> dict:
    """ReCam constructor kwargs from a diffusers Wan ``config.json`` dict.

    Keys starting with ``_`` (class name, diffusers version) are bookkeeping and dropped; any other key the
    constructor does not know means the checkpoint is from a different model family, which is an error.
    """
    known = _model_init_keys()
    unknown = sorted(k for k in config if not k.startswith("_") and k not in known)
    if unknown:
        raise ValueError(f"config keys not understood by ReCamTransformer3DModel: {unknown}")
    out = {k: v for k, v in config.items() if k in known}
    if "patch_size" in out:
        out["patch_size"] = tuple(out["patch_size"])
    return out


def wan21_14b_config() -> dict:
    """Config dict of Wan2.1 T2V 14B (D = 40 heads x 128, 40 blocks, FFN 13824; same as diffusers' defaults)."""
    cfg = wan21_1_3b_config()
    cfg.update(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40)
    return cfg


WAN_PRESETS = {"1.3b": wan21_1_3b_config, "14b": wan21_14b_config}


def wan_preset_config(name: str) -> dict:
    """Real-size config by name: ``"1.3b"`` or ``"14b"``."""
    if name.lower() not in WAN_PRESETS:
        raise ValueError(f"unknown Wan preset {name!r}; known: {sorted(WAN_PRESETS)}")
    return WAN_PRESETS[name.lower()]()


def infer_config_from_diffsynth(state_dict: Mapping[str, torch.Tensor], head_dim: int = WAN_HEAD_DIM) -> dict:
    """ReCam constructor kwargs read off the shapes of a DiffSynth-layout DiT state dict.

    Everything but the head count follows from shapes; heads = D / ``head_dim`` (128 for every Wan2.1 size).
    ``rope_max_seq_len`` gets Wan's 1024: RoPE angles depend on the position only, so the table length does
    not change outputs as long as it covers the video.
    """
    needed_keys = ("patch_embedding.weight", "text_embedding.0.weight", "time_embedding.0.weight",
                   "blocks.0.ffn.0.weight", "head.head.weight")
    for needed in needed_keys:
        if needed not in state_dict:
            raise CheckpointMismatchError("<state dict>", missing=[needed],
                                          detail="cannot infer the model config from a DiffSynth-layout checkpoint")
    if any(k.startswith("img_emb.") for k in state_dict):
        raise ValueError("image-conditioned (I2V) Wan checkpoints are not supported by ReCamTransformer3DModel")
    patch = state_dict["patch_embedding.weight"]
    dim, in_channels = patch.shape[0], patch.shape[1]
    patch_size = tuple(int(s) for s in patch.shape[2:])
    if dim % head_dim:
        raise ValueError(f"model width {dim} is not divisible by head_dim {head_dim}; pass config explicitly")
    block_ids = {int(m.group(1)) for k in state_dict if (m := re.match(r"blocks\.(\d+)\.", k))}
    out_features = state_dict["head.head.weight"].shape[0]
    return {
        "patch_size": patch_size,
        "num_attention_heads": dim // head_dim,
        "attention_head_dim": head_dim,
        "in_channels": int(in_channels),
        "out_channels": int(out_features // math.prod(patch_size)),
        "text_dim": int(state_dict["text_embedding.0.weight"].shape[1]),
        "freq_dim": int(state_dict["time_embedding.0.weight"].shape[1]),
        "ffn_dim": int(state_dict["blocks.0.ffn.0.weight"].shape[0]),
        "num_layers": max(block_ids) + 1,
        "cross_attn_norm": "blocks.0.norm3.weight" in state_dict,
        "qk_norm": "rms_norm_across_heads" if "blocks.0.self_attn.norm_q.weight" in state_dict else None,
        "eps": 1e-6,
        "image_dim": None,
        "added_kv_proj_dim": None,
        "rope_max_seq_len": 1024,
        "pos_embed_seq_len": None,
    }


# ---------------------------------------------------------------------------------------------------------
# Building the transformer
# ---------------------------------------------------------------------------------------------------------


def _empty_model(config: Mapping) -> ReCamTransformer3DModel:
    # Parameters on meta, buffers (RoPE tables) real: the buffers are not in any checkpoint.
    with init_empty_weights(include_buffers=False):
        return ReCamTransformer3DModel(**config)


def _target_dtype(key: str, dtype: torch.dtype) -> torch.dtype:
    """``dtype``, except float32 for the modules diffusers keeps in full precision in half-precision loads
    (Wan: time embedder, modulation tables, norms), matched per dotted name component as diffusers does."""
    keep = ReCamTransformer3DModel._keep_in_fp32_modules or []
    if dtype in (torch.float16, torch.bfloat16) and any(m in key.split(".") for m in keep):
        return torch.float32
    return dtype


def _initial_value(key: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The constructor's value for a ReCam-only key (see ReCamTransformer3DModel.reset_camera_modules)."""
    match = CAMERA_KEY_RE.fullmatch(key)
    if match is not None and match.group(2) == "projector" and match.group(3) == "weight":
        return torch.eye(shape[0], dtype=dtype)
    if match is not None:
        return torch.zeros(shape, dtype=dtype)
    if key == NULL_TEXT_KEY:
        return (torch.randn(shape) * 0.02).to(dtype)
    raise KeyError(key)


def _assemble(
    config: Mapping,
    state_dict: dict[str, torch.Tensor],
    *,
    source: str,
    layout: str,
    dtype: torch.dtype,
    device: str | torch.device,
    allow_camera_init: bool,
    unmapped: tuple[str, ...] = (),
) -> tuple[ReCamTransformer3DModel, LoadReport]:
    """Check key sets and shapes, initialise the allowed absent keys, assign everything into a meta model.

    ``unmapped`` are source keys that could not even be renamed; they are reported as unexpected along with
    everything else, so one failed load shows every problem.
    """
    model = _empty_model(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}

    camera_keys = {k for k in expected if CAMERA_KEY_RE.fullmatch(k)}
    absent = set(expected) - set(state_dict)
    initialisable = {NULL_TEXT_KEY}
    if allow_camera_init and camera_keys <= absent:
        initialisable |= camera_keys
    missing = absent - initialisable
    unexpected = (set(state_dict) - set(expected)) | set(unmapped)
    mismatched = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k])}"
        for k, v in state_dict.items()
        if k in expected and v.shape != expected[k]
    ]
    if missing or unexpected or mismatched:
        detail = ""
        if camera_keys & missing and not camera_keys <= absent:
            detail = "camera modules are present for some blocks only"
        elif camera_keys & missing:
            detail = "a ReCamMaster checkpoint must contain every block's cam_encoder and projector"
        raise CheckpointMismatchError(source, missing, unexpected, mismatched, detail=detail)

    initialised = sorted(absent & initialisable)
    full = {k: v.to(_target_dtype(k, dtype)) if v.is_floating_point() else v for k, v in state_dict.items()}
    for key in initialised:
        full[key] = _initial_value(key, expected[key], _target_dtype(key, dtype))
    model.load_state_dict(full, strict=True, assign=True)
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise RuntimeError(f"parameters left on the meta device after loading: {still_meta}")
    model.to(device)
    model.eval()

    report = LoadReport(source=source, layout=layout, num_loaded=len(state_dict), initialised=initialised,
                        config=dict(model.config))
    logger.info(report.summary())
    return model, report


def _transformer_folder(path: Path) -> Path:
    # A whole diffusers pipeline folder keeps the transformer in a subfolder.
    if not (path / DIFFUSERS_CONFIG_NAME).is_file() and (path / "transformer" / DIFFUSERS_CONFIG_NAME).is_file():
        return path / "transformer"
    return path


def load_wan_transformer(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    null_text_len: int | None = None,
) -> tuple[ReCamTransformer3DModel, LoadReport]:
    """A Wan2.1 (or saved ReCam) transformer in diffusers layout -> ReCamTransformer3DModel.

    Args:
        path: the ``transformer`` folder (``config.json`` + safetensors, possibly sharded) or a pipeline folder
            containing one.
        dtype: dtype of the loaded model's floating tensors; with float16/bfloat16 the modules listed in
            ``_keep_in_fp32_modules`` stay float32, as in diffusers' ``from_pretrained(torch_dtype=...)``.
        device: where the model ends up.
        null_text_len: overrides the length of the learned null context when the config has none.

    Returns:
        (model in eval mode, report). Camera modules absent from the checkpoint are initialised as
        ReCamMaster does and listed in ``report.initialised``.

    Raises:
        CheckpointMismatchError: any other key missing, unexpected or of the wrong shape.
    """
    folder = _transformer_folder(Path(path))
    config_file = folder / DIFFUSERS_CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"no {DIFFUSERS_CONFIG_NAME} in {folder}")
    config = recam_config_from_diffusers(json.loads(config_file.read_text()))
    if null_text_len is not None and "null_text_len" not in config:
        config["null_text_len"] = null_text_len
    state_dict = read_state_dict(folder)
    return _assemble(config, state_dict, source=str(folder), layout="diffusers", dtype=dtype, device=device,
                     allow_camera_init=True)


def convert_diffsynth_state_dict(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Rename a DiffSynth-layout state dict to diffusers names.

    Returns:
        (converted dict, DiffSynth keys with no row in :data:`DIFFSYNTH_TO_DIFFUSERS`).
    """
    converted: dict[str, torch.Tensor] = {}
    unmapped: list[str] = []
    for key, tensor in state_dict.items():
        new_key = diffsynth_to_diffusers_key(key)
        if new_key is None:
            unmapped.append(key)
        else:
            converted[new_key] = tensor
    return converted, sorted(unmapped)


def load_recammaster_checkpoint(
    path: str | Path,
    *,
    config: Mapping | None = None,
    head_dim: int = WAN_HEAD_DIM,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    require_camera: bool = True,
) -> tuple[ReCamTransformer3DModel, LoadReport]:
    """A ReCamMaster (or plain Wan) DiT in DiffSynth layout -> ReCamTransformer3DModel.

    Args:
        path: a ``.ckpt``/``.pt``/``.pth``/``.safetensors`` file, or a folder of (sharded) safetensors.
        config: ReCam constructor kwargs; inferred from the weight shapes when None
            (:func:`infer_config_from_diffsynth` with ``head_dim``).
        dtype, device: of the loaded model (half precision keeps diffusers' fp32 modules, see
            :func:`load_wan_transformer`).
        require_camera: a ReCamMaster checkpoint must carry every block's camera modules; pass False to load a
            plain DiffSynth/original-Wan DiT, whose camera modules are then initialised and reported.

    Raises:
        CheckpointMismatchError: unmapped DiffSynth keys are reported as unexpected (under their DiffSynth
            names), and keys the model needs but the checkpoint lacks as missing (under diffusers names).
    """
    raw = read_state_dict(path)
    converted, unmapped = convert_diffsynth_state_dict(raw)
    if config is None:
        config = infer_config_from_diffsynth(raw, head_dim=head_dim)
    else:
        config = recam_config_from_diffusers(config)
    return _assemble(config, converted, source=str(path), layout="diffsynth", dtype=dtype, device=device,
                     allow_camera_init=not require_camera, unmapped=tuple(unmapped))


def to_diffsynth_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under DiffSynth names (the inverse mapping), e.g. to hand a model back to DiffSynth.

    ``null_text`` has no DiffSynth counterpart and is left out.
    """
    out: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        if key == NULL_TEXT_KEY:
            continue
        new_key = diffusers_to_diffsynth_key(key)
        if new_key is None:
            raise KeyError(f"{key} has no DiffSynth name in DIFFSYNTH_TO_DIFFUSERS")
        out[new_key] = tensor
    return out


# ---------------------------------------------------------------------------------------------------------
# Parameter counts on the meta device
# ---------------------------------------------------------------------------------------------------------


def parameter_breakdown(config: Mapping, lora_rank: int | None = None,
                        lora_targets: tuple[str, ...] = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0"),
                        ) -> dict[str, int]:
    """Exact parameter counts of a ReCam model built on the meta device (no memory, no weights).

    Returns a dict with ``total``, ``camera`` (cam_encoder + projector), ``self_attention`` (attn1),
    ``null_text``, ``wan`` (total minus the ReCam additions) and, with ``lora_rank``, ``lora`` = sum over the
    targeted Linear layers of rank * (in + out).
    """
    model = _empty_model(config)
    counts = {"total": 0, "camera": 0, "self_attention": 0, "null_text": 0}
    for name, param in model.named_parameters():
        n = param.numel()
        counts["total"] += n
        if ".cam_encoder." in name or ".projector." in name:
            counts["camera"] += n
        elif ".attn1." in name:
            counts["self_attention"] += n
        elif name == NULL_TEXT_KEY:
            counts["null_text"] += n
    counts["wan"] = counts["total"] - counts["camera"] - counts["null_text"]
    if lora_rank is not None:
        counts["lora"] = sum(
            lora_rank * (module.in_features + module.out_features)
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and any(name == t or name.endswith("." + t) for t in lora_targets)
        )
    return counts


# ---------------------------------------------------------------------------------------------------------
# Wan VAE
# ---------------------------------------------------------------------------------------------------------


def load_wan_vae(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """diffusers ``AutoencoderKLWan`` from a local folder (or a pipeline folder with a ``vae`` subfolder)."""
    from diffusers import AutoencoderKLWan

    folder = Path(path)
    if not (folder / DIFFUSERS_CONFIG_NAME).is_file() and (folder / "vae" / DIFFUSERS_CONFIG_NAME).is_file():
        folder = folder / "vae"
    if not (folder / DIFFUSERS_CONFIG_NAME).is_file():
        raise FileNotFoundError(f"no {DIFFUSERS_CONFIG_NAME} in {folder}")
    vae = AutoencoderKLWan.from_pretrained(str(folder), torch_dtype=dtype, local_files_only=True)
    return vae.to(device).eval()


def _latent_stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z_dim = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(1, z_dim, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float32).view(1, z_dim, 1, 1, 1)
    return mean.to(like.device, like.dtype), std.to(like.device, like.dtype)


def _vae_param(vae) -> torch.Tensor:
    return next(vae.parameters())


@torch.no_grad()
def encode_video(vae, video: torch.Tensor, *, sample: bool = False,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, 3, F, H, W) video in [-1, 1] -> (B, z, 1 + (F - 1) / 4, H / 8, W / 8) normalised latents.

    The posterior mode is used unless ``sample``. Latents are standardised per channel with the VAE config's
    ``latents_mean`` / ``latents_std`` -- the scale the Wan transformer was trained on.
    """
    if video.ndim != 5 or video.shape[1] != 3:
        raise ValueError(f"video must be (B, 3, F, H, W), got {tuple(video.shape)}")
    t_factor = vae.config.scale_factor_temporal or 4
    s_factor = vae.config.scale_factor_spatial or 8
    f, h, w = video.shape[2:]
    if (f - 1) % t_factor or h % s_factor or w % s_factor:
        raise ValueError(f"(F, H, W) = {(f, h, w)} must satisfy F = 1 + {t_factor}k and H, W divisible by {s_factor}")
    param = _vae_param(vae)
    dist = vae.encode(video.to(param.device, param.dtype)).latent_dist
    z = dist.sample(generator=generator) if sample else dist.mode()
    mean, std = _latent_stats(vae, z)
    return (z - mean) / std


@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_video`: normalised latents -> (B, 3, F, H, W) video clamped to [-1, 1]."""
    if latents.ndim != 5 or latents.shape[1] != vae.config.z_dim:
        raise ValueError(f"latents must be (B, {vae.config.z_dim}, F, H, W), got {tuple(latents.shape)}")
    param = _vae_param(vae)
    z = latents.to(param.device, param.dtype)
    mean, std = _latent_stats(vae, z)
    video = vae.decode(z * std + mean).sample
    return video.clamp(-1.0, 1.0)
