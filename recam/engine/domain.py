"""The seam between the engine and a domain (camera video re-rendering, human motion, toy problems).

The engine samples, scores, normalises, updates, guards, checkpoints and evaluates; everything that knows what
a sample *is* sits behind `Domain`. A domain is chosen by `config.domain` (registry DOMAINS) and built from the
config; the lookup that knows the built-in domains (recam.domains.domain_class) sits above the engine. Datasets are
sequences of conditions with stable string ids (`condition_id`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from recam.engine.containers import Batch
from recam.infra.registry import registrar

DOMAINS: dict[str, Callable[..., Domain]] = {}
# Exploration in a subspace (sample.noise_frequencies > 0), a research extension: named here and imported only when a
# run asks for it, so the core's code never depends on it.
_SUBSPACE_EXPLORATION = "recam.engine.extensions.noise_subspace"


def register_domain(name: str):
    """Decorator adding a domain class (or factory(config, device, log) -> Domain) to DOMAINS."""
    return registrar(DOMAINS, "domain", name)


@dataclass
class Splits:
    """train: the conditions sampled for GRPO; heldout: only measured; val: selects the reported checkpoint
    (None: the run reports its last epoch)."""

    train: Sequence
    heldout: Sequence
    val: Sequence | None


class Domain(Protocol):
    # the kind of sample `decode` returns (e.g. "video", "motion", "points"): the rewards a run may weight are the
    # ones registered as scoring that kind (rewards.register_reward(..., scores=...)); validation refuses the others
    sample_kind: str
    # (label, metric key) rows of the summary's before/after table, e.g. ("cam_score", "eval/cam_score")
    summary_rows: tuple[tuple[str, str], ...]
    # folder under run_dir for write_examples (e.g. "videos")
    examples_dir: str

    def datasets(self) -> Splits: ...

    def condition_id(self, dataset, i: int) -> str: ...

    def collate(self, dataset, indices: list[int], cache: dict | None = None) -> Batch:
        """The batch for these dataset indices; `cache` lives for one epoch and may hold work shared by a
        condition's k copies (e.g. its encoded source video)."""

    def build_policy(self) -> torch.nn.Module: ...

    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one sample in the space the scheduler works in (noise and stored states)."""

    def scheduler(self, device) -> Any:
        """The training scheduler (recam.engine.scheduler); the engine sets its trained steps from the run's
        StepPlan (with_train_steps), so a domain need not compute them."""

    def denoiser(self, model, batch: Batch, autocast, adapter_off: bool = False) -> Callable:
        """denoise(x, t) -> model output, conditioned on the batch. adapter_off: the LoRA policy's base
        network, i.e. the reference."""

    def decode(self, samples: torch.Tensor) -> torch.Tensor:
        """Final samples -> what the rewards see, on the CPU."""

    def reward_fn(self, weights: dict[str, float], report: tuple[str, ...] = ()) -> Callable:
        """fn(decoded, conditions) -> (scores name -> (b,), details); `report` rewards are computed but not
        weighted."""

    def hooks(self) -> list:
        """Domain-specific phase hooks (recam.engine.hooks.Hook), e.g. a discriminator trained on samples."""

    def write_examples(self, out_dir: Path, batch: Batch, decoded: torch.Tensor, n: int) -> None: ...

    # Optional: element_mask(batch) -> (b, ...) bool broadcastable to the samples, the elements that are real (a
    # motion padded to 196 frames is not real after its length); log-probs and KLs average over those only.
    # Optional: references(batch) -> {name: samples in decoded space}, reference samples scored once per run by the
    # evaluation rewards (Evaluator.evaluate_references), e.g. the ground truth, whose score is the reward's ceiling.
    # Optional: decode_batch(samples, batch) -> what the rewards see, used instead of decode when decoding needs the
    # batch (a motion padded to 196 frames is cut at its condition's length).
    # Optional: evaluation_items(decoded, batch) -> one picklable item per sample, and evaluation_metrics(items) ->
    # {name: float} over a whole evaluated split (every process's items, in dataset order), logged as
    # <prefix>/<name> beside the per-condition means: metrics over sets of samples, such as retrieval precision
    # within pools of conditions or a distance between generated and real distributions. An entry rows/<name> ->
    # [float | None per item] is per condition instead (logged as rows/<prefix>/<name>), for paired intervals.
    # Optional: principal_channels(n) -> (C, n) orthonormal directions over the channels (every sample axis but the
    # last), the ones the data varies in most; sample.noise_channels confines exploration noise to them.


def decode(domain, final: torch.Tensor, batch):
    """What the rewards see: the domain's optional decode_batch when decoding needs the batch (a padded motion is
    cut at its condition's length), else its decode."""
    fn = getattr(domain, "decode_batch", None)
    return fn(final, batch) if fn is not None else domain.decode(final)


def element_mask(domain, batch, device):
    """The elements of the batch's samples that log-probs and KLs average over (the domain's optional
    element_mask: padded motion frames are not real), on `device`; None = all."""
    fn = getattr(domain, "element_mask", None)
    mask = fn(batch) if fn is not None else None
    return None if mask is None else mask.to(device)


def exploration_scheduler(domain, domain_name: str, noise_frequencies: int, noise_channels: int, device):
    """The domain's scheduler, its stochastic steps' noise confined to a subspace when sample.noise_frequencies
    (and sample.noise_channels) ask for one."""
    scheduler = domain.scheduler(device)
    if not noise_frequencies:
        return scheduler
    subspace = importlib.import_module(_SUBSPACE_EXPLORATION)
    return subspace.subspace_scheduler(scheduler, domain, domain_name, noise_frequencies, noise_channels)
