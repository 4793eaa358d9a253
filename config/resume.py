"""What a resumed run may change: the one list of config fields that may differ from the run's checkpoint.

A run resumed with a different config is a different run unless the difference only says how far it goes, where
it writes, how it is watched or how its servers are reached. Those fields are MUTABLE (exact names, or a prefix
ending in "."); every other field is fixed for the run's life, and a resume that changes one is refused, naming
the field and both values. docs/guide.md's table is this list (tests/test_checkpoint_integrity.py checks it).
"""

from __future__ import annotations

import json
from pathlib import Path

from recam.infra.checkpoint import RUN_CONFIG

ROOT = Path(__file__).resolve().parents[1]

MUTABLE = {
    "num_epochs": "how far the run goes",
    "max_train_seconds": "its training-time budget (cumulative over resumes)",
    "save_freq": "how often it checkpoints",
    "keep_checkpoints": "how many checkpoints it keeps",
    "resume": "whether it resumes",
    "run_dir": "where its folder is (a folder may move between machines)",
    "run_name": "its name in the logs",
    "num_threads": "CPU threads per process",
    "logging.": "where its logs go",
    "eval.freq": "how often it evaluates",
    "eval.every_seconds": "its evaluation time grid",
    "eval.batch_size": "conditions per evaluation forward",
    "eval.num_videos": "example videos written",
    "train.learning_rate": "the learning rate from the next step on",
    "train.noise_scale": "whether each update's gradient noise scale is measured (its running means are kept)",
    "health.action": "what the guard does on a critical finding",
    "health.max_rollbacks": "how many rollbacks the guard may make",
    "reward.async_workers": "reward threads",
    "reward.max_retries": "how often a failing reward is retried",
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
    "reward.cam.sfm.threads_per_worker": "threads per SfM process",
    "debug.": "fault injection for tests (the kill and blow-up switches)",
}


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


def differences(old: dict, new: dict) -> tuple[list[tuple], list[tuple]]:
    """(allowed, refused): (field, old value, new value) for every field whose value differs between the flat
    configs. A field only one of them records (added to the code since, or removed) is allowed: a new field's
    default keeps the old behaviour, a removed one is read by nothing, and the change is stated like any other."""
    old, new = flatten(old), flatten(new)
    allowed, refused = [], []
    for field in sorted(set(old) | set(new)):
        a, b = _unrooted(old.get(field, "(not recorded)")), _unrooted(new.get(field, "(not recorded)"))
        if a == b:
            continue
        one_sided = field not in old or field not in new
        (allowed if why_mutable(field) or one_sided else refused).append((field, a, b))
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
    fields = "; ".join(f"{f} is {_show(b)} here but {_show(a)} in the run" for f, a, b in refused)
    return (f"resume: {fields} ({source}); these are fixed for a run's life (docs/guide.md, 'What a resume may "
            "change'): set them back, or start a new run_dir")


def statement(field: str, old, new) -> str:
    """The line a resume says for a field it changes."""
    why = why_mutable(field) or "a field only one of the two configs records"
    return f"resuming with {field} {_show(old)} -> {_show(new)}: {why}"
