"""Evaluation and checkpoint selection: deterministic samples of fixed conditions from fixed noise, scored by the
evaluation rewards, as eval/... (held-out), val/... (validation, which selects the reported checkpoint) and
train_eval/... (the first training conditions). Two evaluations of the same weights are equal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from recam.engine.advantages import PLACEBO_BANNER
from recam.engine.domain import decode
from recam.engine.rollout import deterministic_sample, noise_source
from recam.engine.selection import select_checkpoint
from recam.infra import reports
from recam.infra.checkpoint import SELECTED, point

TRAIN_PROBE_PREFIX = "train_eval"  # metrics of eval.num_train_conditions training conditions (not "train/": wandb's)


class FirstConditions(Sequence):
    """The first n conditions of a split, read through to the split itself (its own attributes included), so a
    domain collates them exactly as it collates the split."""

    def __init__(self, dataset, n: int):
        self.dataset, self.n = dataset, int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if not -self.n <= int(i) < self.n:
            raise IndexError(f"condition {i} of {self.n}")
        return self.dataset[int(i) % self.n]

    def __getattr__(self, name):
        if name == "dataset":  # not set yet (copy, unpickling): without this the lookup below would recurse
            raise AttributeError(name)
        return getattr(self.dataset, name)


class Evaluator:
    """Evaluates the weights in `model` (EMA weights when `ema` is given) on the run's fixed splits.

    eval_config: config.eval (batch_size, seed, num_videos, num_train_conditions, select_by, select_guard,
    select_max_drop); splits: the domain's (recam.engine.domain.Splits)."""

    def __init__(self, eval_config, domain, model, ema, scheduler, reward_fn, reward_names: tuple[str, ...],
                 splits, accelerator, log, run_dir: Path, autocast, sample_shape: tuple[int, ...],
                 net=None):
        self.e, self.domain, self.model, self.ema, self.scheduler = eval_config, domain, model, ema, scheduler
        self.net = model if net is None else net  # what forward passes go through (recam.infra.distributed)
        self.reward_fn, self.reward_names = reward_fn, reward_names
        self.heldout, self.val_set = splits.heldout, splits.val
        self.accelerator, self.log, self.run_dir, self.autocast = accelerator, log, run_dir, autocast
        self.sample_shape = sample_shape
        # the first N training conditions, evaluated like the held-out ones: whether the policy improves on the
        # conditions it trains on at all, which tells an optimisation problem from a generalisation one
        n_probe = min(eval_config.num_train_conditions, len(splits.train))
        self.train_probe = FirstConditions(splits.train, n_probe) if n_probe else None
        if eval_config.select_by and self.val_set is None:
            log.info(f"eval.select_by={eval_config.select_by!r} is ignored: this data has no validation split, so "
                     "the run reports its last epoch")

    def evaluate(self, tag: str, checkpoint: str, step: int, progress: dict) -> dict:
        """Held-out metrics (eval/...) and, when a checkpoint is to be selected, validation metrics (val/...) of
        the weights in memory, which are those of checkpoint folder `checkpoint` (epoch_NNNN)."""
        with ema_weights(self.ema, self.model):
            self.model.eval()
            out = self.evaluate_split(self.heldout, tag, "eval", self.run_dir / self.domain.examples_dir)
            if self.val_set is not None:
                out.update(self.evaluate_split(self.val_set, tag, "val", None))
            if self.train_probe is not None:
                out.update(self.evaluate_split(self.train_probe, tag, TRAIN_PROBE_PREFIX, None))
        # epoch = the last trained epoch, so resuming or rolling back keeps exactly that checkpoint's evaluations
        self.log.eval_record(tag, step, out, epoch=int(checkpoint.removeprefix("epoch_")) - 1,
                             checkpoint=checkpoint, progress=progress)
        return out

    @torch.no_grad()
    def evaluate_split(self, dataset, tag: str, prefix: str, examples_dir: Path | None) -> dict:
        """Deterministic sampling from fixed per-condition noise, rank-sharded; metrics as <prefix>/<name>."""
        e, acc = self.e, self.accelerator
        idx = list(range(acc.process_index, len(dataset), acc.num_processes))
        rows, items = [], []
        for start in tqdm(range(0, len(idx), e.batch_size), desc=f"{tag} {prefix}", leave=False,
                          disable=not self.log.enabled):
            chunk = idx[start:start + e.batch_size]
            batch = self.domain.collate(dataset, chunk)
            noise = noise_source([(e.seed, i) for i in chunk], 1, self.sample_shape, acc.device).draw(0)
            final = deterministic_sample(self.domain.denoiser(self.net, batch, self.autocast), noise, self.scheduler)
            decoded = decode(self.domain, final, batch)
            rows += self.score_rows(decoded, batch, chunk)
            items += self.split_items(decoded, batch, chunk)
            if acc.is_main_process and start == 0 and e.num_videos > 0 and examples_dir is not None:
                self.domain.write_examples(examples_dir / tag, batch, decoded, e.num_videos)
        return self.summarise_split(rows, items, prefix)

    def split_items(self, decoded, batch, chunk: list[int]) -> list[tuple[int, object]]:
        """(dataset index, item) per condition for the domain's optional split metrics (evaluation_items)."""
        fn = getattr(self.domain, "evaluation_items", None)
        return [] if fn is None else list(zip(chunk, fn(decoded, batch), strict=True))

    def summarise_split(self, rows: list[dict], items: list, prefix: str) -> dict:
        """Per-condition means of the rows, plus the domain's optional evaluation_metrics(items) over the whole split
        (every process's items in index order): metrics a mean over conditions cannot express, e.g. retrieval
        precision within pools of conditions, or a distance between the distributions of generated and real samples.
        A rows/<name> entry of evaluation_metrics is per condition in index order (None: no value), as the rows'."""
        out = reports.summarise_eval(sorted(gather_object(rows), key=lambda r: r["index"]), prefix)
        fn = getattr(self.domain, "evaluation_metrics", None)
        if fn is not None:
            every = [item for _, item in sorted(gather_object(items), key=lambda r: r[0])]
            for k, v in fn(every).items():
                if k.startswith("rows/"):  # per condition, in index order like the rows' own
                    out[f"rows/{prefix}/{k.removeprefix('rows/')}"] = [None if x is None else float(x) for x in v]
                else:
                    out[f"{prefix}/{k}"] = float(v)
        return out

    def score_rows(self, decoded: torch.Tensor, batch, chunk: list[int]) -> list[dict]:
        """One row per condition: its evaluation rewards and their per-sample numeric details, less wall times (an
        evaluation describes weights, and two evaluations of the same weights must be equal; the epoch records
        carry the rewards' costs)."""
        scores, details = self.reward_fn(decoded, batch.conditions)
        rows = []
        for n, i in enumerate(chunk):
            row = {"index": i, **{f"reward_{k}": float(v[n]) for k, v in scores.items()}}
            row.update({k: float(v[n]) for k, v in details.items() if torch.is_tensor(v) and v.ndim == 1
                        and not k.split("/")[-1].startswith("seconds")})
            rows.append(row)
        return rows

    def evaluate_references(self, step: int) -> dict:
        """The evaluation rewards of the held-out conditions' reference samples (the domain's optional
        `references(batch)`: for the camera domain the ground-truth clip, the reward's ceiling on this data, and the
        source clip, a camera that never moved to the target), as ref_<name>/... in one "reference" record per
        run: the yardsticks the policy's numbers are read against, and a check that each reward works on this
        data at all."""
        references = getattr(self.domain, "references", None)
        if references is None:
            return {}
        acc = self.accelerator
        idx = list(range(acc.process_index, len(self.heldout), acc.num_processes))
        rows: dict[str, list[dict]] = {}
        items: dict[str, list] = {}
        for start in range(0, len(idx), self.e.batch_size):
            chunk = idx[start:start + self.e.batch_size]
            batch = self.domain.collate(self.heldout, chunk)
            for name, samples in references(batch).items():
                rows.setdefault(name, []).extend(self.score_rows(samples, batch, chunk))
                items.setdefault(name, []).extend(self.split_items(samples, batch, chunk))
        summary = {}
        for name in sorted(rows):
            summary.update(self.summarise_split(rows[name], items[name], f"ref_{name}"))
        self.log.reference_record(step, summary)
        if summary:
            means = " ".join(f"{k} {reports.fmt_or_na(v, '.4f')}" for k, v in summary.items()
                             if k.endswith(("/reward_avg", "/cam_score", "/rot_err_sum", "/trans_err_sum",
                                            "/placed_fraction")))
            self.log.detail(f"references: {means}")
        return summary

    def skip_served_rewards(self) -> None:
        """After a reward server stopped the run, the final evaluation calls no server again (a dead one would cost
        its retries and timeouts on every batch): the served rewards are NaN there, and the log says so."""
        without = getattr(self.reward_fn, "without_served", None)
        served = self.reward_fn.served() if without is not None else []
        if served:
            self.reward_fn = without("not evaluated: a reward server stopped the run")
            self.log.info(f"the final evaluation skips {', '.join(served)} (served; a reward server stopped the "
                          "run): n/a in the summary")

    def selected(self) -> dict | None:
        """The evaluation record the run reports (eval.select_by on val/...), or None when it reports its end."""
        if self.val_set is None or not self.accelerator.is_main_process:  # only the main process reports
            return None
        e = self.e
        evals = self.log.read_evals()
        return evals[select_checkpoint(evals, f"val/{e.select_by}", f"val/{e.select_guard}" if e.select_guard else "",
                                       e.select_max_drop)]

    def report(self, eval_before: dict, eval_after: dict, selected: dict | None, checkpoints: Path, rollbacks: int,
               stopped_by: str | None, budget_stop: bool, placebo: bool = False) -> None:
        """summary.md and the run's reports (main process): the base against the reported checkpoint, the selected
        one (pointed to by checkpoints/selected) or the end's."""
        if selected is not None:
            point(checkpoints, SELECTED, selected["checkpoint"])
        paths = reports.write_reports(self.run_dir)
        reports.write_summary(self.log, eval_before, eval_after, extra_paths=paths,
                              note=None if budget_stop else stopped_by and f"stopped early: {stopped_by}",
                              budget=stopped_by if budget_stop else None, rollbacks=rollbacks, selected=selected,
                              selection=self.selection_rule() if selected else None, rows=self.domain.summary_rows,
                              rewards=self.reward_names, examples=self.run_dir / self.domain.examples_dir,
                              banner=PLACEBO_BANNER if placebo else None)

    def selection_rule(self) -> str:
        e = self.e
        guard = f", {e.select_guard} at most {e.select_max_drop:g} below the base's" if e.select_guard else ""
        return f"best validation {e.select_by} over {len(self.val_set)} validation conditions{guard}"


@contextlib.contextmanager
def ema_weights(ema, model):
    """Evaluate with the EMA weights when EMA is on, restoring the live weights afterwards."""
    if ema is None:
        yield
        return
    ema.store(model.parameters())
    ema.copy_to(model.parameters())
    try:
        yield
    finally:
        ema.restore(model.parameters())
