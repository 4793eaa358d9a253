"""LoRA on the transformer's attention projections through peft, and what training needs around it.

The GRPO reference policy is the same network with its adapter switched off (:func:`adapter_disabled`), so no
second copy of the weights is held. Adapters are injected in place with ``peft.inject_adapter_in_model``: the
model keeps its class and forward signature, and its LoRA-wrapped layers are peft ``BaseTunerLayer``s.

Full fine-tuning needs none of this: ``set_trainable(model, "full")`` (a reference model then has to be a
separate frozen copy, which is the caller's business).
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from recam.infra.distributed import FSDP_PREFIX

if TYPE_CHECKING:
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer

# peft is imported where an adapter is made, saved or loaded, not with this module: importing it pulls in
# transformers, 2.4 s of a 24 s smoke run, which the motion domain's full fine-tuning never needs (the camera
# domain gets it anyway: diffusers' Wan model imports peft).

# Self-attention q/k/v/out projections of every WanTransformerBlock (diffusers names). ReCamMaster trains the
# self-attention (together with the camera modules), so this is where the adapter goes by default.
DEFAULT_LORA_TARGETS: tuple[str, ...] = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0")
# Cross-attention projections, for adding text-conditioning capacity as well.
CROSS_ATTENTION_TARGETS: tuple[str, ...] = ("attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"

# Modules ReCamMaster itself fine-tunes (its training script unfreezes modules whose name contains these), with
# recam's ray_encoder beside them where a model has the ray pathway (plucker_rays): it is camera conditioning too.
RECAMMASTER_TRAINABLE = ("cam_encoder", "projector", "ray_encoder", "attn1")


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP / accelerate wrappers keep the real model in `.module`; peft bookkeeping lives on the real one.
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _matches(name: str, target: str) -> bool:
    # peft's rule for a string target: the module's full name equals it or ends with "." + it.
    return name == target or name.endswith("." + target)


def lora_layers(model: nn.Module) -> list[BaseTunerLayer]:
    """Every peft adapter layer inside the model."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None:  # no adapter can exist before peft is imported to inject one
        return []
    return [m for m in _unwrap(model).modules() if isinstance(m, tuners.BaseTunerLayer)]


def has_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


def add_lora(
    model: nn.Module,
    rank: int,
    alpha: float,
    target_modules: Sequence[str] | None = None,
    dropout: float = 0.0,
    adapter_name: str = "default",
    adapter_dtype: torch.dtype | None = torch.float32,
) -> LoraConfig:
    """Inject a LoRA adapter into ``model`` in place and make it the only trainable part.

    Args:
        model: the transformer (or any module whose Linear layers carry the target names).
        rank: LoRA rank r.
        alpha: LoRA alpha; the update is scaled by alpha / r.
        target_modules: module-name suffixes to adapt; default :data:`DEFAULT_LORA_TARGETS`.
        dropout: dropout on the LoRA input.
        adapter_name: peft adapter name.
        adapter_dtype: dtype of the LoRA weights (peft would give them the base layer's dtype); float32 keeps
            optimizer updates exact on a bf16 base. None leaves peft's choice.

    Returns:
        The LoraConfig used (also kept in ``model.peft_config[adapter_name]``).

    Raises:
        ValueError: a target name matches no module, or the adapter name is taken.
    """
    base = _unwrap(model)
    targets = tuple(target_modules) if target_modules is not None else DEFAULT_LORA_TARGETS
    names = [name for name, _ in base.named_modules()]
    unmatched = [t for t in targets if not any(_matches(n, t) for n in names)]
    if unmatched:
        raise ValueError(f"LoRA target modules match nothing in {type(base).__name__}: {unmatched}")
    if adapter_name in getattr(base, "peft_config", {}):
        raise ValueError(f"the model already has an adapter named {adapter_name!r}")
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                        init_lora_weights=True)
    inject_adapter_in_model(config, base, adapter_name=adapter_name)
    # peft freezes the base already; stated here so the contract does not hang on a peft default.
    if adapter_dtype is not None:
        for layer in lora_layers(base):
            layer.lora_A[adapter_name].to(adapter_dtype)
            layer.lora_B[adapter_name].to(adapter_dtype)
    for name, param in base.named_parameters():
        param.requires_grad_(f".lora_A.{adapter_name}." in name or f".lora_B.{adapter_name}." in name)
    return config


def trainable_parameter_names(model: nn.Module) -> list[str]:
    """Sorted names of the parameters that require gradients."""
    return sorted(name for name, p in _unwrap(model).named_parameters() if p.requires_grad)


def set_trainable(model: nn.Module, mode: str) -> list[str]:
    """Choose what trains: ``"lora"`` (adapter weights only), ``"full"`` (everything; no adapter allowed) or
    ``"recammaster"`` (camera modules + self-attention, ReCamMaster's own recipe; no adapter allowed).

    Returns the trainable parameter names.
    """
    base = _unwrap(model)
    if mode == "lora":
        if not has_lora(base):
            raise ValueError("mode 'lora' needs an adapter; call add_lora first")
        for name, param in base.named_parameters():
            param.requires_grad_(".lora_A." in name or ".lora_B." in name)
    elif mode in ("full", "recammaster"):
        if has_lora(base):
            raise ValueError(f"mode {mode!r} trains base weights, but the model carries a LoRA adapter")
        for name, param in base.named_parameters():
            param.requires_grad_(mode == "full" or any(f".{key}." in name for key in RECAMMASTER_TRAINABLE))
    else:
        raise ValueError(f"unknown trainable mode {mode!r}; expected 'lora', 'full' or 'recammaster'")
    return trainable_parameter_names(base)


@contextlib.contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run the base network (the reference policy) inside the block; the adapter is back on exit.

    Run the reference forward under ``torch.no_grad()``: with gradient checkpointing a backward after the block
    would recompute the forward with the adapter enabled again.
    """
    layers = lora_layers(model)
    if not layers:
        raise ValueError("adapter_disabled needs a model with a LoRA adapter; a full fine-tune needs a separate "
                         "frozen reference copy")
    # peft's enable/disable also flips requires_grad of adapter weights; put the caller's flags back afterwards.
    grad_flags = {p: p.requires_grad for layer in layers for p in layer.parameters()}
    was_disabled = [layer.disable_adapters for layer in layers]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer, disabled in zip(layers, was_disabled, strict=True):
            layer.enable_adapters(not disabled)
        for param, flag in grad_flags.items():
            param.requires_grad_(flag)


AdapterKeys = collections.namedtuple("AdapterKeys", ["missing_keys", "unexpected_keys"])


def save_adapter(model: nn.Module, directory: str | Path, adapter_name: str = "default") -> Path:
    """Write the adapter (config JSON + safetensors weights, peft's key names) to ``directory``."""
    base = _unwrap(model)
    if adapter_name not in getattr(base, "peft_config", {}):
        raise ValueError(f"the model has no adapter named {adapter_name!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    from peft import get_peft_model_state_dict

    base.peft_config[adapter_name].save_pretrained(str(directory))
    # peft picks the adapter's entries by module name, and under FSDP the names carry FSDP's wrapper prefix while
    # state_dict()'s keys do not (it found none): give it the parameters under their module names, prefix removed
    # after. Without FSDP this is the state dict's own parameters.
    named = dict(base.named_parameters())
    state = {k.replace(FSDP_PREFIX, ""): v
             for k, v in get_peft_model_state_dict(base, state_dict=named, adapter_name=adapter_name).items()}
    if not state:
        raise ValueError(f"adapter {adapter_name!r} has no weights to save")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(directory / ADAPTER_WEIGHTS_NAME))
    return directory


def set_adapter_state(model: nn.Module, state: dict[str, torch.Tensor], adapter_name: str = "default"):
    """Load adapter weights in peft's saved key names into `model`'s adapter; returns the missing and unexpected
    keys (`.missing_keys`, `.unexpected_keys`, as load_state_dict's result has them).

    peft maps the names by module name, which under FSDP carry the wrapper's prefix (it mapped none). There the
    adapter's name goes into the keys directly (LoRA's one rename) and the values are copied into the parameters in
    place: FSDP's own load_state_dict hooks, inside its whole-weights context, left the optimizer stepping
    parameters the model no longer used (a resumed two-process run then never moved)."""
    base = _unwrap(model)
    if not any(FSDP_PREFIX in name for name, _ in base.named_modules()):
        from peft import set_peft_model_state_dict

        return set_peft_model_state_dict(base, state, adapter_name=adapter_name)
    named = {re.sub(r"\.(lora_[AB])\.", rf".\1.{adapter_name}.", k): v for k, v in state.items()}
    own = {k.replace(FSDP_PREFIX, ""): q for k, q in base.named_parameters() if ".lora_" in k}
    with torch.no_grad():
        for k, v in named.items():
            if k in own:
                own[k].copy_(v)
    return AdapterKeys([k for k in own if k not in named], [k for k in named if k not in own])


def load_adapter_weights(model: nn.Module, directory: str | Path, adapter_name: str = "default") -> None:
    """Read the weights :func:`save_adapter` wrote into the adapter `model` already has (same rank and targets).

    Raises:
        ValueError: the saved weights do not fill the adapter exactly (missing or unexpected keys).
    """
    directory = Path(directory)
    state = load_file(str(directory / ADAPTER_WEIGHTS_NAME))
    result = set_adapter_state(model, state, adapter_name)
    missing = [k for k in result.missing_keys if ".lora_A." in k or ".lora_B." in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"adapter in {directory} does not fit the model: missing {missing}, "
                         f"unexpected {list(result.unexpected_keys)}")


def load_adapter(model: nn.Module, directory: str | Path, adapter_name: str = "default",
                 trainable: bool = True) -> LoraConfig:
    """Inject the adapter saved by :func:`save_adapter` into a base model and load its weights.

    Raises:
        ValueError: the saved weights do not fill the injected adapter exactly (missing or unexpected keys).
    """
    base = _unwrap(model)
    directory = Path(directory)
    config_file = directory / ADAPTER_CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"no {ADAPTER_CONFIG_NAME} in {directory}")
    from peft import LoraConfig

    config = LoraConfig.from_pretrained(str(directory))
    if json.loads(config_file.read_text()).get("peft_type") != "LORA":
        raise ValueError(f"{config_file} is not a LoRA adapter config")
    add_lora(base, rank=config.r, alpha=config.lora_alpha, target_modules=sorted(config.target_modules),
             dropout=config.lora_dropout, adapter_name=adapter_name)
    load_adapter_weights(base, directory, adapter_name)
    if not trainable:
        for layer in lora_layers(base):
            for param in layer.parameters():
                param.requires_grad_(False)
    return base.peft_config[adapter_name]


def enable_memory_savers(model: nn.Module, gradient_checkpointing: bool, tf32: bool) -> dict[str, bool]:
    """Switch gradient checkpointing on the model and TF32 (CUDA) / HF32 (Ascend) matmuls, process-wide.

    Returns what was applied, e.g. ``{"gradient_checkpointing": True, "tf32": True, "npu_hf32": False}``.
    """
    from recam.infra.distributed import npu_available

    base = _unwrap(model)
    if not hasattr(base, "enable_gradient_checkpointing"):
        raise TypeError(f"{type(base).__name__} has no gradient checkpointing switch (needs a diffusers ModelMixin)")
    if gradient_checkpointing:
        base.enable_gradient_checkpointing()
    elif base.is_gradient_checkpointing:
        base.disable_gradient_checkpointing()

    # The legacy flags on purpose: accelerate and diffusers set and read them, and in torch >= 2.9 a flag set
    # through the new fp32_precision API makes those legacy reads raise.
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32

    npu_hf32 = False
    if npu_available():
        # Ascend's analogue of TF32 is HF32; torch_npu exposes it under torch.npu.
        torch.npu.matmul.allow_hf32 = tf32
        torch.npu.conv.allow_hf32 = tf32
        npu_hf32 = tf32
    return {"gradient_checkpointing": bool(base.is_gradient_checkpointing), "tf32": tf32, "npu_hf32": npu_hf32}
