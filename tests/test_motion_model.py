"""MotionDiffusionModel (MDM layout) and the CLIP text encoder, at tiny sizes on CPU."""

from __future__ import annotations

import math
import string

import numpy as np
import pytest
import torch
import torch.nn as nn

from recam.domains.motion.model import (
    CallableTextEncoder,
    CLIPTextEncoder,
    MotionDiffusionModel,
    TextEncoder,
    count_parameters,
    from_mdm_layout,
    mdm_config,
    padding_mask_from_lengths,
    sinusoid,
    tiny_config,
    to_mdm_layout,
)

# tiny tensors on a shared two-core machine: every test on one torch thread (conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")

J = 263


def _small_config(**overrides) -> dict:
    cfg = tiny_config()
    cfg.update(latent_dim=32, num_layers=2, ff_size=64, text_dim=16, max_frames=48)
    cfg.update(overrides)
    return cfg


def _inputs(cfg: dict, batch: int = 3, frames: int = 24, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(batch, cfg["njoints"], 1, frames, generator=g),
        "timesteps": torch.randint(0, 1000, (batch,), generator=g),
        "text_emb": torch.randn(batch, cfg["text_dim"], generator=g),
    }


@pytest.fixture(scope="module")
def model() -> MotionDiffusionModel:
    torch.manual_seed(0)
    return MotionDiffusionModel(**_small_config()).eval()


# ---------------------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------------------


def test_mdm_size_matches_the_published_parameter_count():
    # REFERENCES: 17.9 M parameters without CLIP.
    n = count_parameters(mdm_config())
    assert round(n / 1e6, 1) == 17.9
    # By hand: input 263*512+512, time 2*(512^2+512), text 512^2+512,
    # 8 layers x (3*512^2+3*512 + 512^2+512 + 2*512*1024+1024+512 + 4*512), output 512*263+263.
    per_layer = 3 * 512 * 512 + 3 * 512 + 512 * 512 + 512 + 2 * 512 * 1024 + 1024 + 512 + 4 * 512
    by_hand = (263 * 512 + 512) + 2 * (512 * 512 + 512) + (512 * 512 + 512) + 8 * per_layer + (512 * 263 + 263)
    assert n == by_hand == 17_880_327


def test_mdm_layout_names_and_shapes():
    with torch.device("meta"):
        m = MotionDiffusionModel(**mdm_config())
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes["input_process.poseEmbedding.weight"] == (512, 263)
    assert shapes["seqTransEncoder.layers.7.self_attn.in_proj_weight"] == (1536, 512)
    assert shapes["seqTransEncoder.layers.0.linear1.weight"] == (1024, 512)
    assert shapes["seqTransEncoder.layers.0.linear2.weight"] == (512, 1024)
    assert shapes["embed_timestep.time_embed.0.weight"] == (512, 512)
    assert shapes["embed_timestep.time_embed.2.weight"] == (512, 512)
    assert shapes["embed_text.weight"] == (512, 512)
    assert shapes["output_process.poseFinal.weight"] == (263, 512)
    assert "seqTransEncoder.layers.8.linear1.weight" not in shapes
    # Post-LN, GELU: MDM's encoder layer.
    layer = m.seqTransEncoder.layers[0]
    assert layer.norm_first is False and layer.activation_relu_or_gelu == 2


def test_tiny_config_is_small():
    assert count_parameters(tiny_config()) == 146_887


# ---------------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------------


def test_sinusoid_matches_the_textbook_formula():
    d = 32
    pos = np.arange(300)
    table = np.zeros((300, d))
    for i in range(d // 2):
        angle = pos / 10000 ** (2 * i / d)
        table[:, 2 * i], table[:, 2 * i + 1] = np.sin(angle), np.cos(angle)
    ours = sinusoid(torch.arange(300), d).numpy()
    np.testing.assert_allclose(ours, table, atol=5e-5)
    # Fractional timesteps sit between their integer neighbours' embeddings smoothly.
    mid = sinusoid(torch.tensor([10.5]), d)
    assert torch.allclose(mid, (sinusoid(torch.tensor([10.0]), d) + sinusoid(torch.tensor([11.0]), d)) / 2, atol=0.2)
    with pytest.raises(ValueError, match="even"):
        sinusoid(torch.arange(3), 7)


def test_forward_shape_layout_and_determinism(model):
    inp = _inputs(model.config)
    out = model(**inp)
    assert out.shape == inp["x"].shape
    assert torch.equal(out, model(**inp))
    feats = torch.randn(2, 10, J)
    assert torch.equal(from_mdm_layout(to_mdm_layout(feats)), feats)
    assert to_mdm_layout(feats).shape == (2, J, 1, 10)


def test_input_errors(model):
    inp = _inputs(model.config)
    with pytest.raises(ValueError, match="MDM layout"):
        model(from_mdm_layout(inp["x"]), inp["timesteps"], inp["text_emb"])
    with pytest.raises(ValueError, match="max_frames"):
        model(torch.zeros(1, J, 1, 49), torch.zeros(1), torch.zeros(1, 16))
    with pytest.raises(ValueError, match="text_emb"):
        model(inp["x"], inp["timesteps"], torch.zeros(3, 5))
    with pytest.raises(ValueError, match="drop_text"):
        model(**inp, drop_text=torch.zeros(3))
    with pytest.raises(ValueError, match="padding_mask"):
        model(**inp, padding_mask=torch.zeros(3, 5, dtype=torch.bool))


def test_padding_mask_hides_padded_frames(model):
    inp = _inputs(model.config, frames=20)
    lengths = torch.tensor([20, 12, 8])
    mask = padding_mask_from_lengths(lengths, 20)
    assert mask.tolist()[1] == [False] * 12 + [True] * 8
    noisy = inp["x"].clone()
    noisy[1, :, :, 12:] = 100.0
    noisy[2, :, :, 8:] = -50.0
    a = model(**inp, padding_mask=mask)
    b = model(noisy, inp["timesteps"], inp["text_emb"], padding_mask=mask)
    for i, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(a[i, ..., :n], b[i, ..., :n], atol=1e-5, rtol=1e-5)
    # Without a mask every frame is attended to (MDM's original behaviour), so the padding leaks in.
    c = model(noisy, inp["timesteps"], inp["text_emb"])
    assert (c[1, ..., :12] - model(**inp)[1, ..., :12]).abs().max() > 1e-3
    # A fully padded clip still has the condition token to attend to: no NaN.
    full = model(**inp, padding_mask=torch.ones(3, 20, dtype=torch.bool))
    assert torch.isfinite(full).all()


def test_drop_text_zeroes_the_text_embedding(model):
    inp = _inputs(model.config)
    drop = torch.tensor([True, False, True])
    out = model(**inp, drop_text=drop)
    uncond = model(inp["x"], inp["timesteps"], None)
    cond = model(**inp)
    torch.testing.assert_close(out[drop], uncond[drop])
    torch.testing.assert_close(out[~drop], cond[~drop])
    # A NaN embedding in a dropped row does not leak into the unconditional prediction.
    poisoned = inp["text_emb"].clone()
    poisoned[0] = float("nan")
    torch.testing.assert_close(model(inp["x"], inp["timesteps"], poisoned, drop_text=drop)[0], uncond[0])
    # The text does matter when kept.
    assert (cond - uncond).abs().max() > 1e-4


def test_timestep_matters_and_floats_are_accepted(model):
    inp = _inputs(model.config)
    a = model(**inp)
    b = model(inp["x"], inp["timesteps"] + 100, inp["text_emb"])
    assert (a - b).abs().max() > 1e-4
    c = model(inp["x"], inp["timesteps"].float(), inp["text_emb"])
    torch.testing.assert_close(a, c)


def test_guided_forward_is_mdm_cfg(model):
    inp = _inputs(model.config)
    cond = model(**inp)
    uncond = model(inp["x"], inp["timesteps"], None)
    torch.testing.assert_close(model.guided_forward(**inp, guidance_scale=1.0), cond, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.guided_forward(**inp, guidance_scale=0.0), uncond, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.guided_forward(**inp, guidance_scale=2.5), uncond + 2.5 * (cond - uncond),
                               atol=1e-5, rtol=1e-5)
    per_sample = model.guided_forward(**inp, guidance_scale=torch.tensor([0.0, 1.0, 2.5]))
    torch.testing.assert_close(per_sample[0], uncond[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(per_sample[1], cond[1], atol=1e-5, rtol=1e-5)


def test_random_text_drop_rate(model):
    g = torch.Generator().manual_seed(0)
    drops = model.random_text_drop(20000, generator=g)
    assert drops.dtype == torch.bool and abs(drops.float().mean().item() - 0.1) < 0.01
    assert torch.equal(drops, model.random_text_drop(20000, generator=torch.Generator().manual_seed(0)))


def test_gradients_reach_every_parameter_and_a_few_steps_fit_a_batch():
    torch.manual_seed(0)
    m = MotionDiffusionModel(**_small_config(dropout=0.0))
    inp = _inputs(m.config, batch=4, frames=16)
    target = torch.randn_like(inp["x"]) * 0.5
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = ((m(**inp) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if not losses:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_save_and_from_pretrained_roundtrip(tmp_path, model):
    model.save_pretrained(tmp_path / "m")
    again = MotionDiffusionModel.from_pretrained(tmp_path / "m").eval()
    public = lambda cfg: {k: v for k, v in cfg.items() if not k.startswith("_")}
    assert public(again.config) == public(model.config)
    inp = _inputs(model.config)
    torch.testing.assert_close(again(**inp), model(**inp))


# ---------------------------------------------------------------------------------------------------------
# CLIP text encoder
# ---------------------------------------------------------------------------------------------------------


def _tiny_tokenizer():
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in string.ascii_lowercase:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    for tok in ("th", "the</w>", "ma", "man</w>"):
        vocab[tok] = len(vocab)
    merges = [("t", "h"), ("th", "e</w>"), ("m", "a"), ("ma", "n</w>")]
    return CLIPTokenizer(vocab=vocab, merges=merges), len(vocab)


TEXT_KW = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1)


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    """A tiny full CLIP model (text + vision towers, projections) in transformers' folder layout, like
    ``clip-vit-base-patch32``."""
    from transformers import CLIPConfig, CLIPModel

    folder = tmp_path_factory.mktemp("clip")
    tokenizer, vocab_size = _tiny_tokenizer()
    torch.manual_seed(0)
    cfg = CLIPConfig(
        text_config=dict(vocab_size=vocab_size, **TEXT_KW),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           image_size=32, patch_size=16),
        projection_dim=24,
    )
    CLIPModel(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_clip_encoder_gives_the_projected_eot_embedding(clip_folder):
    from transformers import CLIPModel

    enc = CLIPTextEncoder.from_folder(clip_folder)
    assert isinstance(enc, TextEncoder)
    assert enc.text_dim == 24
    assert not any(p.requires_grad for p in enc.parameters())
    texts = ["the man walks", "a man"]
    emb = enc.encode(texts)
    assert emb.shape == (2, 24) and emb.dtype == torch.float32

    # Reference: final hidden state at the end-of-text token times the text projection (OpenAI's encode_text).
    full = CLIPModel.from_pretrained(clip_folder, local_files_only=True).eval()
    for i, text in enumerate(texts):
        ids = enc.tokenizer([text], return_tensors="pt")["input_ids"]
        assert ids[0, 0] == 0 and ids[0, -1] == 1
        with torch.no_grad():
            hidden = full.text_model(input_ids=ids).last_hidden_state[0, -1]
            expected = full.text_projection(hidden)
        torch.testing.assert_close(emb[i], expected, atol=1e-5, rtol=1e-5)
    # Padding in a batch does not change a caption's embedding.
    torch.testing.assert_close(enc.encode(["a man"])[0], emb[1], atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError):
        enc.encode("a man")


def test_clip_encoder_folder_errors(tmp_path, clip_folder):
    from transformers import CLIPTextConfig, CLIPTextModel

    with pytest.raises(FileNotFoundError, match="no CLIP folder"):
        CLIPTextEncoder.from_folder(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        CLIPTextEncoder.from_folder(tmp_path / "empty")

    # A text tower saved without its projection: the projected encoder refuses (transformers would otherwise
    # initialise the projection at random), the unprojected one gives the pooled output.
    tokenizer, vocab_size = _tiny_tokenizer()
    bare = tmp_path / "bare"
    CLIPTextModel(CLIPTextConfig(vocab_size=vocab_size, **TEXT_KW)).save_pretrained(bare)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        CLIPTextEncoder.from_folder(bare)
    tokenizer.save_pretrained(bare)
    with pytest.raises(ValueError, match="text_projection"):
        CLIPTextEncoder.from_folder(bare)
    enc = CLIPTextEncoder.from_folder(bare, projected=False)
    assert enc.text_dim == 32 and enc.encode(["the man"]).shape == (1, 32)


def test_clip_embeddings_drive_the_model(clip_folder):
    enc = CLIPTextEncoder.from_folder(clip_folder)
    m = MotionDiffusionModel(**_small_config(text_dim=enc.text_dim)).eval()
    emb = enc.encode(["the man walks", "a man runs"])
    out = m(torch.randn(2, J, 1, 8), torch.tensor([10, 500]), emb)
    assert out.shape == (2, J, 1, 8) and math.isfinite(out.sum().item())


def test_callable_text_encoder_adapts_any_function():
    table = nn.Embedding(10, 16)
    enc = CallableTextEncoder(lambda texts: table(torch.tensor([len(t) % 10 for t in texts])), text_dim=16)
    assert isinstance(enc, TextEncoder)
    emb = enc.encode(["walk", "run"])
    assert emb.shape == (2, 16) and emb.requires_grad
    with pytest.raises(ValueError, match="expected"):
        CallableTextEncoder(lambda texts: torch.zeros(len(texts), 3), text_dim=16).encode(["a"])
    with pytest.raises(TypeError):
        enc.encode("walk")
