"""The extra weights of forward-process objectives (DiffusionNFT, advantage-weighted matching): an old policy, a
frozen copy of the policy averaged toward it after each epoch, and, for AWM, a snapshot of the weights that drew
the epoch's samples, frozen while the update moves the policy. They belong to the objective that needs them
(recam.engine.extensions.fast_objectives); the trainer only asks its objective which weights sample and which frozen
models its micro-batches carry, and saves what the objective hands it with each checkpoint.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path

import torch

from recam.engine.objective import Objective
from recam.infra.checkpoint import CheckpointCorrupt

OLD_POLICY = "old_policy.json"  # checkpoint side file: the old policy's trainable parameters, exact


class OldPolicy:
    """old <- d x old + (1 - d) x policy after each epoch, d = old_policy_decay_at(optimizer steps so far).

    samples_with_it: the epoch's rollouts are drawn by the old policy (DiffusionNFT); keep_sampling_snapshot: the
    weights that sampled stay available while the policy moves (AWM's old losses)."""

    def __init__(self, model: torch.nn.Module, decay: float, ramp: float, samples_with_it: bool,
                 keep_sampling_snapshot: bool, flat: int = 0):
        self.model, self.decay, self.ramp, self.samples_with_it = model, decay, ramp, samples_with_it
        self.flat = flat
        self.copy = copy.deepcopy(model).requires_grad_(False).eval()
        self.snapshot = None
        if keep_sampling_snapshot and not samples_with_it:
            self.snapshot = copy.deepcopy(model).requires_grad_(False).eval()

    def trainable(self, copy_of_policy: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A copy's parameters at the policy's trainable names (the frozen rest equals the policy's), detached."""
        params = dict(copy_of_policy.named_parameters())
        return {n: params[n].detach() for n, p in self.model.named_parameters() if p.requires_grad}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The old policy's copies of the trainable parameters."""
        return self.trainable(self.copy)

    def sampling_model(self) -> torch.nn.Module:
        """The weights this epoch samples with: the old policy when it samples, else the policy, whose weights are
        copied into the snapshot first when the objective needs them later."""
        if self.samples_with_it:
            return self.copy
        if self.snapshot is not None:
            blend_into(list(self.trainable(self.snapshot).values()), list(self.trainable(self.model).values()), 0.0)
        return self.model

    def frozen_models(self) -> dict[str, torch.nn.Module]:
        """MicroBatch field -> the frozen module its denoiser closes over."""
        out = {"old_policy": self.copy}
        sampler = self.copy if self.samples_with_it else self.snapshot
        if sampler is not None:
            out["sampling_policy"] = sampler
        return out

    def after_epoch(self, global_step: int) -> float:
        """Average the old policy toward the policy; returns the weight d used."""
        decay = old_policy_decay_at(global_step, self.decay, self.ramp, self.flat)
        blend_into(list(self.tensors().values()), list(self.trainable(self.model).values()), decay)
        return decay

    def side_files(self) -> dict:
        return {OLD_POLICY: {"decay": self.decay, "tensors": encode_tensors(self.tensors())}}

    def load(self, folder: Path, info) -> None:
        """The old policy as saved with checkpoint `folder` (its side file is sealed in the manifest); a checkpoint
        without one (written by a run without an old policy) starts it from the restored policy."""
        path = folder / OLD_POLICY
        old = self.tensors()
        if not path.exists():
            info(f"{folder} holds no {OLD_POLICY}: the old policy starts from the restored policy")
            live = dict(self.model.named_parameters())
            blend_into(list(old.values()), [live[n].detach() for n in old], 0.0)
            return
        try:
            saved = decode_tensors(json.loads(path.read_bytes())["tensors"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointCorrupt(f"{path} is unreadable ({type(e).__name__}: {e})") from e
        if sorted(saved) != sorted(old) or any(saved[n].shape != old[n].shape for n in old):
            raise CheckpointCorrupt(f"{path} does not hold this run's trainable parameters")
        if not all(torch.isfinite(v).all() for v in saved.values() if v.is_floating_point()):
            raise CheckpointCorrupt(f"{path} holds non-finite values")
        blend_into(list(old.values()), [saved[n] for n in old], 0.0)


class KeepsOldPolicy(Objective):
    """Base of an objective with an old policy: it is built when the objective is attached to the policy, from
    self.t (config.train: old_policy_decay, old_policy_decay_ramp, old_policy_decay_flat) and the class's
    samples_with_old_policy and needs_sampling_policy flags, and travels with every checkpoint."""

    needs_old_policy = True
    old: OldPolicy | None = None

    def attach(self, model: torch.nn.Module) -> None:
        self.old = OldPolicy(model, self.t.old_policy_decay, self.t.old_policy_decay_ramp,
                             getattr(self, "samples_with_old_policy", False),
                             getattr(self, "needs_sampling_policy", False), self.t.old_policy_decay_flat)

    def sampling_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.old.sampling_model()

    def frozen_models(self) -> dict[str, torch.nn.Module]:
        return self.old.frozen_models()

    def after_epoch(self, global_step: int) -> float:
        return self.old.after_epoch(global_step)

    def side_files(self) -> dict:
        return self.old.side_files()

    def load_side_files(self, folder, info) -> None:
        self.old.load(folder, info)


def old_policy_decay_at(step: int, decay: float, ramp: float, flat: int = 0) -> float:
    """The old policy's averaging weight after `step` optimizer steps: 0 for the first `flat` steps, then
    min(ramp x (step - flat), decay), DiffusionNFT's return_decay (train_nft_sd3.py L169-189: decay_type 1 is flat 0,
    ramp 0.001, cap 0.5; decay_type 2, its ocr preset, flat 75, ramp 0.0075, cap 0.999) and AWM's linear
    kl_ema_decay (ramp 0.001, cap 0.3), so that early on the old policy is the policy and it lags more as training
    settles; ramp 0 holds it at `decay` from the start."""
    if ramp <= 0:
        return float(decay)
    step = int(step)
    return 0.0 if step < int(flat) else min(float(ramp) * (step - int(flat)), float(decay))


def blend_into(old: list[torch.Tensor], new: list[torch.Tensor], decay: float) -> None:
    """old = decay * old + (1 - decay) * new, in place; decay 0 copies new exactly."""
    with torch.no_grad():
        for o, n in zip(old, new, strict=True):
            if decay == 0:
                o.copy_(n)
            else:
                o.mul_(decay).add_(n.to(o.dtype), alpha=1.0 - decay)


def encode_tensors(tensors: dict[str, torch.Tensor]) -> dict:
    """Tensors as JSON (dtype, shape, base64 of the raw bytes): exact, for a checkpoint's side files."""
    return {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                "base64": base64.b64encode(v.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
                .decode("ascii")}
            for k, v in tensors.items()}


def decode_tensors(encoded: dict) -> dict[str, torch.Tensor]:
    out = {}
    for k, e in encoded.items():
        raw, dtype = bytearray(base64.b64decode(e["base64"])), getattr(torch, e["dtype"])
        flat = torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
        out[k] = flat.reshape(e["shape"])
    return out
