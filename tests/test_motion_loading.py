"""MDM checkpoints and HumanML3D folders, written at tiny sizes in their real on-disk formats."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from recam.domains.motion.humanml3d import (
    HumanML3DDataset,
    collate_motion,
    crop_length,
    mirror_twin,
    parse_text_line,
)
from recam.domains.motion.loading import (
    CheckpointFormatError,
    MDMCheckpointMismatchError,
    load_mdm_checkpoint,
    read_mdm_checkpoint,
    to_mdm_state_dict,
)
from recam.domains.motion.model import MotionDiffusionModel

# tiny tensors on a shared two-core machine: every test on one torch thread (conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------------------
# MDM checkpoints
# ---------------------------------------------------------------------------------------------------------

LATENT, LAYERS, FF, TEXT, FEATS = 32, 2, 48, 24, 263


def _mdm_pe(length: int, dim: int) -> torch.Tensor:
    """MDM's ``pe`` buffer, [length, 1, dim], written out independently of the code under test."""
    pos = np.arange(length)[:, None]
    inv = 1.0 / 10000 ** (np.arange(0, dim, 2) / dim)
    table = np.zeros((length, dim))
    table[:, 0::2] = np.sin(pos * inv)
    table[:, 1::2] = np.cos(pos * inv)
    return torch.from_numpy(table).float()[:, None, :]


def mdm_state_dict(seed: int = 0, latent: int = LATENT, layers: int = LAYERS, ff: int = FF, text: int = TEXT,
                   feats: int = FEATS, clip: bool = True, pe_len: int = 1200) -> OrderedDict:
    """A state dict with MDM's key names (trans_enc, text-conditioned), random weights."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    sd = OrderedDict()
    sd["sequence_pos_encoder.pe"] = _mdm_pe(pe_len, latent)
    sd["embed_timestep.sequence_pos_encoder.pe"] = _mdm_pe(pe_len, latent)
    sd["embed_timestep.time_embed.0.weight"] = rnd(latent, latent)
    sd["embed_timestep.time_embed.0.bias"] = rnd(latent)
    sd["embed_timestep.time_embed.2.weight"] = rnd(latent, latent)
    sd["embed_timestep.time_embed.2.bias"] = rnd(latent)
    sd["input_process.poseEmbedding.weight"] = rnd(latent, feats)
    sd["input_process.poseEmbedding.bias"] = rnd(latent)
    for i in range(layers):
        p = f"seqTransEncoder.layers.{i}."
        sd[p + "self_attn.in_proj_weight"] = rnd(3 * latent, latent)
        sd[p + "self_attn.in_proj_bias"] = rnd(3 * latent)
        sd[p + "self_attn.out_proj.weight"] = rnd(latent, latent)
        sd[p + "self_attn.out_proj.bias"] = rnd(latent)
        sd[p + "linear1.weight"] = rnd(ff, latent)
        sd[p + "linear1.bias"] = rnd(ff)
        sd[p + "linear2.weight"] = rnd(latent, ff)
        sd[p + "linear2.bias"] = rnd(latent)
        for norm in ("norm1", "norm2"):
            sd[p + norm + ".weight"] = 1 + rnd(latent)
            sd[p + norm + ".bias"] = rnd(latent)
    sd["embed_text.weight"] = rnd(latent, text)
    sd["embed_text.bias"] = rnd(latent)
    sd["output_process.poseFinal.weight"] = rnd(feats, latent)
    sd["output_process.poseFinal.bias"] = rnd(feats)
    if clip:
        sd["clip_model.positional_embedding"] = rnd(77, text)
        sd["clip_model.token_embedding.weight"] = rnd(50, text)
        sd["clip_model.text_projection"] = rnd(text, text)
    return sd


# An args.json as MDM's train script writes it (a subset of its fields): no heads/ff_size/dropout, which MDM
# hard-codes to 4 / 1024 / 0.1.
MDM_ARGS = {
    "arch": "trans_enc", "batch_size": 64, "cond_mask_prob": 0.1, "cuda": True, "data_dir": "",
    "dataset": "humanml", "device": 0, "diffusion_steps": 1000, "emb_trans_dec": False, "eval_batch_size": 32,
    "lambda_fc": 0.0, "lambda_rcxyz": 0.0, "lambda_vel": 0.0, "latent_dim": LATENT, "layers": LAYERS,
    "lr": 0.0001, "noise_schedule": "cosine", "num_steps": 600000, "save_dir": "save/my_humanml_trans_enc_512",
    "seed": 10, "sigma_small": True, "unconstrained": False, "weight_decay": 0.0,
}


def write_release(folder: Path, state: dict, args: dict | None = None, name: str = "model000475000.pt") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / name)
    (folder / "args.json").write_text(json.dumps(MDM_ARGS if args is None else args, indent=4))
    return folder / name


def mdm_reference_forward(sd: dict, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, heads: int = 4):
    """MDM's trans_enc forward written from its description, sequence-first like MDM, on a raw state dict."""
    latent = sd["input_process.poseEmbedding.weight"].shape[0]
    pe = sd["sequence_pos_encoder.pe"]
    lin = lambda h, name: h @ sd[name + ".weight"].T + sd[name + ".bias"]
    emb = lin(torch.nn.functional.silu(lin(pe[t][:, 0], "embed_timestep.time_embed.0")), "embed_timestep.time_embed.2")
    emb = emb + lin(text, "embed_text")
    bs, njoints, nfeats, nframes = x.shape
    frames = lin(x.permute(3, 0, 1, 2).reshape(nframes, bs, njoints * nfeats), "input_process.poseEmbedding")
    seq = torch.cat([emb[None], frames], dim=0)
    seq = seq + pe[: seq.shape[0]]
    layer = nn.TransformerEncoderLayer(latent, heads, sd["seqTransEncoder.layers.0.linear1.weight"].shape[0],
                                       dropout=0.0, activation="gelu")
    encoder = nn.TransformerEncoder(layer, num_layers=1 + max(int(k.split(".")[2]) for k in sd
                                                              if k.startswith("seqTransEncoder.")),
                                    enable_nested_tensor=False).eval()
    encoder.load_state_dict({k[len("seqTransEncoder."):]: v for k, v in sd.items() if k.startswith("seqTransEncoder.")})
    out = lin(encoder(seq)[1:], "output_process.poseFinal")
    return out.reshape(nframes, bs, njoints, nfeats).permute(1, 2, 3, 0)


def _inputs(seed: int = 0, batch: int = 2, frames: int = 12):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, FEATS, 1, frames, generator=g), torch.randint(0, 1000, (batch,), generator=g),
            torch.randn(batch, TEXT, generator=g))


def test_plain_checkpoint_loads_everything_and_reproduces_mdm(tmp_path):
    sd = mdm_state_dict()
    path = write_release(tmp_path / "humanml_trans_enc_512", sd)
    model, report = load_mdm_checkpoint(path)

    assert report.variant == "plain" and report.args_source == str(path.parent / "args.json")
    assert report.stripped == ["clip_model.positional_embedding", "clip_model.text_projection",
                               "clip_model.token_embedding.weight"]
    assert report.derived == ["sequence_pos_encoder.pe", "embed_timestep.sequence_pos_encoder.pe"]
    assert report.num_loaded == len(sd) - 3 - 2 == len(model.state_dict())
    assert report.config["latent_dim"] == LATENT and report.config["num_layers"] == LAYERS
    assert report.config["ff_size"] == FF and report.config["text_dim"] == TEXT
    assert report.config["num_heads"] == 4 and report.config_origin["num_heads"] == "default"
    assert report.config_origin["latent_dim"] == "args.json" and report.config_origin["ff_size"] == "shapes"
    assert report.args["noise_schedule"] == "cosine" and report.trained_with_frame_mask is False
    assert "stripped 3 clip_model keys" in report.summary()
    assert not model.training
    for key, value in model.state_dict().items():
        assert torch.equal(value, sd[key]), key

    x, t, text = _inputs()
    with torch.no_grad():
        ours = model(x, t, text)
        reference = mdm_reference_forward(sd, x, t, text)
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-4)


def test_same_weights_in_a_fresh_model_give_the_same_outputs(tmp_path):
    path = write_release(tmp_path / "a", mdm_state_dict(seed=3))
    model, report = load_mdm_checkpoint(path)
    fresh = MotionDiffusionModel(**report.config).eval()
    fresh.load_state_dict(model.state_dict())
    x, t, text = _inputs(seed=1)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x, t, text), model(x, t, text), atol=0, rtol=0)

    # Exported back to MDM's layout and reloaded: the same model again.
    again_path = write_release(tmp_path / "b", to_mdm_state_dict(model))
    again, again_report = load_mdm_checkpoint(again_path)
    assert again_report.stripped == [] and len(again_report.derived) == 2
    with torch.no_grad():
        torch.testing.assert_close(again(x, t, text), model(x, t, text), atol=0, rtol=0)


def test_ema_checkpoint_uses_the_averaged_weights(tmp_path):
    raw, avg = mdm_state_dict(seed=1), mdm_state_dict(seed=2)
    ckpt = {"model": raw, "model_avg": avg, "opt": {"state": {}, "param_groups": [{"lr": 1e-4}]}, "step": 475000}
    path = write_release(tmp_path / "ema", ckpt)
    key = "seqTransEncoder.layers.1.linear1.weight"

    model, report = load_mdm_checkpoint(path)
    assert report.variant == "model_avg" and report.ignored_entries == ["model", "opt", "step"]
    assert torch.equal(model.state_dict()[key], avg[key])
    model_raw, report_raw = load_mdm_checkpoint(path, use_ema=False)
    assert report_raw.variant == "model" and torch.equal(model_raw.state_dict()[key], raw[key])

    # DataParallel's prefix and a {"state_dict": ...} wrapper are undone.
    wrapped = {"state_dict": {"module." + k: v for k, v in raw.items()}}
    model_w, report_w = load_mdm_checkpoint(write_release(tmp_path / "wrapped", wrapped))
    assert report_w.variant == "plain" and torch.equal(model_w.state_dict()[key], raw[key])


def test_args_define_the_size_and_unsupported_args_are_refused(tmp_path):
    sd = mdm_state_dict(latent=48)
    args = dict(MDM_ARGS, latent_dim=48, heads=8)
    model, report = load_mdm_checkpoint(write_release(tmp_path / "a", sd, args))
    assert report.config["num_heads"] == 8 and report.config_origin["num_heads"] == "args.json"
    assert model.seqTransEncoder.layers[0].self_attn.num_heads == 8

    # args given as a dict instead of a file.
    _, report = load_mdm_checkpoint(tmp_path / "a" / "model000475000.pt", args_json={"latent_dim": 48})
    assert report.args_source == "<mapping>" and report.config["num_heads"] == 4

    for bad, match in [({"arch": "trans_dec"}, "trans_dec"), ({"unconstrained": True}, "unconstrained"),
                       ({"dataset": "humanact12"}, "humanact12")]:
        with pytest.raises(ValueError, match=match):
            load_mdm_checkpoint(tmp_path / "a" / "model000475000.pt", args_json=dict(MDM_ARGS, **bad))


def test_args_json_missing_or_broken(tmp_path):
    path = write_release(tmp_path / "r", mdm_state_dict())
    (tmp_path / "r" / "args.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"args\.json"):
        load_mdm_checkpoint(path)
    (tmp_path / "r" / "args.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON") as err:
        load_mdm_checkpoint(path)
    assert str(tmp_path / "r" / "args.json") in str(err.value)


def test_corrupt_and_foreign_files_name_the_file(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "args.json").write_text(json.dumps(MDM_ARGS))

    junk = folder / "junk.pt"
    junk.write_bytes(b"this is not a checkpoint\x00\x01" * 10)
    with pytest.raises(CheckpointFormatError, match="not a torch checkpoint") as err:
        load_mdm_checkpoint(junk)
    assert str(junk) in str(err.value)

    truncated = folder / "truncated.pt"
    torch.save(mdm_state_dict(), truncated)
    truncated.write_bytes(truncated.read_bytes()[:3000])
    with pytest.raises(CheckpointFormatError, match="truncated.pt"):
        load_mdm_checkpoint(truncated)

    not_dict = folder / "list.pt"
    torch.save([torch.zeros(2)], not_dict)
    with pytest.raises(CheckpointFormatError, match="list.pt holds a list"):
        load_mdm_checkpoint(not_dict)

    mixed = folder / "mixed.pt"
    torch.save({"embed_text.weight": torch.zeros(2), "epoch": 3}, mixed)
    with pytest.raises(CheckpointFormatError, match=r"not tensors: epoch \(int\)"):
        read_mdm_checkpoint(mixed)

    # Pickled Python objects are refused, always; the message says how to take the tensors out. Saved on their
    # own, the same weights load.
    pickled = folder / "pickled.pt"
    torch.save({"model": mdm_state_dict(), "args": logging.Formatter()}, pickled)
    with pytest.raises(CheckpointFormatError, match="never unpickles") as err:
        load_mdm_checkpoint(pickled)
    assert str(pickled) in str(err.value)
    with pytest.raises(TypeError):
        load_mdm_checkpoint(pickled, allow_pickle=True)  # no way around it
    tensors = folder / "tensors.pt"
    torch.save({"model": mdm_state_dict()}, tensors)
    model, report = load_mdm_checkpoint(tensors)
    assert report.variant == "model" and report.ignored_entries == []

    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_mdm_checkpoint(folder / "absent.pt")


def test_key_mismatches_name_the_file_and_the_keys(tmp_path):
    sd = mdm_state_dict()
    sd["seqTransEncoder.layers.1.linear1.weight"] = torch.zeros(FF, LATENT + 1)
    path = write_release(tmp_path / "shape", sd)
    with pytest.raises(MDMCheckpointMismatchError) as err:
        load_mdm_checkpoint(path)
    message = str(err.value)
    assert str(path) in message and "nothing was loaded" in message
    assert f"seqTransEncoder.layers.1.linear1.weight: checkpoint ({FF}, {LATENT + 1}) vs model ({FF}, {LATENT})" \
        in message
    assert err.value.shape_mismatch and not err.value.missing and not err.value.unexpected

    sd = mdm_state_dict()
    del sd["embed_text.bias"]
    sd["embed_action.action_embedding"] = torch.zeros(12, LATENT)
    with pytest.raises(MDMCheckpointMismatchError) as err:
        load_mdm_checkpoint(write_release(tmp_path / "keys", sd))
    assert err.value.missing == ["embed_text.bias"]
    assert err.value.unexpected == ["embed_action.action_embedding"]

    # args.json saying a different width than the weights: every affected key is listed.
    with pytest.raises(MDMCheckpointMismatchError, match="input_process.poseEmbedding.weight"):
        load_mdm_checkpoint(write_release(tmp_path / "args", mdm_state_dict(), dict(MDM_ARGS, latent_dim=64)))

    # A sinusoid table that is not MDM's means a different model.
    sd = mdm_state_dict()
    sd["sequence_pos_encoder.pe"] = sd["sequence_pos_encoder.pe"] * 2
    with pytest.raises(MDMCheckpointMismatchError, match="sequence_pos_encoder.pe: differs"):
        load_mdm_checkpoint(write_release(tmp_path / "pe", sd))

    # EMA checkpoints name the variant that failed.
    bad_avg = mdm_state_dict()
    del bad_avg["output_process.poseFinal.bias"]
    with pytest.raises(MDMCheckpointMismatchError, match=r"\(model_avg\)"):
        load_mdm_checkpoint(write_release(tmp_path / "ema", {"model": mdm_state_dict(), "model_avg": bad_avg}))


# ---------------------------------------------------------------------------------------------------------
# HumanML3D
# ---------------------------------------------------------------------------------------------------------

# id -> (frames, caption lines). Spans in seconds at 20 fps.
CLIPS = {
    "000001": (60, ["a man walks forward.#a/DET man/NOUN walk/VERB forward/ADV#0.0#0.0",
                    "someone strolls ahead#someone/PRON stroll/VERB ahead/ADV#0.0#0.0",
                    "a person takes a step#a/DET person/NOUN take/VERB a/DET step/NOUN#0.5#2.9"]),
    "M000001": (60, ["a man walks forward.#a/DET man/NOUN walk/VERB forward/ADV#0.0#0.0"]),
    "000002": (30, ["too short to keep#too/ADV short/ADJ#0.0#0.0"]),
    "000003": (121, ["a person jumps twice#a/DET person/NOUN jump/VERB twice/ADV#0.0#0.0",
                     "",
                     "a small hop#a/DET small/ADJ hop/NOUN#1.0#2.0",
                     "the person lands#the/DET person/NOUN land/VERB#nan#nan"]),
    "000004": (45, ["a person waves#a/DET person/NOUN wave/VERB#0.0#0.0"]),
    "M000004": (45, ["a person waves#a/DET person/NOUN wave/VERB#0.0#0.0"]),
    "000005": (250, ["a long dance#a/DET long/ADJ dance/NOUN#0.0#0.0",
                     "a short part of it#a/DET short/ADJ part/NOUN#1.0#4.0"]),
}
SPLITS = {"train": ["000001", "M000001", "000002", "000003"], "val": ["000004", "M000004"], "test": ["000005"]}


def _raw(motion_id: str) -> np.ndarray:
    frames = CLIPS[motion_id][0]
    rng = np.random.default_rng(int(motion_id.lstrip("M")) + (100 if motion_id.startswith("M") else 0))
    return (rng.normal(size=(frames, FEATS)) * 2 + 1).astype(np.float32)


@pytest.fixture
def hml_root(tmp_path) -> Path:
    root = tmp_path / "HumanML3D"
    (root / "new_joint_vecs").mkdir(parents=True)
    (root / "texts").mkdir()
    for motion_id, (_, lines) in CLIPS.items():
        np.save(root / "new_joint_vecs" / f"{motion_id}.npy", _raw(motion_id))
        (root / "texts" / f"{motion_id}.txt").write_text("\n".join(lines) + "\n")
    rng = np.random.default_rng(7)
    np.save(root / "Mean.npy", rng.normal(size=FEATS).astype(np.float32))
    np.save(root / "Std.npy", rng.uniform(0.5, 1.5, size=FEATS).astype(np.float32))
    for name, ids in SPLITS.items():
        (root / f"{name}.txt").write_text("\n".join(ids) + "\n")
    (root / "all.txt").write_text("\n".join(i for ids in SPLITS.values() for i in ids) + "\n")
    return root


def test_train_split_items_and_drops(hml_root, caplog):
    with caplog.at_level(logging.INFO, logger="recam.domains.motion.humanml3d"):
        ds = HumanML3DDataset(hml_root, "train")
    assert "dropped 1 clips and 1 sub-clip captions with lengths outside 40..199" in caplog.text
    assert ds.stats.dropped_clips == [("000002", 30)]
    assert ds.stats.dropped_spans == [("000003", 3, 20)]  # line 3: 1.0 s..2.0 s = 20 frames
    assert ds.stats.ids_listed == 4 and ds.stats.ids_used == 3 and ds.stats.captions == len(ds) == 6
    assert ds.stats.mirror_leaks == []
    assert ds.condition_ids == ["000001:0-60:1", "000001:0-60:2", "000001:10-58:3", "M000001:0-60:1",
                                "000003:0-121:1", "000003:0-121:4"]

    mean, std = np.load(hml_root / "Mean.npy"), np.load(hml_root / "Std.npy")
    by_id = {ds[i].condition_id: ds[i] for i in range(len(ds))}

    whole = by_id["000001:0-60:2"]
    assert whole.caption == "someone strolls ahead" and whole.motion_id == "000001:0-60"
    assert whole.tokens == ("someone/PRON", "stroll/VERB", "ahead/ADV")
    assert whole.features.shape == (196, FEATS) and whole.features.dtype == torch.float32
    assert whole.length == 60 and whole.span == (0, 60)
    np.testing.assert_allclose(whole.features[:60].numpy() * std + mean, _raw("000001"), atol=1e-5)
    assert torch.all(whole.features[60:] == 0)

    # A sub-clip span is its own motion: frames int(0.5*20)..int(2.9*20) = 10..58.
    sub = by_id["000001:10-58:3"]
    assert sub.length == 48 and sub.span == (10, 58) and sub.motion_id == "000001:10-58"
    np.testing.assert_allclose(sub.features[:48].numpy() * std + mean, _raw("000001")[10:58], atol=1e-5)

    # 121 frames crop to 120 (multiple of 4); NaN spans read as the whole clip, as MDM does.
    jump = by_id["000003:0-121:1"]
    assert jump.length == 120
    np.testing.assert_allclose(jump.features[:120].numpy() * std + mean, _raw("000003")[:120], atol=1e-5)
    assert by_id["000003:0-121:4"].caption == "the person lands"

    assert by_id["M000001:0-60:1"].source_id == "M000001"
    # Items are reproducible: a condition's reference motion does not change between reads.
    assert torch.equal(ds[2].features, ds[2].features)


def test_val_and_test_splits_and_options(hml_root):
    val = HumanML3DDataset(hml_root, "val")
    assert [it.length for it in val] == [44, 44]  # 45 frames -> 44
    assert HumanML3DDataset(hml_root, "val", mirrored=False).condition_ids == ["000004:0-45:1"]

    # A 250-frame clip is dropped with its sub-clip caption, as in MDM.
    test = HumanML3DDataset(hml_root, "test")
    assert len(test) == 0 and test.stats.dropped_clips == [("000005", 250)]

    raw = HumanML3DDataset(hml_root, "val", mean_std="none")
    np.testing.assert_allclose(raw[0].features[:44].numpy(), _raw("000004")[:44])
    given = HumanML3DDataset(hml_root, "val", mean_std=(np.zeros(FEATS), 2 * np.ones(FEATS)))
    np.testing.assert_allclose(given[0].features[:44].numpy(), _raw("000004")[:44] / 2, rtol=1e-6)
    np.testing.assert_allclose(given.denormalise(given[0].features[:44]).numpy(), _raw("000004")[:44], rtol=1e-6)

    short = HumanML3DDataset(hml_root, "all", max_frames=40)
    assert {it.length for it in short} == {40} and short[0].features.shape == (40, FEATS)

    # MDM's random crop: multiples of 4, inside the span, reproducible from the seed.
    a = HumanML3DDataset(hml_root, "train", crop="mdm", seed=3)
    b = HumanML3DDataset(hml_root, "train", crop="mdm", seed=3)
    lengths = []
    for _ in range(10):
        item_a, item_b = a[4], b[4]
        assert torch.equal(item_a.features, item_b.features)
        assert item_a.length in (116, 120)
        lengths.append(item_a.length)
    assert set(lengths) == {116, 120}


def test_mirror_leak_is_reported(hml_root, caplog):
    (hml_root / "val.txt").write_text("000004\nM000001\n")
    (hml_root / "train.txt").write_text("000001\n000003\n")
    with caplog.at_level(logging.WARNING):
        ds = HumanML3DDataset(hml_root, "train")
    assert ds.stats.mirror_leaks == [("000001", "val")]
    assert "mirrored twin in another split" in caplog.text
    assert mirror_twin("M000001") == "000001" and mirror_twin("000001") == "M000001"


def test_collate_and_dataloader(hml_root):
    ds = HumanML3DDataset(hml_root, "train")
    loader = torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=collate_motion)
    batch = next(iter(loader))
    assert batch["features"].shape == (4, 196, FEATS)
    assert batch["lengths"].tolist() == [60, 60, 48, 60]
    assert batch["padding_mask"][2].sum() == 196 - 48 and not batch["padding_mask"][2, :48].any()
    assert batch["condition_ids"][2] == "000001:10-58:3" and batch["motion_ids"][0] == "000001:0-60"
    assert batch["captions"][0] == "a man walks forward."


def test_errors_name_the_file_and_the_problem(hml_root):
    with pytest.raises(FileNotFoundError, match="HumanML3D root"):
        HumanML3DDataset(hml_root / "nowhere")
    with pytest.raises(FileNotFoundError, match="split file .*nope.txt"):
        HumanML3DDataset(hml_root, hml_root / "nope.txt")

    text = hml_root / "texts" / "000003.txt"
    good_text = text.read_text()
    text.write_text("a person jumps#a/DET#0.0#0.0\na broken line#a/DET broken/ADJ#0.0\n")
    with pytest.raises(ValueError, match=r"000003\.txt:2: expected 'caption#"):
        HumanML3DDataset(hml_root, "train")
    text.write_text("a person jumps#a/DET#zero#0.0\n")
    with pytest.raises(ValueError, match=r"000003\.txt:1: start/end 'zero'"):
        HumanML3DDataset(hml_root, "train")
    text.write_text("a person jumps#a/DET#-1.0#3.0\n")
    with pytest.raises(ValueError, match=r"000003\.txt:1: negative span"):
        HumanML3DDataset(hml_root, "train")
    text.write_text("#a/DET#0.0#0.0\n")
    with pytest.raises(ValueError, match=r"000003\.txt:1: empty caption"):
        HumanML3DDataset(hml_root, "train")
    text.write_bytes(good_text.replace("twice", "twic\xe9").encode("latin-1"))
    assert HumanML3DDataset(hml_root, "train")[4].caption == "a person jumps twic\xe9"
    text.write_text(good_text)

    vec = hml_root / "new_joint_vecs" / "000003.npy"
    np.save(vec, np.zeros((80, 262), dtype=np.float32))
    with pytest.raises(ValueError, match=r"000003\.npy: expected shape \(T, 263\), got \(80, 262\)"):
        HumanML3DDataset(hml_root, "train")
    vec.write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"000003\.npy is not a readable \.npy file"):
        HumanML3DDataset(hml_root, "train")
    vec.unlink()
    with pytest.raises(FileNotFoundError, match=r"000003\.npy does not exist .*train\.txt"):
        HumanML3DDataset(hml_root, "train")
    np.save(vec, _raw("000003"))

    bad = _raw("000003")
    bad[7, 5] = np.nan
    np.save(vec, bad)
    ds = HumanML3DDataset(hml_root, "train")
    with pytest.raises(ValueError, match=r"000003\.npy: non-finite features \(first at frame 7\)"):
        ds[4]
    np.save(vec, _raw("000003"))

    np.save(hml_root / "Std.npy", np.zeros(FEATS, dtype=np.float32))
    with pytest.raises(ValueError, match=r"Std\.npy: Std has 263 non-positive"):
        HumanML3DDataset(hml_root, "train")
    np.save(hml_root / "Std.npy", np.ones(10, dtype=np.float32))
    with pytest.raises(ValueError, match=r"Std\.npy: Std must have shape \(263,\), got \(10,\)"):
        HumanML3DDataset(hml_root, "train")
    (hml_root / "Mean.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"Mean file .*Mean\.npy does not exist"):
        HumanML3DDataset(hml_root, "train")
    assert len(HumanML3DDataset(hml_root, "train", mean_std="none")) == 6


def test_line_parser_and_crop_length():
    path = Path("texts/x.txt")
    assert parse_text_line("a b#a/DET b/NOUN#1.5#3.0\n", path, 1) == ("a b", ("a/DET", "b/NOUN"), 1.5, 3.0)
    assert parse_text_line("a b##0.0#0.0", path, 1) == ("a b", (), 0.0, 0.0)
    assert [crop_length(n) for n in (40, 43, 44, 196, 199, 250)] == [40, 40, 44, 196, 196, 196]
