"""Crash-safe checkpoints: written to a temporary folder, renamed into place, then `latest` is repointed.

A crash at any moment leaves the previous checkpoint and the `latest` pointer intact. A checkpoint holds the
policy (diffusers layout, safetensors), optimizer, optional EMA, and a JSON state (epoch, global step, sampler
position, RNG states, health flag).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

LATEST = "latest"
SELECTED = "selected"  # the checkpoint a run reports (chosen on validation conditions, see recam.engine.selection)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def write_model(model, directory: Path) -> None:
    """The policy's weights: the LoRA adapter alone when there is one, else the whole model (diffusers layout)."""
    from recam.infra.lora import has_lora, save_adapter

    if has_lora(model):
        save_adapter(model, directory)
    else:
        model.save_pretrained(directory, safe_serialization=True)


def read_model_into(model, directory: Path) -> None:
    """Load weights written by `write_model` into a live model of the same layout, in place."""
    from safetensors.torch import load_file

    from recam.infra.lora import ADAPTER_WEIGHTS_NAME, has_lora

    name = ADAPTER_WEIGHTS_NAME if has_lora(model) else "diffusion_pytorch_model.safetensors"
    path = directory / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the checkpoint does not match this run's model "
                                f"({'LoRA' if has_lora(model) else 'full fine-tuning'})")
    state = load_file(str(path))
    if has_lora(model):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, state)
        if result.unexpected_keys:
            raise ValueError(f"{path}: unexpected adapter keys {list(result.unexpected_keys)[:5]}")
    else:
        model.load_state_dict(state)


def save_checkpoint(ckpt_root: Path, name: str, model, optimizer, ema, state: dict, keep: int = 2,
                    protect: tuple[str, ...] = ()) -> Path:
    """Write checkpoint `name` under ckpt_root atomically and point `latest` at it; prune old ones."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_model(model, tmp / "model")
    torch.save({"optimizer": optimizer.state_dict(), "ema": ema.state_dict() if ema is not None else None,
                "rng": rng_state()}, tmp / "trainer.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    point_latest(ckpt_root, name)
    _prune(ckpt_root, keep, protect=(name, *protect))
    return final


def point(ckpt_root: Path, pointer: str, name: str) -> None:
    """Atomically make the pointer file `pointer` (e.g. LATEST, SELECTED) name checkpoint folder `name`."""
    pointer_tmp = ckpt_root / f".{pointer}.tmp"
    pointer_tmp.write_text(name)
    os.replace(pointer_tmp, ckpt_root / pointer)


def point_latest(ckpt_root: Path, name: str) -> None:
    """Atomically make `latest` name checkpoint folder `name`."""
    point(ckpt_root, LATEST, name)


def checkpoint_before(ckpt_root: Path, epoch: int) -> Path | None:
    """The newest intact epoch_NNNN folder with NNNN < epoch (epoch_NNNN holds the weights that sample epoch
    NNNN), or None."""
    older = [p for p in ckpt_root.glob("epoch_*") if p.is_dir() and (p / "state.json").exists()
             and (n := p.name.removeprefix("epoch_")).isdigit() and int(n) < epoch]
    return max(older, default=None)


def _prune(ckpt_root: Path, keep: int, protect: tuple[str, ...]) -> None:
    names = sorted(p.name for p in ckpt_root.glob("epoch_*") if p.is_dir())
    for old in names[:-keep] if keep > 0 else []:
        if old not in protect:
            shutil.rmtree(ckpt_root / old, ignore_errors=True)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The folder `latest` points to, or None for a fresh run. A dangling pointer is an error, not a restart."""
    pointer = ckpt_root / LATEST
    if not pointer.exists():
        return None
    target = ckpt_root / pointer.read_text().strip()
    if not (target / "state.json").exists():
        raise FileNotFoundError(f"{pointer} points to {target}, which holds no state.json: the checkpoint is "
                                "incomplete; point `latest` at an intact epoch_* folder or remove it")
    return target


def load_trainer_state(ckpt: Path) -> tuple[dict, dict]:
    """(state.json contents, trainer.pt contents) of a checkpoint folder, with errors naming the file."""
    try:
        state = json.loads((ckpt / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{ckpt / 'state.json'} is unreadable: {e}") from e
    try:
        trainer = torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing to the user
        raise ValueError(f"{ckpt / 'trainer.pt'} is unreadable: {e}") from e
    return state, trainer
