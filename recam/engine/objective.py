"""Objectives: how one micro-batch of stored samples becomes a loss. Registry OBJECTIVES, one interface.

An objective gets the micro-batch (states, sampling log-probs, advantages, which samples are kept), closures
for the policy and the reference, and a `backward(loss)` that accumulates gradients; it returns metrics per
backward pass. GRPO rescores each trained transition under the policy and applies a registered policy loss
with a registered KL estimator; a forward-process objective (DiffusionNFT, advantage-weighted matching)
registers here too and ignores the log-probs, so the trainer's loop never changes.

Class attributes tell the trainer what to collect (absent means False unless said otherwise):
  needs_log_probs (default True): sample with a stochastic window and store its states and log-probs; False: the
      whole trajectory is deterministic (T = 0), the micro-batch carries the final samples and (b, 1) advantages;
  needs_old_means: keep the sampling transitions' means (MicroBatch.old_means);
  needs_old_policy: keep a frozen, slowly averaged copy of the policy (MicroBatch.old_policy, train.old_policy_decay);
  samples_with_old_policy: rollouts are drawn by that old policy, not the policy (DiffusionNFT);
  needs_sampling_policy: the weights that drew the epoch's samples stay available, frozen, while the update moves the
      policy (MicroBatch.sampling_policy; the old policy itself when it samples).
Objectives outside this module (recam/engine/extensions/fast_objectives.py) register when `known_objectives()` is
called.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from recam.engine.losses import StepLossInputs, get_kl_estimator, loss_settings, registered_policy_loss
from recam.engine.rollout import rescore
from recam.infra.registry import registrar

OBJECTIVES: dict[str, type] = {}

# How GRPO weights its trained steps against each other (train.step_weighting):
#   "uniform": every trained step's loss counts alike (Flow-GRPO, DDPO);
#   "score_balanced": step j's loss is scaled by std_j / c_j (c_j = |d mean_j / d model output|, normalised to mean
#   1 over the trained steps), so that a unit change of the model output moves every step's log-prob by the same
#   expected amount. Unweighted, the log-prob gradient of step j grows like c_j / std_j: on a DDPM schedule the
#   last stochastic step (std ~ 0.006 against ~0.5 at the noisy end, motion_tiny_cpu) carries hundreds of times the
#   gradient of the noisy steps, and an update made for it is what the noisy steps get. In the spirit of
#   TempFlow-GRPO's noise-aware weighting (weights that grow with the step's noise), derived here from the step.
STEP_WEIGHTINGS = ("uniform", "score_balanced")


def register_objective(name: str):
    """Decorator adding an objective class cls(train_config, scheduler) to OBJECTIVES."""
    return registrar(OBJECTIVES, "objective", name)


def known_objectives() -> list[str]:
    """Registered objective names, after importing the modules that register more than this one does."""
    for module in _OBJECTIVE_MODULES:
        importlib.import_module(module)
    return sorted(OBJECTIVES)


def accumulating_backward(accelerator, policy, last_micro_batch: bool):
    """backward(loss, last_piece) for Objective.accumulate: gradients accumulate over timesteps and micro-batches;
    processes sync once per optimizer step, on the last piece of its last micro-batch."""
    def backward(loss, last_piece):
        sync = last_micro_batch and last_piece
        with contextlib.nullcontext() if sync else accelerator.no_sync(policy):
            accelerator.backward(loss)
    return backward


def build_objective(train_config, scheduler, model: torch.nn.Module):
    """The objective train.objective names, attached to the (unwrapped) policy `model`."""
    known_objectives()
    objective = OBJECTIVES[train_config.objective](train_config, scheduler)
    objective.attach(model)  # an objective's own weights (DiffusionNFT's, AWM's old policy)
    return objective


def objective_needs(name: str, attribute: str) -> bool:
    """An objective class's collection flag (needs_log_probs defaults to True, every other flag to False)."""
    known_objectives()
    return bool(getattr(OBJECTIVES[name], attribute, attribute == "needs_log_probs"))


# The built-in objectives registered outside this module (research extensions), named here and imported only when
# the registry is asked what it holds: the core's code never depends on them.
_OBJECTIVE_MODULES = ("recam.engine.extensions.fast_objectives",)


@dataclass
class MicroBatch:
    """Stored samples of one micro-batch on this process (b of them) and the closures to score them.

    states: (b, T + 1, *sample_shape) ((b, 0, ...) when T = 0); old_log_probs: (b, T); advantages: (b, T), (b, 1)
    when T = 0; sample_weight: (b,) each sample's weight in the optimizer step's loss (0: excluded); traj_ids:
    (b, 2) [dataset index, copy]; policy / reference: denoise(x, t) closures (reference None without a KL term);
    inner_epoch: pass over this epoch's samples (0 first).
    final: (b, *sample_shape) the final samples; old_policy: denoise(x, t) over the frozen old policy (objectives
    with needs_old_policy, else None); old_means: (b, T, *sample_shape) the sampling transitions' means
    (needs_old_means, else None); step_offset: the scheduler step of stored step 0 (the window's start), so
    stored transition j is scheduler step step_offset + j."""

    states: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    sample_weight: torch.Tensor
    traj_ids: torch.Tensor
    policy: Callable
    reference: Callable | None
    inner_epoch: int
    module: torch.nn.Module | None = None  # the unwrapped policy (for per-sample parameter gradients)
    policy_rows: Callable | None = None  # rows (slice) -> denoise(x, t) over `module` for those samples only
    element_mask: torch.Tensor | None = None  # (b, ...) the elements log-probs and KLs average over (padding: no)
    final: torch.Tensor | None = None
    old_policy: Callable | None = None
    old_means: torch.Tensor | None = None
    sampling_policy: Callable | None = None  # denoise(x, t) over the weights that drew these samples

    step_offset: int = 0
    epoch: int = 0  # the training epoch (keys per-epoch randomness such as forward-process re-noising)
    # optimizer steps applied to the policy since these samples were drawn: 0 = on-policy, every importance weight 1
    policy_updates: int = 0


class Objective:
    """What every objective shares: the collection flags' defaults and no weights of its own. An objective whose
    method keeps extra weights (an old policy: recam.engine.extensions.old_policy) overrides the methods below; the
    trainer calls them at the same points for every objective and never asks which one it runs."""

    needs_log_probs = True

    def attach(self, model: torch.nn.Module) -> None:
        """Called once with the (unwrapped) policy before the first epoch."""

    def sampling_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The weights this epoch samples with."""
        return model

    def frozen_models(self) -> dict[str, torch.nn.Module]:
        """MicroBatch field -> a frozen module whose denoiser the micro-batch carries (e.g. "old_policy")."""
        return {}

    def after_epoch(self, global_step: int) -> float | None:
        """After the epoch's update (its old policy's averaging weight, logged as old_policy_decay; None: none)."""
        return None

    def side_files(self) -> dict:
        """Checkpoint side files: name -> JSON-able state, sealed in the checkpoint's manifest."""
        return {}

    def load_side_files(self, folder, info) -> None:
        """Restore what side_files saved, from checkpoint folder `folder`."""

    def end_epoch(self) -> None:
        """After the epoch's last optimizer step (or a step the guard refused)."""

    def finish_step_metrics(self, metrics: dict) -> dict:
        """One optimizer step's metrics, averaged over its backward passes and processes, as they are logged and
        judged: an objective whose passes report sums that only the whole step can turn into a number computes it
        here (the EMA's variance ratio)."""
        return metrics


def step_weights(scheduler, start: int, T: int, mode: str) -> torch.Tensor:
    """(T,) float64 weights of the trained steps start .. start + T - 1, mean 1 (see STEP_WEIGHTINGS)."""
    if mode not in STEP_WEIGHTINGS:
        raise ValueError(f"step weighting must be one of {STEP_WEIGHTINGS}, got {mode!r}")
    if mode == "uniform" or T == 0:
        return torch.ones(T, dtype=torch.float64)
    raw = torch.tensor([scheduler.step_std(j) / scheduler.output_coefficient(j) for j in range(start, start + T)],
                       dtype=torch.float64)
    if not bool(torch.isfinite(raw).all()) or not bool((raw > 0).all()):
        raise ValueError(f"score_balanced step weights need stochastic steps with std > 0; steps {start}.."
                         f"{start + T - 1} give std / coefficient {raw.tolist()}")
    return raw / raw.mean()


@register_objective("grpo")
class GRPOObjective(Objective):
    """Clipped-ratio policy loss with a KL pull toward the reference, per trained transition; one backward per
    timestep so only one timestep's graph is alive at a time."""

    needs_log_probs = True

    def __init__(self, train_config, scheduler):
        t = train_config
        self.t, self.scheduler = t, scheduler
        entry = registered_policy_loss(t.policy_loss)
        self.policy_loss = entry.fn
        self.settings = loss_settings(t.policy_loss, t)
        self.kl_estimator = get_kl_estimator(t.kl_type)
        self.step_inputs = (entry.inputs or NoStepInputs)(t, scheduler)
        self._step_weights: dict[tuple[int, int], torch.Tensor] = {}

    def step_weights(self, start: int, T: int) -> torch.Tensor:
        """(T,) the loss weights of scheduler steps start .. start + T - 1 (train.step_weighting), mean 1."""
        key = (start, T)
        if key not in self._step_weights:
            self._step_weights[key] = step_weights(self.scheduler, start, T, self.t.step_weighting)
        return self._step_weights[key]

    def accumulate(self, mb: MicroBatch, backward: Callable[[torch.Tensor, bool], None]) -> list[dict]:
        """Backward of each trained timestep's loss / T (the step's loss averages its timesteps);
        backward(loss, last) lets the trainer sync gradients only after the last one. Returns the metrics of
        each timestep (detached)."""
        t, sched, T, k0 = self.t, self.scheduler, mb.old_log_probs.shape[1], mb.step_offset
        device = mb.states.device
        prepared = self.step_inputs.prepare(mb)
        weights = self.step_weights(k0, T).tolist()
        out = []
        for j in range(T):
            cur = rescore(mb.policy, mb.states, sched, j, mb.element_mask, k0)
            kl = None
            if mb.reference is not None:
                with torch.no_grad():
                    ref = rescore(mb.reference, mb.states, sched, j, mb.element_mask, k0)
                kl = self.kl_estimator(cur.mean, ref.mean, cur.std, mb.states[:, j + 1], mb.element_mask,
                                        getattr(sched, "reduction", "mean"))
            old = mb.old_log_probs[:, j].contiguous().to(device)
            inputs = StepLossInputs(cur.log_prob, old, mb.advantages[:, j].to(device), mb.sample_weight.to(device),
                                    kl, j, T, **self.step_inputs.step_tensors(prepared, j))
            loss, metrics = self.policy_loss(inputs, self.settings)
            metrics.update(prepared["metrics"])
            if mb.reference is not None:
                metrics["mean_log_prob_ref"] = ref.log_prob.mean()
            metrics["importance_weight_var"] = (cur.log_prob.detach() - old).clamp(
                -t.log_ratio_clamp, t.log_ratio_clamp).exp().var(unbiased=False)
            metrics["step_weight"] = torch.tensor(weights[j])
            backward(loss * weights[j] / T, j == T - 1)
            out.append({k: v.detach() for k, v in metrics.items()})
        return out

    def end_epoch(self) -> None:
        self.step_inputs.retire_epoch()  # this epoch's samples are retired with it

    # a loss's inputs class may predate these three methods (NoStepInputs states them): without one, it has nothing
    def finish_step_metrics(self, metrics: dict) -> dict:
        finish = getattr(self.step_inputs, "finish_step_metrics", None)
        return finish(metrics) if finish is not None else metrics

    def side_files(self) -> dict:
        files = getattr(self.step_inputs, "side_files", None)
        return files() if files is not None else {}

    def load_side_files(self, folder, info) -> None:
        load = getattr(self.step_inputs, "load_side_files", None)
        if load is not None:
            load(folder, info)


class NoStepInputs:
    """The extra inputs of a policy loss that reads only its timestep's own tensors: none. A loss registered with
    `inputs` (recam.engine.losses.register_policy_loss) gives a class with these methods, built once per run."""

    def __init__(self, train_config, scheduler):
        pass

    def prepare(self, mb: MicroBatch) -> dict:
        """Once per micro-batch, before its timesteps: what step_tensors reads; its "metrics" are logged with each
        timestep's."""
        return {"metrics": {}}

    def step_tensors(self, prepared: dict, j: int) -> dict:
        """The StepLossInputs fields of timestep j, by name."""
        return {}

    def retire_epoch(self) -> None:
        """After the epoch's last optimizer step: state kept per sample ends with the samples."""

    def finish_step_metrics(self, metrics: dict) -> dict:
        """An optimizer step's metrics (means over its passes and processes) as logged: sums reported by prepare's
        "metrics" become the step's numbers here (recam.engine.objective.Objective.finish_step_metrics)."""
        return metrics

    def side_files(self) -> dict:
        """Checkpoint side files (name -> JSON-able state) of state that outlives an epoch."""
        return {}

    def load_side_files(self, folder, info) -> None:
        """Restore what side_files saved, from checkpoint folder `folder`; info(line) tells the user."""
