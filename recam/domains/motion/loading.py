"""Loading MDM checkpoints (GuyTevet/motion-diffusion-model, ``trans_enc``) into MotionDiffusionModel.

An MDM release is a folder holding ``model000475000.pt`` and ``args.json``. The ``.pt`` file is one of

* a plain ``state_dict`` of MDM's model (what ``torch.save(model.state_dict())`` writes), possibly with the
  ``module.`` prefix of DataParallel or one level of ``{"state_dict": ...}``;
* an EMA checkpoint ``{"model": state_dict, "model_avg": state_dict, ...}``. The averaged weights are taken
  unless ``use_ema=False``: MDM's own loaders prefer ``model_avg``, and those are the weights its reported
  numbers come from. Other top-level entries (optimiser state, step counters) are ignored and listed.

Key handling:

* ``clip_model.*``: CLIP's weights, which MDM sometimes saves along with its own. CLIP lives outside this
  model (:class:`recam.domains.motion.model.CLIPTextEncoder`), so they are stripped and counted in the report;
* ``sequence_pos_encoder.pe`` and ``embed_timestep.sequence_pos_encoder.pe``: MDM's fixed sinusoid tables,
  stored as buffers. This model computes the same sinusoid on the fly, so the tables are not loaded but compared
  with it (first 1000 rows, the timestep range) -- a different table means a different model, which is an error;
* every other key must match a parameter of MotionDiffusionModel by name and shape; anything missing,
  unexpected or of the wrong shape fails the whole load with :class:`MDMCheckpointMismatchError`, which names
  the file and every offending key.

Config: ``args.json`` fields win (``latent_dim``, ``layers``, ``heads``, ``ff_size``, ``dropout``,
``cond_mask_prob``, ``dataset``); fields it lacks come from the weight shapes where they determine them
(latent width, features, FF size, layer count, text width), else from MDM's hard-coded values (4 heads,
dropout 0.1: MDM's released ``args.json`` files carry neither). :attr:`LoadReport.config_origin` says which.

Attention masking: MDM masks padded frames out of attention only when trained with ``mask_frames``; the
original releases were not, so to reproduce them call the model with ``padding_mask=None``.
:attr:`LoadReport.trained_with_frame_mask` records the flag.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from recam.domains.motion.model import MotionDiffusionModel, mdm_config, sinusoid

logger = logging.getLogger(__name__)

ARGS_NAME = "args.json"
CLIP_PREFIX = "clip_model."
DERIVED_KEYS = ("sequence_pos_encoder.pe", "embed_timestep.sequence_pos_encoder.pe")
# Rows of the sinusoid table compared on load: the timestep range of a 1000-step model; beyond it float32
# rounding of large angles makes exact comparison meaningless.
PE_ROWS_CHECKED = 1000
PE_ATOL = 1e-4
# MDM's default table length (``pos_embed_max_len``), used when exporting.
MDM_PE_LEN = 5000

# args.json name -> MotionDiffusionModel config name. Both spellings of layers/heads occur in MDM forks.
ARGS_TO_CONFIG = {
    "latent_dim": "latent_dim",
    "layers": "num_layers",
    "num_layers": "num_layers",
    "heads": "num_heads",
    "num_heads": "num_heads",
    "ff_size": "ff_size",
    "dropout": "dropout",
    "cond_mask_prob": "cond_mask_prob",
}
DATASET_FEATURES = {"humanml": 263, "kit": 251}

_LAYER_RE = re.compile(r"seqTransEncoder\.layers\.(\d+)\.")


class CheckpointFormatError(ValueError):
    """The file is not a readable MDM checkpoint (not a torch file, or not holding a state dict)."""


class MDMCheckpointMismatchError(ValueError):
    """A checkpoint does not fill MotionDiffusionModel exactly; the message lists every offending key."""

    def __init__(self, source: str, missing=(), unexpected=(), shape_mismatch=(), detail: str = ""):
        self.source = source
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.shape_mismatch = sorted(shape_mismatch)
        lines = [f"checkpoint {source} does not match MotionDiffusionModel; nothing was loaded."]
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
    """What a load did.

    Attributes:
        source: the checkpoint file.
        args_source: the args.json file, ``"<mapping>"`` when args were passed as a dict.
        variant: ``"plain"``, ``"model_avg"`` (EMA weights) or ``"model"`` (raw weights of an EMA checkpoint).
        num_loaded: tensors assigned to the model.
        stripped: ``clip_model.*`` keys removed.
        derived: sinusoid tables compared with the model's own and not loaded.
        ignored_entries: top-level entries of an EMA checkpoint other than the chosen weights.
        config: the model config built.
        config_origin: per config field, ``"args.json"``, ``"shapes"`` or ``"default"``.
        args: the full args.json (diffusion steps, noise schedule... for the sampler).
        trained_with_frame_mask: args.json's ``mask_frames`` (False when absent).
    """

    source: str
    args_source: str
    variant: str
    num_loaded: int
    stripped: list[str] = field(default_factory=list)
    derived: list[str] = field(default_factory=list)
    ignored_entries: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    config_origin: dict = field(default_factory=dict)
    args: dict = field(default_factory=dict)
    trained_with_frame_mask: bool = False

    def summary(self) -> str:
        text = f"loaded {self.num_loaded} tensors from {self.source} ({self.variant})"
        if self.stripped:
            text += f"; stripped {len(self.stripped)} clip_model keys"
        if self.derived:
            text += f"; checked and skipped sinusoid tables {self.derived}"
        defaulted = sorted(k for k, v in self.config_origin.items() if v == "default")
        if defaulted:
            text += f"; MDM defaults for {defaulted}"
        return text


# ---------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------


def _torch_load(path: Path):
    try:
        # weights_only, always: a checkpoint is data, never code to run (a file that needs more is refused, and the
        # message says how its owner can take the tensors out where they trust it)
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # torch wraps every refusal of its safe unpickler in one long message; the part that matters is the
        # "Unsupported global: GLOBAL <name> ..." sentence, present only when the file is a real pickle of
        # objects other than tensors and containers.
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if found:
            raise CheckpointFormatError(
                f"{path} holds Python objects that safe loading refuses ({found.group(1)}), and recam never "
                "unpickles them; if you trust the file, save its state dict on its own (torch.save(obj['model'], "
                "...) or safetensors) and load that"
            ) from err
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        raise CheckpointFormatError(f"{path} is not a torch checkpoint ({lines[-1] if lines else 'unpickling'})") \
            from err
    except Exception as err:  # garbage bytes surface as any error type of the unpickler
        if isinstance(err, MemoryError):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointFormatError(f"{path} is not a torch checkpoint ({type(err).__name__}: {first})") from err


def _is_state_dict(obj) -> bool:
    return isinstance(obj, Mapping) and all(isinstance(k, str) for k in obj)


def read_mdm_checkpoint(path: str | Path, *, use_ema: bool = True) -> tuple[dict[str, torch.Tensor], str, list[str]]:
    """The tensors of an MDM ``.pt`` file.

    Returns:
        (state dict with ``module.`` prefixes removed, variant, ignored top-level entries); see the module
        docstring for the layouts and the EMA choice.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {path}")
    obj = _torch_load(path)
    if not _is_state_dict(obj):
        raise CheckpointFormatError(f"{path} holds a {type(obj).__name__}, not a state dict")

    variant, ignored = "plain", []
    ema_entries = [k for k in ("model_avg", "model") if _is_state_dict(obj.get(k))]
    if ema_entries:
        if use_ema and "model_avg" in ema_entries:
            variant = "model_avg"
        elif "model" in ema_entries:
            variant = "model"
        else:
            raise CheckpointFormatError(f"{path} holds only 'model_avg' weights; pass use_ema=True to load them")
        ignored = sorted(k for k in obj if k != variant)
        obj = obj[variant]
    elif set(obj) == {"state_dict"} and _is_state_dict(obj["state_dict"]):
        obj = obj["state_dict"]

    state = dict(obj)
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    not_tensors = sorted(k for k, v in state.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        shown = ", ".join(f"{k} ({type(state[k]).__name__})" for k in not_tensors[:10])
        raise CheckpointFormatError(f"{path} ({variant}) has entries that are not tensors: {shown}")
    if not state:
        raise CheckpointFormatError(f"{path} ({variant}) holds no tensors")
    return state, variant, ignored


def read_args(args_json: str | Path | Mapping | None, checkpoint: Path) -> tuple[dict, str]:
    """args.json as a dict, and where it came from (``None`` looks next to the checkpoint)."""
    if isinstance(args_json, Mapping):
        return dict(args_json), "<mapping>"
    path = Path(args_json) if args_json is not None else checkpoint.parent / ARGS_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"no {ARGS_NAME} at {path} (MDM keeps it next to the checkpoint); pass args_json= a path, or a dict "
            "such as {} to build MDM's default size"
        )
    try:
        args = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(args, dict):
        raise ValueError(f"{path} holds a JSON {type(args).__name__}, expected an object")
    return args, str(path)


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------


def config_from_args(args: Mapping, state_dict: Mapping[str, torch.Tensor],
                     args_source: str = "args.json") -> tuple[dict, dict]:
    """MotionDiffusionModel config from MDM args and weight shapes: (config, origin per field)."""
    arch = args.get("arch", "trans_enc")
    if arch != "trans_enc":
        raise ValueError(f"{args_source}: arch {arch!r} is not supported; MotionDiffusionModel is MDM's trans_enc")
    if args.get("unconstrained"):
        raise ValueError(f"{args_source}: unconstrained (text-free) MDM models are not supported")
    if args.get("cond_mode", "text") != "text":
        raise ValueError(f"{args_source}: cond_mode {args['cond_mode']!r} is not supported; only text")

    config = mdm_config()
    origin = dict.fromkeys(config, "default")

    def from_shapes(name: str, value) -> None:
        config[name] = int(value)
        origin[name] = "shapes"

    pose = state_dict.get("input_process.poseEmbedding.weight")
    if pose is not None and pose.ndim == 2:
        from_shapes("latent_dim", pose.shape[0])
        from_shapes("njoints", pose.shape[1])
    text = state_dict.get("embed_text.weight")
    if text is not None and text.ndim == 2:
        from_shapes("text_dim", text.shape[1])
    ff = state_dict.get("seqTransEncoder.layers.0.linear1.weight")
    if ff is not None and ff.ndim == 2:
        from_shapes("ff_size", ff.shape[0])
    layers = {int(m.group(1)) for k in state_dict if (m := _LAYER_RE.match(k))}
    if layers:
        from_shapes("num_layers", max(layers) + 1)

    if "dataset" in args:
        if args["dataset"] not in DATASET_FEATURES:
            raise ValueError(f"{args_source}: dataset {args['dataset']!r} unknown; known {sorted(DATASET_FEATURES)}")
        config["njoints"] = DATASET_FEATURES[args["dataset"]]
        origin["njoints"] = "args.json"
    for arg_name, cfg_name in ARGS_TO_CONFIG.items():
        if arg_name in args:
            value = args[arg_name]
            config[cfg_name] = float(value) if cfg_name in ("dropout", "cond_mask_prob") else int(value)
            origin[cfg_name] = "args.json"
    return config, origin


# ---------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------


def _check_sinusoid_table(key: str, table: torch.Tensor, latent_dim: int) -> str | None:
    """None when ``table`` is MDM's sinusoid for this width, else what is wrong."""
    if table.ndim != 3 or table.shape[1] != 1 or table.shape[2] != latent_dim:
        return f"{key}: checkpoint {tuple(table.shape)} vs model (L, 1, {latent_dim})"
    rows = min(table.shape[0], PE_ROWS_CHECKED)
    ours = sinusoid(torch.arange(rows), latent_dim)
    err = (table[:rows, 0].float() - ours).abs().max().item()
    if err > PE_ATOL:
        return f"{key}: differs from the model's sinusoid by up to {err:.3g}"
    return None


def load_mdm_checkpoint(
    path: str | Path,
    args_json: str | Path | Mapping | None = None,
    *,
    use_ema: bool = True,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[MotionDiffusionModel, LoadReport]:
    """An MDM checkpoint (``model000475000.pt`` + ``args.json``) -> (MotionDiffusionModel in eval mode, report).

    Args:
        path: the ``.pt`` file.
        args_json: path of args.json, or the args as a dict; None reads ``args.json`` next to ``path``.
        use_ema: from an EMA checkpoint take ``model_avg`` (default) rather than ``model``.
        dtype, device: of the loaded model.

    Raises:
        FileNotFoundError: no checkpoint or no args.json.
        CheckpointFormatError: not a torch file, or not holding a state dict.
        MDMCheckpointMismatchError: missing, unexpected or wrongly shaped keys, or foreign sinusoid tables.
    """
    path = Path(path)
    state, variant, ignored = read_mdm_checkpoint(path, use_ema=use_ema)
    args, args_source = read_args(args_json, path)
    config, origin = config_from_args(args, state, args_source)
    source = f"{path} ({variant})" if variant != "plain" else str(path)

    stripped = sorted(k for k in state if k.startswith(CLIP_PREFIX))
    weights = {k: v for k, v in state.items() if not k.startswith(CLIP_PREFIX)}
    bad_tables = []
    derived = []
    for key in DERIVED_KEYS:
        if key in weights:
            problem = _check_sinusoid_table(key, weights.pop(key), config["latent_dim"])
            if problem:
                bad_tables.append(problem)
            derived.append(key)

    model = MotionDiffusionModel(**config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = set(expected) - set(weights)
    unexpected = set(weights) - set(expected)
    mismatched = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k])}"
        for k, v in weights.items()
        if k in expected and v.shape != expected[k]
    ]
    if missing or unexpected or mismatched or bad_tables:
        detail = f"config {config} (from {args_source} and the weight shapes)"
        raise MDMCheckpointMismatchError(source, missing, unexpected, mismatched + bad_tables, detail=detail)

    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}, strict=True)
    model.to(device=device, dtype=dtype).eval()
    report = LoadReport(
        source=str(path), args_source=args_source, variant=variant, num_loaded=len(weights), stripped=stripped,
        derived=derived, ignored_entries=ignored, config=dict(model.config), config_origin=origin, args=args,
        trained_with_frame_mask=bool(args.get("mask_frames", False)),
    )
    logger.info(report.summary())
    return model, report


def to_mdm_state_dict(model: MotionDiffusionModel, pe_len: int = MDM_PE_LEN) -> dict[str, torch.Tensor]:
    """The model's weights in MDM's layout, sinusoid tables included (MDM's strict loader expects them), e.g.
    to score a fine-tuned model with MDM's own evaluation scripts."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    table = sinusoid(torch.arange(pe_len), model.config.latent_dim)[:, None, :]
    for key in DERIVED_KEYS:
        state[key] = table.clone()
    return state
