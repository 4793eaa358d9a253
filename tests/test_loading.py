"""Loading real-layout checkpoints: diffusers Wan folders, DiffSynth/ReCamMaster state dicts, the Wan VAE."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors.torch import load_file, save_file

from recam.domains.camera import loading
from recam.domains.camera.loading import (
    DIFFSYNTH_TO_DIFFUSERS,
    CheckpointMismatchError,
    decode_latents,
    diffsynth_to_diffusers_key,
    diffusers_to_diffsynth_key,
    encode_video,
    load_recammaster_checkpoint,
    load_wan_transformer,
    load_wan_vae,
    parameter_breakdown,
    to_diffsynth_state_dict,
)
from recam.domains.camera.model import ReCamTransformer3DModel, tiny_config

WAN_KEYS = [k for k in tiny_config() if k != "null_text_len"]


def _inputs(cfg: dict, seed: int = 0, batch: int = 2, frames: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    shape = (batch, cfg["in_channels"], frames, 16, 16)
    cams = lambda: torch.randn(batch, frames, 3, 4, generator=g)
    return {
        "noisy_target": torch.randn(*shape, generator=g),
        "sigma": torch.rand(batch, generator=g),
        "source_video": torch.randn(*shape, generator=g),
        "source_cams": cams(),
        "target_cams": cams(),
        "encoder_hidden_states": torch.randn(batch, 5, cfg["text_dim"], generator=g),
    }


def _randomize_camera(model: ReCamTransformer3DModel, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            for lin in (block.cam_encoder, block.projector):
                lin.weight.add_(0.1 * torch.randn(lin.weight.shape, generator=g))
                lin.bias.add_(0.1 * torch.randn(lin.bias.shape, generator=g))


@pytest.fixture(scope="module")
def wan_source() -> WanTransformer3DModel:
    torch.manual_seed(0)
    return WanTransformer3DModel(**{k: tiny_config()[k] for k in WAN_KEYS}).eval()


def _reference_from_wan(wan: WanTransformer3DModel) -> ReCamTransformer3DModel:
    ref = ReCamTransformer3DModel(**tiny_config()).eval()
    result = ref.load_state_dict(wan.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert all(re.fullmatch(r"blocks\.\d+\.(cam_encoder|projector)\.(weight|bias)|null_text", k)
               for k in result.missing_keys)
    return ref


# ----------------------------------------------------------------------------------------------------- mapping


def test_mapping_is_a_bijection_on_the_model_keys():
    model = ReCamTransformer3DModel(**tiny_config())
    keys = [k for k in model.state_dict() if k != "null_text"]
    diffsynth = [diffusers_to_diffsynth_key(k) for k in keys]
    assert None not in diffsynth, [k for k, d in zip(keys, diffsynth, strict=True) if d is None]
    assert len(set(diffsynth)) == len(keys)
    assert [diffsynth_to_diffusers_key(d) for d in diffsynth] == keys
    # Spot-check the rows that are not plain renames.
    assert diffsynth_to_diffusers_key("blocks.3.norm3.weight") == "blocks.3.norm2.weight"
    assert diffsynth_to_diffusers_key("blocks.0.modulation") == "blocks.0.scale_shift_table"
    assert diffsynth_to_diffusers_key("head.modulation") == "scale_shift_table"
    assert diffsynth_to_diffusers_key("blocks.12.self_attn.o.bias") == "blocks.12.attn1.to_out.0.bias"
    assert diffsynth_to_diffusers_key("time_projection.1.weight") == "condition_embedder.time_proj.weight"
    assert diffsynth_to_diffusers_key("blocks.0.self_attn.qq.weight") is None
    assert len(DIFFSYNTH_TO_DIFFUSERS) == 26


def test_mapping_agrees_with_diffusers_single_file_converter():
    # diffusers ships its own original-Wan -> diffusers renaming; ours must give the same names for every key.
    model = ReCamTransformer3DModel(**tiny_config())
    diffsynth = to_diffsynth_state_dict(model)
    converted = convert_wan_transformer_to_diffusers(dict(diffsynth))
    ours = {diffsynth_to_diffusers_key(k): v for k, v in diffsynth.items()}
    assert set(converted) == set(ours)
    assert all(converted[k] is ours[k] for k in ours)


# -------------------------------------------------------------------------------------------- diffusers layout


def test_load_wan_diffusers_single_file_matches_source(tmp_path, wan_source):
    wan_source.save_pretrained(tmp_path / "wan")
    model, report = load_wan_transformer(tmp_path / "wan")

    camera = [k for k in model.state_dict() if ".cam_encoder." in k or ".projector." in k]
    assert report.layout == "diffusers"
    assert sorted(report.initialised) == sorted(camera + ["null_text"])
    assert report.num_loaded == len(wan_source.state_dict())
    for block in model.blocks:
        assert torch.equal(block.cam_encoder.weight, torch.zeros_like(block.cam_encoder.weight))
        assert torch.equal(block.projector.weight, torch.eye(block.projector.weight.shape[0]))
        assert torch.equal(block.projector.bias, torch.zeros_like(block.projector.bias))
    assert all(p.requires_grad and not p.is_meta for p in model.parameters())

    ref = _reference_from_wan(wan_source)
    inputs = _inputs(tiny_config())
    with torch.no_grad():
        assert torch.allclose(model(**inputs), ref(**inputs), atol=1e-6)


def test_load_wan_diffusers_sharded_pipeline_folder(tmp_path, wan_source):
    # A pipeline folder with the transformer in a subfolder, sharded as diffusers does for 14B.
    wan_source.save_pretrained(tmp_path / "pipe" / "transformer", max_shard_size="100KB")
    assert (tmp_path / "pipe" / "transformer" / loading.DIFFUSERS_INDEX_NAME).is_file()
    model, report = load_wan_transformer(tmp_path / "pipe", dtype=torch.float64)
    assert report.num_loaded == len(wan_source.state_dict())
    assert all(p.dtype == torch.float64 for p in model.parameters())

    ref = _reference_from_wan(wan_source).double()
    inputs = {k: v.double() for k, v in _inputs(tiny_config(), seed=3).items()}
    with torch.no_grad():
        assert torch.allclose(model(**inputs), ref(**inputs), atol=1e-10)


def _rewrite_single_file(folder: Path, edit) -> None:
    weights = folder / loading.DIFFUSERS_WEIGHTS_NAME
    state = load_file(str(weights))
    edit(state)
    save_file(state, str(weights))


def test_diffusers_missing_key_fails_naming_it(tmp_path, wan_source):
    wan_source.save_pretrained(tmp_path)
    _rewrite_single_file(tmp_path, lambda s: s.pop("blocks.1.attn2.to_k.weight"))
    with pytest.raises(CheckpointMismatchError, match=r"missing keys \(1\): blocks\.1\.attn2\.to_k\.weight") as err:
        load_wan_transformer(tmp_path)
    assert err.value.missing == ["blocks.1.attn2.to_k.weight"]
    assert not err.value.unexpected


def test_diffusers_unexpected_key_fails_naming_it(tmp_path, wan_source):
    wan_source.save_pretrained(tmp_path)
    _rewrite_single_file(tmp_path, lambda s: s.update({"blocks.0.attn1.to_z.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointMismatchError, match=r"unexpected keys \(1\): blocks\.0\.attn1\.to_z\.weight"):
        load_wan_transformer(tmp_path)


def test_diffusers_shape_mismatch_and_partial_camera_fail(tmp_path, wan_source):
    wan_source.save_pretrained(tmp_path)
    _rewrite_single_file(tmp_path, lambda s: s.update({"proj_out.bias": torch.zeros(7)}))
    with pytest.raises(CheckpointMismatchError, match=r"proj_out\.bias: checkpoint \(7,\) vs model \(48,\)"):
        load_wan_transformer(tmp_path)

    # Camera modules for block 0 only: neither a plain Wan nor a ReCam checkpoint.
    wan_source.save_pretrained(tmp_path)
    dim = 96
    _rewrite_single_file(tmp_path, lambda s: s.update({
        "blocks.0.cam_encoder.weight": torch.zeros(dim, 12), "blocks.0.cam_encoder.bias": torch.zeros(dim),
        "blocks.0.projector.weight": torch.eye(dim), "blocks.0.projector.bias": torch.zeros(dim)}))
    with pytest.raises(CheckpointMismatchError, match="some blocks only") as err:
        load_wan_transformer(tmp_path)
    assert "blocks.1.projector.weight" in err.value.missing


def test_diffusers_unknown_config_key_fails(tmp_path, wan_source):
    wan_source.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_experts"] = 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_experts"):
        load_wan_transformer(tmp_path)


def test_saved_recam_model_roundtrips_through_diffusers_layout(tmp_path):
    torch.manual_seed(4)
    source = ReCamTransformer3DModel(**tiny_config()).eval()
    _randomize_camera(source)
    source.save_pretrained(tmp_path)
    model, report = load_wan_transformer(tmp_path)
    assert report.initialised == []
    inputs = _inputs(tiny_config(), seed=5)
    inputs.pop("encoder_hidden_states")  # exercises the loaded null_text too
    with torch.no_grad():
        assert torch.equal(model(**inputs), source(**inputs))


# --------------------------------------------------------------------------------------------- DiffSynth layout


@pytest.fixture(scope="module")
def recam_source() -> ReCamTransformer3DModel:
    torch.manual_seed(7)
    model = ReCamTransformer3DModel(**tiny_config()).eval()
    _randomize_camera(model)
    return model


@pytest.mark.parametrize("suffix", [".safetensors", ".ckpt"])
def test_load_diffsynth_checkpoint_matches_source(tmp_path, recam_source, suffix):
    state = to_diffsynth_state_dict(recam_source)
    assert "blocks.1.self_attn.q.weight" in state and "head.head.weight" in state
    assert "blocks.0.cam_encoder.weight" in state and "blocks.0.norm3.bias" in state
    path = tmp_path / f"step100{suffix}"
    if suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        # ReCamMaster saves torch.save(state_dict) in bf16; bf16 here checks the dtype cast too.
        torch.save({k: v.to(torch.bfloat16) for k, v in state.items()}, str(path))

    model, report = load_recammaster_checkpoint(path, config=tiny_config())
    assert report.layout == "diffsynth" and report.initialised == ["null_text"]
    assert all(p.dtype == torch.float32 for p in model.parameters())

    expected = recam_source
    if suffix == ".ckpt":
        expected = ReCamTransformer3DModel(**tiny_config()).eval()
        expected.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in recam_source.state_dict().items()})
    inputs = _inputs(tiny_config(), seed=11)
    with torch.no_grad():
        out = model(**inputs)
        assert torch.allclose(out, expected(**inputs), atol=1e-6)
        # The camera weights were really loaded: zeroing them changes the output.
        recam_plain = ReCamTransformer3DModel(**tiny_config()).eval()
        recam_plain.load_state_dict(expected.state_dict())
        recam_plain.reset_camera_modules()
        assert not torch.allclose(out, recam_plain(**inputs), atol=1e-4)


def test_diffsynth_config_inferred_from_shapes(tmp_path, recam_source):
    state = {k: v.contiguous() for k, v in to_diffsynth_state_dict(recam_source).items()}
    save_file(state, str(tmp_path / "a.safetensors"))
    model, report = load_recammaster_checkpoint(tmp_path, head_dim=48)
    for key in WAN_KEYS:
        if key != "rope_max_seq_len":
            assert report.config[key] == (tuple(tiny_config()[key]) if key == "patch_size" else tiny_config()[key]), key
    inputs = _inputs(tiny_config(), seed=12)
    with torch.no_grad():
        assert torch.allclose(model(**inputs), recam_source(**inputs), atol=1e-6)


def test_diffsynth_missing_and_unexpected_keys_fail(tmp_path, recam_source):
    state = to_diffsynth_state_dict(recam_source)
    state.pop("blocks.1.cross_attn.norm_k.weight")
    state["blocks.0.self_attn.lora_down.weight"] = torch.zeros(4, 96)
    path = tmp_path / "bad.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    with pytest.raises(CheckpointMismatchError) as err:
        load_recammaster_checkpoint(path, config=tiny_config())
    assert err.value.missing == ["blocks.1.attn2.norm_k.weight"]
    assert err.value.unexpected == ["blocks.0.self_attn.lora_down.weight"]
    assert "blocks.1.attn2.norm_k.weight" in str(err.value) and "lora_down" in str(err.value)


def test_plain_diffsynth_wan_needs_opt_in_for_camera_init(tmp_path, recam_source):
    state = {k: v.contiguous() for k, v in to_diffsynth_state_dict(recam_source).items()
             if ".cam_encoder." not in k and ".projector." not in k}
    path = tmp_path / "wan.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointMismatchError, match="must contain every block's cam_encoder"):
        load_recammaster_checkpoint(path, config=tiny_config())
    model, report = load_recammaster_checkpoint(path, config=tiny_config(), require_camera=False)
    assert len(report.initialised) == 1 + 4 * tiny_config()["num_layers"]
    assert torch.equal(model.blocks[1].projector.weight, torch.eye(96))


# ------------------------------------------------------------------------------------------------ sizes, VAE


def test_parameter_breakdown_counts_exactly():
    counts = parameter_breakdown(tiny_config(), lora_rank=4)
    model = ReCamTransformer3DModel(**tiny_config())
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    d, layers = 96, tiny_config()["num_layers"]
    assert counts["camera"] == layers * (12 * d + d + d * d + d)
    assert counts["lora"] == layers * 4 * 4 * (d + d)
    assert counts["wan"] == sum(p.numel() for p in WanTransformer3DModel(
        **{k: tiny_config()[k] for k in WAN_KEYS}).parameters())


def test_real_size_counts_are_the_ones_in_the_docs():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "real_scale.md").read_text()
    for preset in ("1.3b", "14b"):
        counts = parameter_breakdown(loading.wan_preset_config(preset), lora_rank=64)
        for key in ("wan", "camera", "total", "lora"):
            assert f"{counts[key]:,}" in doc, (preset, key, counts[key])


@pytest.fixture(scope="module")
def tiny_vae_dir(tmp_path_factory):
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                           latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0])
    folder = tmp_path_factory.mktemp("vae")
    vae.save_pretrained(folder)
    return folder


def test_wan_vae_reload_encode_decode(tiny_vae_dir):
    vae = load_wan_vae(tiny_vae_dir)
    assert isinstance(vae, AutoencoderKLWan) and not vae.training
    video = torch.rand(2, 3, 5, 16, 24, generator=torch.Generator().manual_seed(0)) * 2 - 1

    latents = encode_video(vae, video)
    assert latents.shape == (2, 4, 2, 2, 3)
    with torch.no_grad():
        raw = vae.encode(video).latent_dist.mode()
    mean = torch.tensor([0.1, -0.2, 0.3, 0.0]).view(1, 4, 1, 1, 1)
    std = torch.tensor([1.5, 0.5, 2.0, 1.0]).view(1, 4, 1, 1, 1)
    assert torch.allclose(latents, (raw - mean) / std, atol=1e-6)

    decoded = decode_latents(vae, latents)
    assert decoded.shape == video.shape
    assert decoded.min() >= -1 and decoded.max() <= 1
    with torch.no_grad():
        assert torch.allclose(decoded, vae.decode(raw).sample.clamp(-1, 1), atol=1e-5)

    sampled = encode_video(vae, video, sample=True, generator=torch.Generator().manual_seed(1))
    assert sampled.shape == latents.shape and not torch.equal(sampled, latents)


def test_wan_vae_rejects_bad_shapes(tiny_vae_dir):
    vae = load_wan_vae(tiny_vae_dir)
    with pytest.raises(ValueError, match="F = 1 \\+ 4k"):
        encode_video(vae, torch.zeros(1, 3, 4, 16, 16))
    with pytest.raises(ValueError, match="latents must be"):
        decode_latents(vae, torch.zeros(1, 16, 2, 2, 2))


def test_half_precision_load_keeps_diffusers_fp32_modules(tmp_path, wan_source):
    wan_source.save_pretrained(tmp_path)
    model, _ = load_wan_transformer(tmp_path, dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16
    assert dtypes["blocks.0.cam_encoder.weight"] == torch.bfloat16
    for name in ("blocks.0.scale_shift_table", "blocks.1.norm2.weight", "scale_shift_table",
                 "condition_embedder.time_embedder.linear_1.weight"):
        assert dtypes[name] == torch.float32, name
    ref = _reference_from_wan(wan_source)
    inputs = _inputs(tiny_config(), seed=9)
    half = {k: (v if k == "sigma" else v.to(torch.bfloat16)) for k, v in inputs.items()}
    with torch.no_grad():
        out, expected = model(**half), ref(**inputs)
    assert out.dtype == torch.bfloat16
    assert (out.float() - expected).abs().mean() < 0.05 * expected.abs().mean()
