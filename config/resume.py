"""What a resumed run may change: the one list of config fields that may differ from the run's checkpoint.

A run resumed with a different config is a different run unless the difference only says how far it goes, where
it writes, how it is watched, how its servers are reached or what memory and threads it uses. Those fields are
MUTABLE (exact names, or a prefix ending in "."); every other field is fixed for the run's life, and a resume that
changes one is refused, naming the field and both values. A mutable field whose change can still move the numbers
(a thread count's float roundings, the learning rate) says so in its entry, which is what the resume's one-line
notice repeats: a user never gets a different run without being told. docs/guide.md's table is this list
(tests/test_checkpoint_integrity.py checks it).

A reward weight the run does not record is weight 0 (the reward was not computed), and compared as such: a resume
that weights a new reward is refused like any other change of the rewards. Any other field only one side records
is allowed when the run does not record it and this start has it at the preset's default (a field added to the
code since: its default is what the run did), or when this start no longer has it (read by nothing); a field the
run does not record set to anything else is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from recam.infra.checkpoint import RUN_CONFIG

ROOT = Path(__file__).resolve().parents[1]

MUTABLE = {
    "num_epochs": "how far the run goes",
    "max_train_seconds": "its training-time budget (cumulative over resumes)",
    "save_freq": "how often it checkpoints (and so which epoch a guard's rollback returns to)",
    "keep_checkpoints": "how many checkpoints it keeps (and so whether a rollback after collapsed samples finds the "
                        "checkpoint before the one that drew them)",
    "resume": "whether it resumes",
    "trust_legacy_checkpoint": "whether a checkpoint holding a pickle may be read (and converted)",
    "run_dir": "where its folder is (a folder may move between machines)",
    "motion.world_cache": "where the synthetic motion world is cached (its items are the same bit for bit)",
    "run_name": "its name in the logs",
    "num_threads": "CPU threads per process (float sums split over another count of threads round differently, "
                   "about 1e-8: from here on the numbers are not bit-identical to an unchanged resume's)",
    "logging.": "where its logs go",
    "eval.freq": "how often it evaluates",
    "eval.every_seconds": "its evaluation time grid",
    "eval.batch_size": "conditions per evaluation forward (each condition keeps its noise, but batched kernels "
                       "round differently: evaluation metrics may differ in their last digits; training is unchanged)",
    "eval.num_videos": "example videos written",
    "eval.report_rewards": "rewards scored at evaluation beside the weighted ones (never trained on; the evaluations "
                           "from here on score the new set)",
    "data.cache_size": "decoded conditions kept in memory (the same conditions, read again or not)",
    "model.gradient_checkpointing": "memory against compute (activations recomputed in the backward pass: the "
                                    "same numbers)",
    "train.learning_rate": "the learning rate from the next step on",
    "train.noise_scale": "whether each update's gradient noise scale is measured (its running means are kept)",
    "health.action": "what the guard does on a critical finding (after one, rollback, warn and stop leave different "
                     "weights)",
    "health.max_rollbacks": "how many rollbacks the guard may make",
    "reward.async_workers": "reward threads",
    "reward.max_retries": "how often a failing reward is retried (fewer: more of a failing reward's samples "
                          "excluded)",
    "reward.retry_backoff_s": "the wait between retries",
    "reward.unified.base_url": "where the judge is served",
    "reward.unified.api_key_env": "the judge's key variable",
    "reward.unified.timeout_s": "the judge's timeout",
    "reward.unified.max_retries": "the judge's retries",
    "reward.unified.max_concurrency": "requests in flight to the judge",
    "reward.unified.check_model": "whether the judge's model name is checked",
    "reward.cam.served.base_url": "where the pose estimator is served",
    "reward.cam.served.api_key_env": "the estimator's key variable",
    "reward.cam.served.timeout_s": "the estimator's timeout",
    "reward.cam.served.max_retries": "the estimator's retries",
    "reward.cam.served.backoff_s": "the estimator's wait between retries",
    "reward.cam.served.max_concurrency": "requests in flight to the estimator",
    "reward.cam.served.check_health": "whether the estimator's health is checked",
    "reward.cam.sfm.workers": "SfM processes",
    "reward.cam.sfm.threads_per_worker": "threads per SfM process (COLMAP's threaded solves may round differently: "
                                         "the poses, and so cam_score, are not bit-identical to an unchanged resume's)",
    "reward.cam.sfm.timeout_s": "how long one video's SfM may take (one past it is not judged: retried, then "
                                "excluded, as with a server's timeout)",
    "debug.sigkill_at_step": "a test's kill switch (the run up to the kill is the unchanged run)",
}
# Not mutable, though debug fields: debug.inject_blowup_at_step moves the weights and debug.fail_reward_slots takes
# samples out of the advantages, so either, changed on resume, trains a different run.

NOT_RECORDED = "(not recorded)"
WEIGHTS = "reward.weights."  # a reward's weight; one the run does not record was 0 (not computed)


def why_mutable(field: str) -> str | None:
    """What changing `field` on resume changes (MUTABLE's entry for it), or None for a field fixed for the run."""
    return next((w for m, w in MUTABLE.items() if field == m or (m.endswith(".") and field.startswith(m))), None)


def flatten(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _unrooted(value):
    # a config.json written before RUN_CONFIG existed holds repository paths made absolute on its own machine
    if isinstance(value, str) and value.startswith(f"{ROOT}/"):
        return value[len(str(ROOT)) + 1:]
    return value


def differences(old: dict, new: dict, defaults: dict | None = None) -> tuple[list[tuple], list[tuple]]:
    """(allowed, refused): (field, old value, new value) for every field whose value differs between the flat
    configs, NOT_RECORDED standing for a side without it. defaults: the preset's own values (no override), which a
    field the run does not record must have here to be allowed (the module docstring says why)."""
    old, new, defaults = flatten(old), flatten(new), flatten(defaults or {})
    allowed, refused = [], []
    for field in sorted(set(old) | set(new)):
        missing = 0.0 if field.startswith(WEIGHTS) else NOT_RECORDED
        a, b = _unrooted(old.get(field, missing)), _unrooted(new.get(field, missing))
        if a == b:
            continue
        one_sided_ok = not field.startswith(WEIGHTS) and (
            field not in new or (field not in old and b == _unrooted(defaults.get(field, NOT_RECORDED))))
        ok = why_mutable(field) or one_sided_ok
        (allowed if ok else refused).append((field, a, b))
    return allowed, refused


def recorded(checkpoint: Path, run_dir: Path) -> tuple[dict, list, Path] | None:
    """The config a checkpoint's training ran under, its resume history and the file it came from: the
    checkpoint's own RUN_CONFIG, else (checkpoints from before it was sealed) the run folder's config.json."""
    sealed = checkpoint / RUN_CONFIG
    if sealed.is_file():
        data = json.loads(sealed.read_text())
        return data["config"], data.get("history", []), sealed
    legacy = run_dir / "config.json"
    if legacy.is_file():
        data = json.loads(legacy.read_text())
        history = data.pop("resume_history", [])
        return data, history, legacy
    return None


def _show(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def refusal(refused: list[tuple], source: Path) -> str:
    """One line naming each fixed field, its value in the run and here."""
    fields = "; ".join(f"{f} is {_show(b)} here but the run does not record it (a field added since may only be "
                       "taken at its default)" if a == NOT_RECORDED else f"{f} is {_show(b)} here but {_show(a)} in "
                       "the run" for f, a, b in refused)
    return (f"resume: {fields} ({source}); these are fixed for a run's life (docs/guide.md, 'What a resume may "
            "change'): set them back, or start a new run_dir")


def statement(field: str, old, new) -> str:
    """The line a resume says for a field it changes."""
    why = why_mutable(field) or ("a field the run does not record (added to the code since), at its default"
                                 if old == NOT_RECORDED else "a field this code no longer has (read by nothing)")
    return f"resuming with {field} {_show(old)} -> {_show(new)}: {why}"
