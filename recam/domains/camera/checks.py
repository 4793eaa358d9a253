"""The camera domain's config checks, run by config/validate.py through the domain's hooks before any model is
built: `validate_camera` (CameraDomain.check_config: the sampler, the video data and the checkpoint's format) and
`validate_camera_files` (CameraDomain.check_files: the paths and config.json headers they name, never weights);
`check_in_channels` is run again on the loaded transformer (CameraDomain.build_policy).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_collections

from recam.infra.config_checks import (
    _get,
    _is_int,
    _require,
    check_int,
    check_nonempty_str,
    check_number,
    eval_report_rewards,
)

DATA_SOURCES = ("synthetic", "recammaster")
MODEL_FORMATS = ("recam", "wan_diffusers", "recammaster_diffsynth")
MODEL_DTYPES = ("float32", "bfloat16")
# cam_score's estimator that reads the synthetic world's landmarks: real data has none (recam/domains/camera/data.py).
LANDMARK_ESTIMATOR = "landmarks"


def validate_camera(config: ml_collections.ConfigDict, conds_per_batch: int) -> None:
    """The camera domain's checks: the flow-matching sampler, the video data and the transformer checkpoint's
    format (its rewards' names and settings: check_rewards)."""
    from recam.engine.scheduler import FLOW_NOISE_RANGE, FLOW_STEPS

    weights = dict(config.reward.weights)

    s = config.sample
    for field in ("data.num_frames", "data.size", "data.conditions_per_scene", "data.height", "data.width",
                  "data.frame_interval", "data.num_heldout_scenes"):
        value = _get(config, field)
        _require(_is_int(value) and value >= 1, f"{field} must be a positive integer, got {value!r}")
    check_int(config, "data.cache_size", 0, why="decoded conditions kept per process")
    _require(isinstance(config.data.source_cams, str),
             f"data.source_cams must be a comma-separated string like 'cam01,cam02', got {config.data.source_cams!r}")
    check_nonempty_str(config, "model.pretrained")
    _require(s.sde_type in FLOW_STEPS, f"sample.sde_type must be one of {sorted(FLOW_STEPS)}, got {s.sde_type!r}")
    check_number(config, "sample.shift", 0, None, low_open=True, why="sigma schedule time shift; 1 = linear sigmas")
    low, high, why = FLOW_NOISE_RANGE[s.sde_type]
    check_number(config, "sample.noise_level", low, high, low_open=True, why=f"sample.sde_type={s.sde_type!r}: {why}")
    check_number(config, "data.hfov_deg", 0, 180, high_open=True, why="0 = fx = W")
    e = config.eval
    scored_at_eval = {k for k, w in weights.items() if w > 0} | set(eval_report_rewards(config))
    for field in ("select_by", "select_guard"):  # real data has no validation split: there the last epoch reports
        _require(e[field] == "" or e[field] in scored_at_eval or config.data.source != "synthetic",
                 f"eval.{field}={e[field]!r} must be '' or a reward scored at evaluation (a positive reward.weights "
                 f"entry or one in eval.report_rewards): {sorted(scored_at_eval)}")
    _require(not e.select_by or config.data.source != "synthetic" or config.data.num_val_conditions >= 1,
             f"eval.select_by={e.select_by!r} needs validation conditions: data.num_val_conditions must be >= 1, "
             f"got {config.data.num_val_conditions}")
    d, m = config.data, config.model
    _require(d.source in DATA_SOURCES, f"data.source={d.source!r} unknown; use one of {list(DATA_SOURCES)}")
    _require(m.format in MODEL_FORMATS, f"model.format={m.format!r} unknown; use one of {list(MODEL_FORMATS)}")
    _require(m.dtype in MODEL_DTYPES, f"model.dtype={m.dtype!r} unknown; use one of {list(MODEL_DTYPES)}")
    _require(m.dtype == "float32" or m.lora_rank > 0,
             f"model.dtype={m.dtype!r} keeps the loaded weights in half precision, which only a LoRA adapter (fp32) "
             "may train: set model.lora_rank > 0 or model.dtype='float32'")
    _require(m.dtype == "float32" or config.mixed_precision == "bf16",
             f"model.dtype={m.dtype!r} needs mixed_precision='bf16' (the model does not cast its inputs), got "
             f"{config.mixed_precision!r}")
    if d.source == "synthetic":
        _require(
            d.num_train_conditions >= conds_per_batch,
            f"data.num_train_conditions={d.num_train_conditions} is smaller than the "
            f"{conds_per_batch} unique conditions one sampling batch needs",
        )
        _require(d.num_heldout_conditions >= 1,
                 f"data.num_heldout_conditions must be >= 1 (the held-out evaluation), got {d.num_heldout_conditions}")
    else:
        _require(isinstance(d.root, str) and d.root != "",
                 "data.source='recammaster' needs data.root, the folder holding the scene folders")
        _require(d.num_train_conditions == 0 or d.num_train_conditions >= conds_per_batch,
                 f"data.num_train_conditions={d.num_train_conditions} is smaller than the {conds_per_batch} unique "
                 "conditions one sampling batch needs (0 = every condition)")
        uses_cam = weights.get("cam_score", 0) > 0 or "cam_score" in eval_report_rewards(config)
        _require(not uses_cam or config.reward.cam.estimator != LANDMARK_ESTIMATOR,
                 f"reward.cam.estimator={LANDMARK_ESTIMATOR!r} needs the synthetic world's landmarks, which real data "
                 "(data.source='recammaster') does not have: set --config.reward.cam.estimator=sfm (or served)")


def _transformer_config_file(config: ml_collections.ConfigDict) -> Path | None:
    folder = Path(config.model.pretrained)
    if config.model.format == "wan_diffusers" and not (folder / "config.json").is_file():
        folder = folder / "transformer"  # a whole -Diffusers pipeline folder
    return folder / "config.json" if folder.is_dir() else None


def _diffsynth_in_channels(path: Path) -> int | None:
    """Input channels of a DiffSynth-layout checkpoint file, read from patch_embedding's shape without loading the
    weights (safetensors header, or a memory-mapped torch file); None when that is not possible (folders, legacy
    torch files): the trainer then checks right after loading."""
    import torch

    key = "patch_embedding.weight"
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                return int(f.get_slice(key).get_shape()[1]) if key in f.keys() else None
        if path.suffix in (".ckpt", ".pt", ".pth", ".bin"):
            state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
            for wrapper in ("state_dict", "module"):
                if isinstance(state, dict) and set(state) == {wrapper}:
                    state = state[wrapper]
            return int(state[key].shape[1]) if key in state else None
    except Exception:  # unreadable here (legacy torch format, pickled objects): the loader will say what is wrong
        return None
    return None


def _vae_config(path: str) -> dict:
    folder = Path(path)
    if not (folder / "config.json").is_file() and (folder / "vae" / "config.json").is_file():
        folder = folder / "vae"
    _require((folder / "config.json").is_file(), f"model.vae={path!r}: no config.json in {folder} (nor in a vae/ "
             "subfolder); point it at the Wan VAE folder or the -Diffusers pipeline folder")
    return json.loads((folder / "config.json").read_text())


def latent_channels(config: ml_collections.ConfigDict) -> int:
    """Channels of the space the policy samples in: 3 for pixels, the VAE's z_dim for latents."""
    return 3 if not config.model.vae else int(_vae_config(config.model.vae)["z_dim"])


def check_in_channels(in_channels: int, config: ml_collections.ConfigDict) -> None:
    """The transformer must take the codec's channels; the message carries both numbers."""
    channels = latent_channels(config)
    space = f"the latents of model.vae={config.model.vae!r}" if config.model.vae else "pixel space (model.vae='')"
    _require(in_channels == channels,
             f"model.pretrained={config.model.pretrained!r} has in_channels={in_channels} but {space} has "
             f"{channels} channels; use a model and a model.vae that belong together")


def validate_camera_files(config: ml_collections.ConfigDict) -> None:
    """The camera domain's files: data.root, model.pretrained, the VAE's config and the channels they imply."""
    d, m = config.data, config.model
    if d.source == "recammaster":
        _require(Path(d.root).is_dir(), f"data.root={d.root!r} is not a folder (data.source='recammaster')")
    _require(Path(m.pretrained).exists(), f"model.pretrained={m.pretrained!r} does not exist "
             f"(model.format={m.format!r})")
    if m.vae:
        vae = _vae_config(m.vae)
        t, sp = vae.get("scale_factor_temporal") or 4, vae.get("scale_factor_spatial") or 8
        h, w = (d.height, d.width) if d.source == "recammaster" else (d.size, d.size)
        _require((d.num_frames - 1) % t == 0,
                 f"data.num_frames={d.num_frames} must be 1 + {t}k for the Wan VAE (model.vae={m.vae!r})")
        _require(h % sp == 0 and w % sp == 0,
                 f"frame size {h}x{w} (data.{'height/width' if d.source == 'recammaster' else 'size'}) must be "
                 f"divisible by the Wan VAE's spatial factor {sp}")
    if m.format == "recammaster_diffsynth":
        in_channels = _diffsynth_in_channels(Path(m.pretrained))
    else:
        config_file = _transformer_config_file(config)
        _require(config_file is not None and config_file.is_file(),
                 f"model.pretrained={m.pretrained!r}: no config.json there (model.format={m.format!r})")
        model_config = json.loads(config_file.read_text())
        in_channels = model_config.get("in_channels")
        check_sample_shape(model_config, config)
        check_trained_sample(config_file.parent / "provenance.json", config)
    if in_channels is not None:
        check_in_channels(int(in_channels), config)


def check_trained_sample(provenance: Path, config: ml_collections.ConfigDict) -> None:
    """Synthetic frames of the size the base was pretrained at (provenance.json's trained_sample, written by
    scripts/pretrain/pretrain_base.py): a ReCam-Tiny base asked for other sizes runs, but on frames it never learned."""
    d = config.data
    if d.source != "synthetic" or config.model.vae or not provenance.is_file():
        return
    try:
        trained = json.loads(provenance.read_text()).get("trained_sample") or {}
    except (OSError, json.JSONDecodeError):
        return
    for field, value in (("size", d.size), ("num_frames", d.num_frames)):
        if field in trained:
            _require(value == trained[field], f"data.{field}={value} but model.pretrained={config.model.pretrained!r} "
                     f"was pretrained on synthetic samples with {field} {trained[field]} ({provenance}); set "
                     f"--config.data.{field}={trained[field]} or pretrain a base at that size")


def check_sample_shape(model_config: dict, config: ml_collections.ConfigDict) -> None:
    """The frames the data gives, in the space the policy samples in, against the checkpoint's own config.json:
    each of (F, H, W) divisible by its patch_size, and the (2F, H, W) patches (source and target are joined along
    frames) within its rope_max_seq_len; the transformer would otherwise fail at its first forward.

    The checkpoint's config.json does not record the frame size it was trained at (checkpoints/recam_tiny_base
    has patch_size and rope_max_seq_len only), so a size the base never saw that fits these limits passes."""
    d, m = config.data, config.model
    patch, rope = model_config.get("patch_size"), model_config.get("rope_max_seq_len")
    if not (isinstance(patch, (list, tuple)) and len(patch) == 3):
        return
    size_field = "data.height/data.width" if d.source == "recammaster" else "data.size"
    f, h, w = (d.num_frames, d.height, d.width) if d.source == "recammaster" else (d.num_frames, d.size, d.size)
    space = "pixels"
    if m.vae:
        vae = _vae_config(m.vae)
        t, sp = vae.get("scale_factor_temporal") or 4, vae.get("scale_factor_spatial") or 8
        f, h, w, space = 1 + (f - 1) // t, h // sp, w // sp, "VAE latents"
    p_t, p_h, p_w = (int(x) for x in patch)
    ckpt = f"the config.json of model.pretrained={m.pretrained!r}"
    _require(f % p_t == 0, f"data.num_frames={d.num_frames} must give a frame count ({f} in {space}) divisible by "
             f"the temporal patch size {p_t} (patch_size {list(patch)} in {ckpt})")
    size = f"{d.height}x{d.width}" if d.source == "recammaster" else str(d.size)
    _require(h % p_h == 0 and w % p_w == 0,
             f"{size_field}={size} must give frames ({h}x{w} in {space}) divisible by the patch size {p_h}x{p_w} "
             f"(patch_size {list(patch)} in {ckpt})")
    if isinstance(rope, int):
        patches = (2 * f // p_t, h // p_h, w // p_w)
        _require(patches[0] <= rope, f"data.num_frames={d.num_frames} must give at most {rope} frame patches for "
                 f"source + target (rope_max_seq_len in {ckpt}), got 2F = {patches[0]}")
        _require(max(patches[1:]) <= rope, f"{size_field}={size} must give at most {rope} patches per side "
                 f"(rope_max_seq_len in {ckpt}), got {patches[1]}x{patches[2]}")
