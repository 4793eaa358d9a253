"""Tests for recam.domains.camera.model (ReCam-Tiny on diffusers' WanTransformer3DModel)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanTransformerBlock

from recam.domains.camera.model import (
    ReCamTransformer3DModel,
    camera_block_forward,
    can_trim_queries,
    leading_query_self_attention,
    tiny_config,
    wan21_1_3b_config,
)

CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "recam_tiny_base"


def _tiny_model(seed: int = 0, **overrides) -> ReCamTransformer3DModel:
    torch.manual_seed(seed)
    cfg = tiny_config()
    cfg.update(overrides)
    return ReCamTransformer3DModel(**cfg).eval()


def _inputs(b: int = 2, c: int = 3, f: int = 8, h: int = 32, w: int = 32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return {
        "noisy_target": torch.randn(b, c, f, h, w, generator=g),
        "sigma": torch.rand(b, generator=g),
        "source_video": torch.rand(b, c, f, h, w, generator=g) * 2 - 1,
        "source_cams": torch.randn(b, f, 3, 4, generator=g),
        "target_cams": torch.randn(b, f, 3, 4, generator=g),
    }


def _perturb_cameras(model: ReCamTransformer3DModel, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            block.cam_encoder.weight.normal_(0.0, 0.5, generator=g)
            block.cam_encoder.bias.normal_(0.0, 0.1, generator=g)
            block.projector.weight.add_(torch.randn(block.projector.weight.shape, generator=g) * 0.05)


def test_output_shape_and_finite():
    model = _tiny_model()
    inp = _inputs(b=3)
    with torch.no_grad():
        out = model(**inp)
    assert out.shape == (3, 3, 8, 32, 32)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_camera_modules_initialised_as_recammaster():
    model = _tiny_model()
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    for block in model.blocks:
        assert block.cam_encoder.weight.shape == (dim, 12)
        assert torch.count_nonzero(block.cam_encoder.weight) == 0
        assert torch.count_nonzero(block.cam_encoder.bias) == 0
        assert torch.equal(block.projector.weight, torch.eye(dim))
        assert torch.count_nonzero(block.projector.bias) == 0


def _plain_wan(model):
    """diffusers' own Wan transformer from the same config, holding the model's weights less the camera modules."""
    names = inspect.signature(WanTransformer3DModel.__init__).parameters
    plain = WanTransformer3DModel(**{k: v for k, v in model.config.items() if k in names})
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(k == "null_text" or k.split(".")[-2] in ("cam_encoder", "projector")
                               for k in unexpected)
    return plain.eval()


def test_at_init_model_equals_plain_wan_on_concatenated_video():
    """Independent path: the parent's own forward on [target | source] with timestep 1000*sigma."""
    model = _tiny_model()
    inp = _inputs()
    f = inp["noisy_target"].shape[2]
    with torch.no_grad():
        ours = model(**inp)
        hidden = torch.cat([inp["noisy_target"], inp["source_video"]], dim=2)
        context = model.null_text.expand(hidden.shape[0], -1, -1)
        wan = _plain_wan(model)(hidden, inp["sigma"] * 1000.0, context).sample
    assert torch.allclose(ours, wan[:, :, :f], atol=1e-5, rtol=1e-5)


def test_zero_init_camera_has_no_effect_then_perturbed_camera_does():
    model = _tiny_model()
    inp = _inputs()
    other = dict(inp)
    other["source_cams"] = torch.randn_like(inp["source_cams"])
    other["target_cams"] = torch.randn_like(inp["target_cams"])
    with torch.no_grad():
        assert torch.equal(model(**inp), model(**other))

    _perturb_cameras(model)
    only_target = dict(inp, target_cams=other["target_cams"])
    only_source = dict(inp, source_cams=other["source_cams"])
    with torch.no_grad():
        base = model(**inp)
        assert (base - model(**only_target)).abs().max() > 1e-3
        assert (base - model(**only_source)).abs().max() > 1e-3


def test_camera_is_per_frame():
    """Changing the target camera of one frame must change that frame's velocity."""
    model = _tiny_model()
    _perturb_cameras(model)
    inp = _inputs(b=1)
    changed = dict(inp)
    changed["target_cams"] = inp["target_cams"].clone()
    changed["target_cams"][:, 5] += 1.0
    with torch.no_grad():
        diff = (model(**inp) - model(**changed)).abs().amax(dim=(0, 1, 3, 4))
    assert diff[5] > 1e-3


def test_camera_block_forward_matches_wan_block_when_camera_is_neutral():
    model = _tiny_model()
    block = model.blocks[0]
    g = torch.Generator().manual_seed(5)
    b, frames, tpf, dim = 2, 4, 6, 96
    hidden = torch.randn(b, frames * tpf, dim, generator=g)
    context = torch.randn(b, 4, dim, generator=g)
    tproj = torch.randn(b, 6, dim, generator=g)
    probe = torch.zeros(b, 1, 8, 32, 32)
    rope = model.rope(probe)
    rope = tuple(r[:, : frames * tpf] for r in rope)
    cams = torch.randn(b, frames, 12, generator=g)
    with torch.no_grad():
        ours = camera_block_forward(block, hidden, context, tproj, rope, cams, tpf)
        theirs = WanTransformerBlock.forward(block, hidden, context, tproj, rope)  # Wan's own block forward
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_leading_query_self_attention_equals_the_modules_own_attention_sliced():
    model = _tiny_model()
    attn = model.blocks[1].attn1
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 1024, 96, generator=g)
    rope = model.rope(torch.zeros(2, 3, 16, 32, 32))
    with torch.no_grad():
        full = attn(x, None, None, rope)  # diffusers' WanAttnProcessor on all tokens
        ours = leading_query_self_attention(attn, x, 512, rope)
    assert ours.shape == (2, 512, 96)
    assert torch.allclose(ours, full[:, :512], atol=1e-5)


@pytest.mark.parametrize("lora", [False, True])
def test_trimmed_last_block_gives_the_same_velocity_and_gradients(lora):
    """The last block computes only the target tokens; its outputs and every parameter gradient must equal those
    of running it on all tokens and slicing afterwards."""
    model = _tiny_model()
    with torch.no_grad():
        for block in model.blocks:  # non-neutral cameras, so the camera path is exercised too
            block.cam_encoder.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(7))
    if lora:
        from recam.infra.lora import add_lora

        add_lora(model, 4, 8.0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    assert can_trim_queries(model.blocks[-1].attn1)  # so the trimmed path is the one compared
    inp = _inputs(b=2)
    results = []
    for trim in (True, False):
        model.trim_last_block = trim
        model.zero_grad()
        out = model(**inp)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.detach(), grads))
    (out_trim, g_trim), (out_full, g_full) = results
    assert torch.allclose(out_trim, out_full, atol=1e-5)
    assert g_trim.keys() == g_full.keys() and len(g_full) > 0
    # Summed over every token in a different order, the full model's gradients differ in rounding, and some (the key
    # bias's, zero in exact arithmetic) are nothing but rounding. Worst max|diff| / (1e-5 + 1e-4 |full|) measured
    # over all gradients: 0.62 natively (AVX512, one or two threads), 0.49 / 0.80 with ATEN_CPU_CAPABILITY=avx2 /
    # default, 0.69 / 1.07 / 1.73 with MKL_CBWR=COMPATIBLE and ATEN avx2 / ATEN default / ONEDNN_MAX_CPU_ISA=AVX2
    # (LoRA: 0.18 at most); x20 -> 40 times those tolerances.
    for name in g_full:
        assert torch.allclose(g_trim[name], g_full[name], rtol=4e-3, atol=4e-4), name


def test_text_embeddings_are_used_and_null_context_is_default():
    model = _tiny_model()
    inp = _inputs()
    b = inp["sigma"].shape[0]
    with torch.no_grad():
        default = model(**inp)
        explicit_null = model(**inp, encoder_hidden_states=model.null_text.expand(b, -1, -1).clone())
        text = model(**inp, encoder_hidden_states=torch.randn(b, 7, model.config.text_dim))
    assert torch.equal(default, explicit_null)
    assert (default - text).abs().max() > 1e-4


def test_gradient_checkpointing_gives_same_gradients():
    model = _tiny_model().train()
    _perturb_cameras(model)
    inp = _inputs()

    def grads():
        model.zero_grad(set_to_none=True)
        model(**inp).square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.enable_gradient_checkpointing()
    assert model.gradient_checkpointing
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys()
    assert any("cam_encoder" in n for n in plain)
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], atol=1e-6, rtol=1e-5), name


def test_save_load_round_trip_non_default_config(tmp_path):
    overrides = {
        "patch_size": (2, 4, 4),
        "num_attention_heads": 3,
        "attention_head_dim": 24,
        "in_channels": 4,
        "out_channels": 2,
        "text_dim": 16,
        "freq_dim": 32,
        "ffn_dim": 100,
        "num_layers": 1,
        "rope_max_seq_len": 32,
        "null_text_len": 3,
    }
    model = _tiny_model(seed=11, **overrides)
    _perturb_cameras(model)
    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "config.json").is_file()
    assert (tmp_path / "ckpt" / "diffusion_pytorch_model.safetensors").is_file()

    loaded = ReCamTransformer3DModel.from_pretrained(tmp_path / "ckpt").eval()
    assert loaded.config.null_text_len == 3
    assert tuple(loaded.config.patch_size) == (2, 4, 4)
    assert loaded.null_text.shape == (1, 3, 16)
    inp = _inputs(c=4, f=4, h=16, w=16, seed=2)
    with torch.no_grad():
        before = model(**inp)
        after = loaded(**inp)
    assert before.shape == (2, 2, 4, 16, 16)
    assert torch.equal(before, after)


def test_real_size_config_builds_on_meta_device():
    with torch.device("meta"):
        model = ReCamTransformer3DModel(**wan21_1_3b_config())
    dim = 1536
    per_block_camera = (12 * dim + dim) + (dim * dim + dim)
    total = sum(p.numel() for p in model.parameters())
    camera = sum(p.numel() for n, p in model.named_parameters() if "cam_encoder" in n or "projector" in n)
    assert camera == 30 * per_block_camera
    # Wan2.1 T2V-1.3B is about 1.42e9 parameters with a 4096-d text projection.
    assert 1.3e9 < total - camera < 1.5e9


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sigma": torch.rand(3)}, "sigma must have shape"),
        ({"sigma": torch.tensor([0.5, 1.5])}, "sigma must lie in"),
        ({"target_cams": torch.randn(2, 8, 4, 4)}, "target_cams must have shape"),
        ({"source_cams": torch.randn(2, 7, 3, 4)}, "source_cams must have shape"),
        ({"source_video": torch.randn(2, 3, 4, 32, 32)}, "source_video shape"),
        ({"noisy_target": torch.randn(2, 3, 8, 30, 30), "source_video": torch.randn(2, 3, 8, 30, 30)},
         "not divisible by patch_size"),
        ({"noisy_target": torch.randn(2, 1, 8, 32, 32), "source_video": torch.randn(2, 1, 8, 32, 32)},
         "channels"),
    ],
)
def test_bad_inputs_raise_clear_errors(change, message):
    model = _tiny_model()
    inp = dict(_inputs(), **change)
    with pytest.raises(ValueError, match=message):
        model(**inp)


def test_bad_text_embedding_shape_raises():
    model = _tiny_model()
    with pytest.raises(ValueError, match="encoder_hidden_states"):
        model(**_inputs(), encoder_hidden_states=torch.randn(2, 4, 5))


def test_committed_checkpoint_loads():
    if not (CHECKPOINT / "config.json").is_file():
        pytest.skip(f"committed checkpoint {CHECKPOINT} not produced yet (scripts/pretrain/pretrain_base.py makes it)")
    model = ReCamTransformer3DModel.from_pretrained(CHECKPOINT).eval()
    assert model.config.in_channels == 3
    # Pretraining must have moved the camera encoders away from their zero init.
    assert any(torch.count_nonzero(b.cam_encoder.weight) > 0 for b in model.blocks)
    with torch.no_grad():
        out = model(**_inputs())
    assert out.shape == (2, 3, 8, 32, 32)
    assert torch.isfinite(out).all()

    provenance = json.loads((CHECKPOINT / "provenance.json").read_text())
    assert isinstance(provenance["command"], str) and "pretrain_base.py" in provenance["command"]
    assert isinstance(provenance["seed"], int)


def _load_pretrain_script():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "pretrain" / "pretrain_base.py"
    spec = importlib.util.spec_from_file_location("pretrain_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_euler_ode_sampler_is_exact_for_a_constant_velocity_field():
    """With v = noise - x0 held fixed, Euler from sigma = 1 to 0 lands exactly on x0."""
    pretrain = _load_pretrain_script()
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 3, 8, 32, 32, generator=g)
    noise = torch.randn(2, 3, 8, 32, 32, generator=g)
    seen_sigmas = []

    def oracle(x, sigma, source, src_cams, tgt_cams):
        seen_sigmas.append(sigma[0].item())
        return noise - x0

    out = pretrain.euler_ode_sample(oracle, noise, x0, None, None, num_steps=10)
    assert torch.allclose(out, x0, atol=1e-5)
    assert seen_sigmas == pytest.approx([1.0 - i / 10 for i in range(10)])


def test_pretrain_script_smoke(tmp_path):
    pretrain = _load_pretrain_script()
    out = tmp_path / "base"
    provenance = pretrain.main([
        "--out", str(out), "--steps", "2", "--batch-size", "2", "--num-train-conditions", "4",
        "--num-eval-conditions", "2", "--eval-every", "1", "--eval-ode-steps", "2", "--seed", "3",
        "--timing-repeats", "0",
    ])
    assert (out / "config.json").is_file()
    assert (out / "diffusion_pytorch_model.safetensors").is_file()
    saved = json.loads((out / "provenance.json").read_text())
    assert saved["seed"] == 3 and saved["args"]["steps"] == 2
    assert len(saved["eval_history"]) == 2
    assert saved["final_eval"]["mse_to_ground_truth"] > 0
    assert provenance["final_train_loss"] == saved["final_train_loss"]
    ReCamTransformer3DModel.from_pretrained(out)


def test_pretrain_continues_from_a_base_and_counts_its_steps(tmp_path):
    """--init-from: the run starts at the base's weights (a vanishing learning rate leaves them there) and its
    provenance adds the base's optimizer steps; a base without provenance is refused by name."""
    pretrain = _load_pretrain_script()
    common = ["--batch-size", "2", "--num-train-conditions", "4", "--num-eval-conditions", "2", "--eval-every", "1",
              "--eval-ode-steps", "2", "--timing-repeats", "0"]
    pretrain.main(["--out", str(tmp_path / "a"), "--steps", "2", *common])
    saved = pretrain.main(["--out", str(tmp_path / "b"), "--steps", "1", "--lr", "1e-12", "--init-from",
                           str(tmp_path / "a"), *common])
    assert saved["total_steps"] == 3 and saved["init_from"]["total_steps"] == 2
    assert saved["init_from"]["folder"] == str(tmp_path / "a") and "--steps 2" in saved["init_from"]["command"]
    a = ReCamTransformer3DModel.from_pretrained(tmp_path / "a").state_dict()
    b = ReCamTransformer3DModel.from_pretrained(tmp_path / "b").state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-8) for k in a)
    again = pretrain.main(["--out", str(tmp_path / "c"), "--steps", "1", "--init-from", str(tmp_path / "b"), *common])
    assert again["total_steps"] == 4  # a chain of stages adds up
    (tmp_path / "a" / "provenance.json").unlink()
    with pytest.raises(SystemExit, match="provenance.json"):
        pretrain.main(["--out", str(tmp_path / "d"), "--steps", "1", "--init-from", str(tmp_path / "a"), *common])


def test_plucker_rays_pass_through_each_patch_centre_loop_version():
    """Every token's ray, checked one token at a time against the world's own projection: a point on the ray
    projects onto that token's patch centre in its frame, and the moment is c x d about the world origin."""
    from recam.domains.camera.model import plucker_rays
    from recam.domains.camera.world import SyntheticWorld, collate_conditions, default_intrinsics, project_points

    world = SyntheticWorld("train", num_conditions=2, seed=0)
    cams = collate_conditions([world[0], world[1]])["target_cams"].float()  # (2, 8, 3, 4)
    rays = plucker_rays(cams.flatten(2), (8, 8), (4, 4), 1.0)
    assert rays.shape == (2, 8 * 64, 6)
    K = default_intrinsics(32)
    for b in range(2):
        for f in (0, 3, 7):
            rot, trans = cams[b, f, :, :3], cams[b, f, :, 3]
            centre = -rot.T @ trans
            for n in (0, 9, 27, 63):
                d, m = rays[b, f * 64 + n, :3], rays[b, f * 64 + n, 3:]
                assert torch.isclose(d.norm(), torch.tensor(1.0), atol=1e-5)
                uv, z = project_points((centre + 2.5 * d)[None], cams[b, f][None], K)
                assert z.item() > 0
                expected = torch.tensor([(n % 8) * 4 + 1.5, (n // 8) * 4 + 1.5])
                assert torch.allclose(uv[0, 0], expected, atol=1e-3)
                assert torch.allclose(m, torch.linalg.cross(centre, d), atol=1e-5)


def test_ray_pathway_starts_as_a_no_op_and_then_reads_where_each_token_looks(tmp_path):
    """plucker_rays adds zero-initialised ray encoders: the model's output is unchanged until they train; once
    they carry weight the velocity depends on the target cameras token by token, and the flag survives a
    save / load round trip. A base without rays gains them through the pretraining script's loader."""
    plain = _tiny_model(seed=5)
    rays = _tiny_model(seed=5, plucker_rays=True)
    missing, unexpected = rays.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(".ray_encoder." in k for k in missing)
    inp = _inputs()
    with torch.no_grad():
        assert torch.equal(plain(**inp), rays(**inp))
        for block in rays.blocks:
            block.ray_encoder.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
        moved = rays(**inp)
        assert (moved - plain(**inp)).abs().max() > 1e-3
        other = dict(inp, target_cams=inp["target_cams"] + 0.1)
        assert (rays(**other) - moved).abs().max() > 1e-4
    rays.save_pretrained(tmp_path / "rays")
    loaded = ReCamTransformer3DModel.from_pretrained(tmp_path / "rays").eval()
    assert loaded.config.plucker_rays
    with torch.no_grad():
        assert torch.equal(loaded(**inp), moved)

    plain.save_pretrained(tmp_path / "plain")
    gained = _load_pretrain_script().load_base(tmp_path / "plain", add_rays=True).eval()
    with torch.no_grad():
        assert gained.config.plucker_rays and torch.equal(gained(**inp), plain(**inp))
    with pytest.raises(ValueError, match="ray_focal"):
        _tiny_model(plucker_rays=True, ray_focal=0.0)


def test_ray_pathway_trims_and_checkpoints_like_the_plain_model():
    model = _tiny_model(seed=2, plucker_rays=True).train()
    _perturb_cameras(model)
    with torch.no_grad():
        for block in model.blocks:
            block.ray_encoder.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(4))
    inp = _inputs()

    def run(trim: bool, checkpointing: bool):
        model.trim_last_block = trim
        if checkpointing:
            model.enable_gradient_checkpointing()
        else:
            model.disable_gradient_checkpointing()
        model.zero_grad(set_to_none=True)
        out = model(**inp)
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_out, ref_grads = run(False, False)
    assert any("ray_encoder" in n for n in ref_grads)
    for trim, ckpt in ((True, False), (True, True)):
        out, grads = run(trim, ckpt)
        assert torch.allclose(out, ref_out, atol=1e-5, rtol=1e-4)
        for name, g in ref_grads.items():
            assert torch.allclose(grads[name], g, atol=1e-6, rtol=1e-4), name


def test_pretrain_resumes_where_it_stopped_and_ends_where_an_unbroken_run_ends(tmp_path, monkeypatch):
    """--state-every / --resume: a run stopped after its third step and resumed reaches the unbroken run's weights,
    losses and evaluations; a state saved with other arguments is refused by name, and a damaged one by its file."""
    pretrain = _load_pretrain_script()
    common = ["--steps", "5", "--batch-size", "2", "--num-train-conditions", "3", "--num-eval-conditions", "2",
              "--eval-every", "2", "--eval-ode-steps", "2", "--timing-repeats", "0", "--state-every", "1"]
    whole = pretrain.main(["--out", str(tmp_path / "whole"), *common])

    real_loss, calls = pretrain.flow_matching_loss, {"n": 0}

    def stops_on_the_fourth(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real_loss(*a, **k)

    monkeypatch.setattr(pretrain, "flow_matching_loss", stops_on_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        pretrain.main(["--out", str(tmp_path / "broken"), *common])
    monkeypatch.setattr(pretrain, "flow_matching_loss", real_loss)
    state = json.loads((tmp_path / "broken" / "train_state" / "state.json").read_text())
    assert state["step"] == 3 and len(state["losses"]) == 3
    resumed = pretrain.main(["--out", str(tmp_path / "broken"), "--resume", *common])
    assert resumed["final_train_loss"] == pytest.approx(whole["final_train_loss"], rel=1e-5)
    assert [e["step"] for e in resumed["eval_history"]] == [2, 4, 5]
    for a, b in zip(resumed["eval_history"], whole["eval_history"], strict=True):
        assert a["mse_to_ground_truth"] == pytest.approx(b["mse_to_ground_truth"], rel=1e-4)
    w = ReCamTransformer3DModel.from_pretrained(tmp_path / "whole").state_dict()
    r = ReCamTransformer3DModel.from_pretrained(tmp_path / "broken").state_dict()
    assert all(torch.allclose(w[k], r[k], atol=1e-6, rtol=1e-5) for k in w)

    with pytest.raises(SystemExit, match="other arguments .*lr"):
        pretrain.main(["--out", str(tmp_path / "broken"), "--resume", *common, "--lr", "5e-4"])
    (tmp_path / "broken" / "train_state" / "state.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SystemExit, match="cannot read .*train_state"):
        pretrain.main(["--out", str(tmp_path / "broken"), "--resume", *common])


def test_pretrain_can_train_on_the_evaluated_conditions_as_an_upper_bound(tmp_path):
    pretrain = _load_pretrain_script()
    saved = pretrain.main(["--out", str(tmp_path / "m"), "--steps", "1", "--batch-size", "2", "--num-train-conditions",
                           "16", "--num-eval-conditions", "3", "--eval-every", "1", "--eval-ode-steps", "2",
                           "--timing-repeats", "0", "--train-on-eval"])
    assert saved["args"]["train_on_eval"] and saved["num_train_conditions_used"] == 3


def test_detail_weights_match_a_pixel_loop_and_keep_their_mean():
    pretrain = _load_pretrain_script()
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(2, 3, 2, 5, 6, generator=g) * 2 - 1
    x0[1, :, 1] = 0.3  # a flat frame has no detail
    out = pretrain.detail_weights(x0, 4.0)
    assert out.shape == (2, 1, 2, 5, 6)
    for b in range(2):
        for f in range(2):
            frame = x0[b, :, f]
            detail = torch.zeros(5, 6)
            for i in range(5):
                for j in range(6):
                    patch = frame[:, max(0, i - 1):i + 2, max(0, j - 1):j + 2]
                    detail[i, j] = (frame[:, i, j] - patch.mean(dim=(1, 2))).abs().sum()
            if detail.mean() > 0:
                expected = 1 + 4.0 * detail / detail.mean()
                assert torch.allclose(out[b, 0, f], expected, atol=1e-5)
                assert out[b, 0, f].mean().item() == pytest.approx(5.0, rel=1e-5)
            else:
                assert torch.allclose(out[b, 0, f], torch.ones(5, 6))
    assert torch.equal(pretrain.detail_weights(x0, 0.0), torch.ones(2, 1, 2, 5, 6))
