"""Real data and latent space: ReCamMaster-layout folders as a dataset, the Wan VAE codec, and a trainer run on both.

The data is the synthetic world exported with recam.domains.camera.recammaster_io.export_world, so every loaded
condition can be
checked against the world's own cameras and renders.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel

from config import grpo
from config.validate import ConfigError, validate, validate_files
from recam.domains.camera.codec import PixelCodec, WanVAECodec, encode_once
from recam.domains.camera.data import ReCamMasterDataset
from recam.domains.camera.loading import to_diffsynth_state_dict
from recam.domains.camera.model import ReCamTransformer3DModel
from recam.domains.camera.recammaster_io import export_world
from recam.domains.camera.world import SyntheticWorld, collate_conditions

ROOT = Path(__file__).resolve().parents[1]
FRAMES, SIZE, PER_SCENE, SCENES = 5, 32, 2, 3  # 5 = 1 + 4 frames: one Wan VAE step in time
Z_DIM = 4


@pytest.fixture(scope="module")
def world():
    return SyntheticWorld("train", SCENES * PER_SCENE, 0, FRAMES, SIZE, PER_SCENE)


@pytest.fixture(scope="module")
def data_dir(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("recammaster")
    export_world(world, out, SCENES)  # scene k: cam01 = item 2k's source, cam02/cam03 = items 2k, 2k+1's targets
    return out


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny Wan VAE (z_dim 4) and a tiny Wan-layout transformer taking its latents, saved in diffusers layout."""
    out = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                     latents_mean=[0.0] * Z_DIM, latents_std=[1.0] * Z_DIM).save_pretrained(out / "vae")
    WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=Z_DIM,
                          out_channels=Z_DIM, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
                          rope_max_seq_len=32).save_pretrained(out / "wan")
    return out


def dataset(root, split="train", **kw):
    kw = {"num_frames": FRAMES, "height": SIZE, "width": SIZE, "num_heldout_scenes": 1, **kw}
    return ReCamMasterDataset(root, split, **kw)


def world_items(world, scene_dir: Path, cam: str):
    """World items behind an exported (scene folder, target camera): the one filmed by `cam`, and the scene's first."""
    k = int(scene_dir.name.removeprefix("scene"))
    return world[k * PER_SCENE + int(cam.removeprefix("cam")) - 2], world[k * PER_SCENE]


# ------------------------------------------------------------------------------------------------------ dataset


def test_conditions_match_the_synthetic_world(world, data_dir):
    for split in ("train", "heldout"):
        ds = dataset(data_dir, split, source_cams=("cam01",))
        assert len(ds) == (SCENES - 1 if split == "train" else 1) * PER_SCENE
        for i in range(len(ds)):
            scene, src, tgt = ds.locate(i)
            c = ds[i]
            item, first = world_items(world, scene, tgt)
            assert src == "cam01" and c.split == split and c.condition_id == ds.condition_id(i)
            torch.testing.assert_close(c.source_cams, first.source_cams, atol=1e-5, rtol=0)
            torch.testing.assert_close(c.target_cams, item.target_cams, atol=1e-5, rtol=0)
            torch.testing.assert_close(c.source_cams[0], torch.eye(3, 4), atol=1e-6, rtol=0)
            assert c.target_video.shape == item.target_video.shape == (3, FRAMES, SIZE, SIZE)
            # mp4 (yuv420p) compression: close on average, not exact
            assert (c.target_video - item.target_video).abs().mean() < 0.06
            assert (c.source_video - first.source_video).abs().mean() < 0.06
            assert c.caption == item.caption
            assert c.landmarks.shape == c.landmark_colors.shape == (0, 3)  # real data: no landmarks
            assert c.intrinsics.shape == (3, 3)
    collate_conditions([ds[0], ds[0]])  # one Condition type: collates like the world's


def test_every_camera_pair_once_split_by_scene_with_stable_ids(data_dir, tmp_path):
    train, heldout = dataset(data_dir, "train"), dataset(data_dir, "heldout")
    cams = PER_SCENE + 1
    assert (len(train), len(heldout)) == ((SCENES - 1) * cams * (cams - 1), cams * (cams - 1))  # ordered pairs
    ids = [train.condition_id(i) for i in range(len(train))]
    held = [heldout.condition_id(i) for i in range(len(heldout))]
    assert len(set(ids)) == len(ids) and len(set(held)) == len(held)
    assert all(i.startswith("train/") for i in ids) and all(i.startswith("heldout/") for i in held)
    scene_of = lambda cid: cid.split("/")[1]
    assert not {scene_of(i) for i in ids} & {scene_of(i) for i in held}  # split by scene
    assert ids == [dataset(data_dir, "train").condition_id(i) for i in range(len(train))]  # rebuilt: same ids
    assert [train[i].condition_id for i in range(3)] == ids[:3]

    # Ids name (scene, cameras), not positions: dropping a training scene keeps every other id as it was.
    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    shutil.rmtree(copy / scene_of(ids[0]))
    fewer = dataset(copy, "train")
    assert {fewer.condition_id(i) for i in range(len(fewer))} == {i for i in ids if scene_of(i) != scene_of(ids[0])}

    # A cap keeps an evenly strided subset with unchanged ids.
    capped = dataset(data_dir, "train", max_conditions=4)
    assert [capped.condition_id(i) for i in range(4)] == ids[::3][:4]


def test_cameras_are_relative_to_the_source_cameras_first_frame(world, data_dir):
    ds = dataset(data_dir, "train")
    i = next(i for i in range(len(ds)) if ds.locate(i)[1:] == ("cam02", "cam01"))
    scene, _, _ = ds.locate(i)
    item, first = world_items(world, scene, "cam02")
    c = ds[i]

    def to4(m):
        out = torch.eye(4, dtype=torch.float64).repeat(m.shape[0], 1, 1)
        out[:, :3] = m.double()
        return out

    ref_c2w = torch.linalg.inv(to4(item.target_cams[:1]))[0]  # cam02's first frame, in the world frame
    torch.testing.assert_close(c.source_cams.double(), (to4(item.target_cams) @ ref_c2w)[:, :3], atol=1e-5, rtol=0)
    torch.testing.assert_close(c.target_cams.double(), (to4(first.source_cams) @ ref_c2w)[:, :3], atol=1e-5, rtol=0)
    torch.testing.assert_close(c.source_cams[0], torch.eye(3, 4), atol=1e-6, rtol=0)


def test_frame_interval_and_resize_follow_video_io(data_dir):
    ds = dataset(data_dir, "train", num_frames=3, frame_interval=2, height=16, width=24, source_cams=("cam01",))
    c = ds[0]
    assert c.source_video.shape == (3, 3, 16, 24) and c.source_cams.shape == (3, 3, 4)
    full = dataset(data_dir, "train", source_cams=("cam01",))[0]
    torch.testing.assert_close(c.target_cams, full.target_cams[[0, 2, 4]], atol=1e-6, rtol=0)


def test_bad_files_and_folders_are_named(data_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        dataset(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=re.escape(f"no ReCamMaster scenes under {tmp_path / 'empty'}")):
        dataset(tmp_path / "empty")

    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    ds = dataset(copy, "train")
    scene = ds.locate(0)[0]
    extrinsics = scene / "cameras" / "camera_extrinsics.json"
    extrinsics.write_text('{"frame0": {"cam01": "[1 0 0 0] [0 1 0')  # truncated
    with pytest.raises(ValueError, match=re.escape(str(extrinsics))):
        ds[0]
    other = next(i for i in range(len(ds)) if ds.locate(i)[0] != scene)
    video = ds.locate(other)[0] / "videos" / f"{ds.locate(other)[1]}.mp4"
    video.write_bytes(b"not an mp4 at all")
    with pytest.raises(ValueError, match=re.escape(str(video))):
        ds[other]
    extrinsics.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(extrinsics))):
        dataset(copy, "train")


def test_too_few_extrinsic_frames_are_named(data_dir):
    ds = dataset(data_dir, "train", num_frames=FRAMES, frame_interval=2)  # needs frames 0..8 of a 5-frame scene
    with pytest.raises(ValueError, match="camera_extrinsics.json: 5 frames, but frame 8 is needed"):
        ds[0]


# -------------------------------------------------------------------------------------------------------- codec


def test_wan_vae_codec_round_trips_shapes(tiny_models):
    codec = WanVAECodec.from_pretrained(tiny_models / "vae")
    assert (codec.latent_channels, codec.temporal_factor, codec.spatial_factor) == (Z_DIM, 4, 8)
    video = torch.rand(2, 3, 9, 16, 24, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = codec.encode(video)
    assert latents.shape == codec.latent_shape(video.shape) == (2, Z_DIM, 3, 2, 3)
    assert codec.latent_shape((3, 9, 16, 24)) == (Z_DIM, 3, 2, 3)
    decoded = codec.decode(latents)
    assert decoded.shape == video.shape and decoded.dtype == torch.float32
    assert decoded.min() >= -1 and decoded.max() <= 1
    cams = torch.arange(2 * 9 * 12, dtype=torch.float32).view(2, 9, 3, 4)
    assert torch.equal(codec.latent_cams(cams), cams[:, [0, 4, 8]])  # the camera of each latent frame's first frame
    with pytest.raises(ValueError, match="F = 1 \\+ 4k"):
        codec.latent_shape((3, 8, 16, 16))

    pixel = PixelCodec()
    assert pixel.encode(video) is video and pixel.decode(video) is video and pixel.latent_cams(cams) is cams
    assert pixel.latent_shape((3, 8, 32, 32)) == (3, 8, 32, 32)


# ------------------------------------------------------------------------------------------------------- config


def real_config(data_dir, models, **fields):
    c = grpo.get_config("smoke")
    c.data.source, c.data.root = "recammaster", str(data_dir)
    c.data.num_frames, c.data.height, c.data.width = FRAMES, SIZE, SIZE
    c.model.format, c.model.pretrained, c.model.vae = "wan_diffusers", str(models / "wan"), str(models / "vae")
    c.reward.weights.cam_score = 0.0
    c.reward.constraint = ""  # fidelity is the only weighted reward left
    c.eval.report_rewards = "fidelity"
    for key, value in fields.items():
        section, name = key.split("__")
        c[section][name] = value
    return c


def test_file_checks_name_the_field_and_both_channel_counts(data_dir, tiny_models, tmp_path):
    c = real_config(data_dir, tiny_models)
    validate(c, 1)
    validate_files(c)
    with pytest.raises(ConfigError, match="data.root='/nonexistent'"):
        validate_files(real_config("/nonexistent", tiny_models))
    with pytest.raises(ConfigError, match="in_channels=4 but pixel space"):
        validate_files(real_config(data_dir, tiny_models, model__vae=""))
    with pytest.raises(ConfigError, match="data.num_frames=8 must be 1 \\+ 4k"):
        validate_files(real_config(data_dir, tiny_models, data__num_frames=8))
    landmarks = real_config(data_dir, tiny_models)
    landmarks.reward.weights.cam_score = 1.0  # landmark PnP needs the synthetic world's landmarks
    with pytest.raises(ConfigError, match="reward.cam.estimator"):
        validate(landmarks, 1)

    # A DiffSynth-layout file: in_channels read from its patch embedding without loading the weights.
    torch.save(to_diffsynth_state_dict(ReCamTransformer3DModel()), tmp_path / "step.ckpt")  # tiny: 3 channels
    diffsynth = real_config(data_dir, tiny_models, model__format="recammaster_diffsynth",
                            model__pretrained=str(tmp_path / "step.ckpt"))
    with pytest.raises(ConfigError, match=f"in_channels=3 but the latents of model.vae=.* has {Z_DIM} channels"):
        validate_files(diffsynth)


# ----------------------------------------------------------------------------------------------------- training


def test_trainer_runs_on_recammaster_folders_in_latent_space(data_dir, tiny_models, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "scripts" / "train_recam.py"), "--config", "config/grpo.py:smoke",
           "--config.logging.wandb_mode=disabled", "--config.num_threads=1", f"--config.run_dir={run_dir}",
           "--config.num_epochs=1", "--config.data.source=recammaster", f"--config.data.root={data_dir}",
           f"--config.data.num_frames={FRAMES}", f"--config.data.height={SIZE}", f"--config.data.width={SIZE}",
           "--config.data.num_train_conditions=0", "--config.data.num_heldout_conditions=0",
           "--config.model.format=wan_diffusers", f"--config.model.pretrained={tiny_models / 'wan'}",
           f"--config.model.vae={tiny_models / 'vae'}", "--config.model.lora_rank=4", "--config.model.lora_alpha=8",
           "--config.model.dtype=bfloat16", "--config.mixed_precision=bf16",
           "--config.model.gradient_checkpointing=True",
           "--config.reward.weights.cam_score=0", "--config.reward.weights.fidelity=1",
           "--config.eval.report_rewards=fidelity", "--config.reward.constraint="]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["type"] == "epoch"]
    assert len(epochs) == 1
    e = epochs[0]
    assert (e["samples_per_epoch"], e["unique_conditions_per_epoch"]) == (8, 2)
    assert len(e["dataset_indices"]) == 8 and sorted(np.unique(e["dataset_indices"], return_counts=True)[1]) == [4, 4]
    assert all(cid.startswith("train/scene") for cid in e["condition_ids"])
    assert np.isfinite(e["rewards/fidelity"]).all() and "rewards/cam_score" not in e
    assert [r["step"] for r in records if r["type"] == "step"] == [1]
    evals = {r["tag"]: r for r in records if r["type"] == "eval"}
    assert evals["final"]["eval/num_conditions"] == 6  # the held-out scene: 3 cameras, 6 ordered pairs
    latest = (run_dir / "checkpoints" / "latest").read_text()
    assert (run_dir / "checkpoints" / latest / "model" / "adapter_model.safetensors").exists()
    assert list((run_dir / "videos" / "final").glob("heldout_scene*.gif"))


def test_encode_once_encodes_each_source_once_and_matches_a_plain_encode():
    class CountingCodec:  # stands in for the VAE: an invertible-enough map that records what it was given
        def __init__(self):
            self.rows = 0

        def encode(self, video):
            self.rows += video.shape[0]
            return video.flatten(1).sum(1, keepdim=True) * 2.0 + 1.0

    videos = torch.randn(3, 3, 5, 8, 8, generator=torch.Generator().manual_seed(0))
    keys = ["a", "b", "c"]
    # a sampling batch of k = 2 copies per condition, then a training micro-batch in another order
    batch1, ids1 = videos[[0, 0, 1, 1]], ["a", "a", "b", "b"]
    batch2, ids2 = videos[[2, 1, 2, 0]], ["c", "b", "c", "a"]
    codec, cache = CountingCodec(), {}
    out1 = encode_once(codec, batch1, ids1, cache)
    out2 = encode_once(codec, batch2, ids2, cache)
    assert codec.rows == len(keys)  # each distinct source once, over both calls
    plain = CountingCodec()
    torch.testing.assert_close(out1, plain.encode(batch1))
    torch.testing.assert_close(out2, plain.encode(batch2))
