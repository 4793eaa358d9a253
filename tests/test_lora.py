"""LoRA through peft: trainable set, reference = adapter disabled, save/load, memory savers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recam.domains.camera.model import ReCamTransformer3DModel, tiny_config
from recam.infra.lora import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    DEFAULT_LORA_TARGETS,
    adapter_disabled,
    add_lora,
    enable_memory_savers,
    has_lora,
    load_adapter,
    save_adapter,
    set_trainable,
    trainable_parameter_names,
)


def _base(seed: int = 0) -> ReCamTransformer3DModel:
    torch.manual_seed(seed)
    return ReCamTransformer3DModel(**tiny_config()).eval()


def _inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    shape = (2, 3, 4, 16, 16)
    return {
        "noisy_target": torch.randn(*shape, generator=g),
        "sigma": torch.rand(2, generator=g),
        "source_video": torch.randn(*shape, generator=g),
        "source_cams": torch.randn(2, 4, 3, 4, generator=g),
        "target_cams": torch.randn(2, 4, 3, 4, generator=g),
    }


def _perturb_lora_b(model: torch.nn.Module, seed: int = 1) -> None:
    # peft starts B at zero (adapter = no-op); make it matter.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=g))


def test_only_adapter_weights_are_trainable():
    model = _base()
    add_lora(model, rank=4, alpha=8)
    names = trainable_parameter_names(model)
    layers = tiny_config()["num_layers"]
    assert len(names) == layers * len(DEFAULT_LORA_TARGETS) * 2
    assert all(".attn1." in n and (".lora_A." in n or ".lora_B." in n) for n in names)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    assert model.peft_config["default"].r == 4 and model.peft_config["default"].lora_alpha == 8

    # Gradients reach the adapter only.
    _perturb_lora_b(model)
    model.train()
    model(**_inputs()).square().mean().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads == set(names)


def test_disabled_adapter_gives_the_base_output():
    base_out_model = _base()
    with torch.no_grad():
        expected = base_out_model(**_inputs())

    model = _base()
    add_lora(model, rank=4, alpha=4, dropout=0.0)
    _perturb_lora_b(model)
    with torch.no_grad():
        adapted = model(**_inputs())
        with adapter_disabled(model):
            reference = model(**_inputs())
        again = model(**_inputs())
    # Not bit-equal on every CPU path: two separately built copies of the same weights give a last-bit different
    # linear layer under MKL_CBWR=COMPATIBLE. Max |reference - expected| (outputs up to 2.2) measured: 0 natively,
    # with ATEN_CPU_CAPABILITY=avx2 or default alone, or two threads; 5.4e-7 / 6.0e-7 / 7.2e-7 with MKL_CBWR=COMPATIBLE
    # and ATEN avx2 / ONEDNN_MAX_CPU_ISA=AVX2 / ATEN default; x20. Elements near zero make a relative bound useless.
    rounding = 1.5e-5
    assert float((adapted - expected).abs().max()) > 100 * rounding  # the adapter matters: 0.0125 measured
    torch.testing.assert_close(reference, expected, rtol=0, atol=rounding)
    assert torch.equal(again, adapted)  # the same model on the same input again: bit-equal in every setting measured
    # The context restored the adapters' trainability that peft's toggle clears.
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_adapter_disabled_restores_on_error_and_needs_an_adapter():
    model = _base()
    with pytest.raises(ValueError, match="separate frozen reference"):
        with adapter_disabled(model):
            pass
    add_lora(model, rank=2, alpha=2)
    _perturb_lora_b(model)
    with torch.no_grad():
        adapted = model(**_inputs())
    with pytest.raises(RuntimeError, match="boom"):
        with adapter_disabled(model):
            raise RuntimeError("boom")
    with torch.no_grad():
        assert torch.equal(model(**_inputs()), adapted)


def test_saved_adapter_reloads_into_a_fresh_base(tmp_path):
    model = _base()
    add_lora(model, rank=4, alpha=8, target_modules=["attn1.to_q", "attn1.to_v", "attn2.to_out.0"])
    _perturb_lora_b(model)
    with torch.no_grad():
        expected = model(**_inputs(3))
    save_adapter(model, tmp_path / "adapter")
    assert (tmp_path / "adapter" / ADAPTER_WEIGHTS_NAME).is_file()
    assert (tmp_path / "adapter" / ADAPTER_CONFIG_NAME).is_file()

    fresh = _base()
    config = load_adapter(fresh, tmp_path / "adapter")
    assert config.r == 4 and set(config.target_modules) == {"attn1.to_q", "attn1.to_v", "attn2.to_out.0"}
    with torch.no_grad():
        assert torch.equal(fresh(**_inputs(3)), expected)
    assert trainable_parameter_names(fresh) == trainable_parameter_names(model)

    frozen = _base()
    load_adapter(frozen, tmp_path / "adapter", trainable=False)
    assert trainable_parameter_names(frozen) == []


def test_bad_targets_and_trainable_modes():
    model = _base()
    with pytest.raises(ValueError, match=r"match nothing.*attn1\.to_qkv"):
        add_lora(model, rank=2, alpha=2, target_modules=["attn1.to_q", "attn1.to_qkv"])

    full = set_trainable(model, "full")
    assert len(full) == len(list(model.parameters()))
    recam = set_trainable(model, "recammaster")
    assert recam and all(any(k in n for k in (".cam_encoder.", ".projector.", ".attn1.")) for n in recam)
    assert "blocks.0.attn2.to_q.weight" not in recam and "blocks.1.cam_encoder.weight" in recam

    add_lora(model, rank=2, alpha=2)
    assert has_lora(model)
    with pytest.raises(ValueError, match="carries a LoRA adapter"):
        set_trainable(model, "full")
    assert all("lora_" in n for n in set_trainable(model, "lora"))


def test_memory_savers_switch_checkpointing_and_tf32():
    model = _base()
    add_lora(model, rank=2, alpha=2)
    _perturb_lora_b(model)
    # The flags are process-wide; put them back for whatever test runs next.
    tf32_before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        applied = enable_memory_savers(model, gradient_checkpointing=True, tf32=True)
        assert applied["gradient_checkpointing"] and model.is_gradient_checkpointing and applied["tf32"]
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32

        # Checkpointed training gives the same gradients as plain training.
        model.train()
        model(**_inputs()).square().mean().backward()
        grads_ckpt = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        applied = enable_memory_savers(model, gradient_checkpointing=False, tf32=False)
        assert not applied["gradient_checkpointing"] and not model.is_gradient_checkpointing
        assert not torch.backends.cuda.matmul.allow_tf32
        model(**_inputs()).square().mean().backward()
        grads_plain = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads_ckpt.keys() == grads_plain.keys() and grads_ckpt
        assert all(torch.allclose(grads_ckpt[n], grads_plain[n], atol=1e-6) for n in grads_plain)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before[0]
        torch.backends.cudnn.allow_tf32 = tf32_before[1]


def test_fp32_adapter_on_a_bf16_base(tmp_path):
    model = _base()
    with torch.no_grad():
        expected = model(**_inputs())
    bf16 = _base()
    bf16.save_pretrained(tmp_path)
    from recam.domains.camera.loading import load_wan_transformer

    bf16, _ = load_wan_transformer(tmp_path, dtype=torch.bfloat16)
    add_lora(bf16, rank=4, alpha=4)
    lora = {p.dtype for n, p in bf16.named_parameters() if "lora_" in n}
    assert lora == {torch.float32}
    assert bf16.blocks[0].attn1.to_q.base_layer.weight.dtype == torch.bfloat16
    _perturb_lora_b(bf16)
    # The model does not cast its inputs; a bf16 model takes bf16 videos (sigma stays fp32 for the embedder).
    half = {k: (v if k == "sigma" else v.to(torch.bfloat16)) for k, v in _inputs().items()}
    with torch.no_grad(), adapter_disabled(bf16):
        reference = bf16(**half)
    # bf16 weights: close to the fp32 model, not equal.
    assert (reference.float() - expected).abs().mean() < 0.05 * expected.abs().mean()
    bf16.train()
    bf16(**half).float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for n, p in bf16.named_parameters() if "lora_" in n)


def test_peft_is_imported_only_when_an_adapter_is_made():
    """Full fine-tuning (the motion presets) starts without peft and the transformers it pulls in; a model with no
    adapter reads as such before peft was ever imported, and one made afterwards is found."""
    code = (
        "import sys, torch\n"
        "from recam.infra import lora\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
        "assert lora.lora_layers(m) == [] and 'peft' not in sys.modules\n"
        "lora.add_lora(m, rank=2, alpha=2, target_modules=['0'])\n"
        "assert len(lora.lora_layers(m)) == 1 and lora.has_lora(m)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
