"""GRPO post-training of a generator, top to bottom; the preset chooses the domain (config.domain).

    accelerate launch scripts/train_recam.py --config config/grpo.py:tiny_cpu [--config.train.beta=0.01]

Per epoch: sample k copies of each condition with log-probs -> score with the rewards -> gather across
processes -> group-relative advantages -> clipped-ratio policy updates with a KL pull toward the frozen
reference -> health guard -> checkpoint -> evaluate held-out conditions with deterministic sampling
(recam/engine/trainer.py). Exit status: 0 when the run ends, 143 / 130 when SIGTERM / SIGINT stopped it (one line
naming the last intact checkpoint; the same command resumes), 3 when it stopped early (reward server down, at
start or mid-run, the health guard, a full disk, or write permission lost mid-run: one line, `latest` then names
the last intact checkpoint and the same command resumes), 2 for an invalid config (a --config file that does not
load, a wandb_mode 'online' without an account included) or a run_dir that cannot hold a run (an entry of it that
is not what the run keeps there, or one no run writes, included), 4 when a resume finds no checkpoint it can trust
(every one corrupt, or its state disagreeing with the metrics log), 5 when another run holds the run_dir (one run
per folder: runlog.hold_run_dir); nothing is changed then. resume=False in a folder that holds a run moves
that run's checkpoints and records to <run_dir>/archive/<UTC time>/ first (runlog.archive_run).
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import gc
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recam.infra import stop_signals  # noqa: E402

stop_signals.install()  # before the heavy imports: a Ctrl-C during them is one line too

import numpy as np  # noqa: E402
import torch  # noqa: E402
from absl import app, flags  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from config import resume  # noqa: E402
from config.plugins import add_loss_settings, import_plugins  # noqa: E402
from config.validate import ConfigError, eval_report_rewards, validate, validate_files  # noqa: E402
from recam.domains import build_domain, domain_class, known_domains  # noqa: E402
from recam.engine.reward_runner import RewardServerDown  # noqa: E402
from recam.engine.trainer import GRPOTrainer  # noqa: E402
from recam.infra import runlog  # noqa: E402
from recam.infra.checkpoint import (  # noqa: E402
    CheckpointCorrupt,
    ResumeMismatch,
    is_disk_full,
    pointed_checkpoint,
    resumable_checkpoint,
)
from recam.infra.distributed import use_cpu_if_no_accelerator  # noqa: E402

FLAGS = flags.FLAGS
DEFAULT_PRESET = f"{ROOT / 'config' / 'grpo.py'}:tiny_cpu"  # absolute, so it loads from any working directory
# The command line ml_collections reads the preset and its --config.* overrides from: parse_flags fills it, without
# the reward weights (applied by `weigh_rewards`) and the settings of a plugin's policy loss (LOSS_SETTINGS).
CONFIG_ARGV: list[str] = []
config_flags.DEFINE_config_file("config", DEFAULT_PRESET, "Preset file:name plus overrides.", sys_argv=CONFIG_ARGV)
REWARD_WEIGHT = re.compile(r"^--?config\.reward\.weights\.([^=.]+)=(.*)$")
TRAIN_FIELD = re.compile(r"^--?config\.train\.([A-Za-z_]\w*)=(.*)$")
# --config.train.<field>=<value> of fields the preset lacks, {field: value}: set by config.plugins.add_loss_settings
# once the plugins are imported, when the chosen policy loss has made them fields.
LOSS_SETTINGS: dict[str, str] = {}


def without_traceback(message: str) -> str:
    """ml_collections puts the preset file's whole traceback into its flag error; what the user needs is where
    (the flag) and the exception's own message (e.g. "unknown preset 'nope' ...; known presets: [...]")."""
    head, sep, trace = str(message).partition("Traceback (most recent call last):")
    if not sep:
        return str(message)
    last = [line for line in trace.splitlines() if line.strip()][-1].strip()
    last = re.sub(r"^[\w.]+(Error|Exception): ", "", last)
    flag = re.match(r"\s*(flag --?config=\S+): ", head)
    return f"{flag.group(1)}: {last}" if flag else last


def config_error(message: str) -> None:
    """An invalid config: one line on stderr, exit status 2, no traceback."""
    print(f"config error: {' '.join(without_traceback(message).split())}", file=sys.stderr)
    sys.exit(2)


def load_preset(argv: list[str]):
    """(the preset argv names, as a string, and its ConfigDict without the overrides); the ConfigDict is the
    exception when the preset does not load."""
    flag = FLAGS["config"]
    preset = flag.default
    for i, arg in enumerate(argv):  # --config=file:name or --config file:name
        if re.match(r"^--?config=", arg):
            preset = arg.split("=", 1)[1]
        elif re.match(r"^--?config$", arg) and i + 1 < len(argv):
            preset = argv[i + 1]
    try:
        config = flag.parser.parse(preset) if isinstance(preset, str) else preset
        "train" in config  # noqa: B015 - ml_collections defers a file that does not load to the first look inside
        return preset, config
    except Exception as e:  # noqa: BLE001 - the caller says the preset does not load, or the flag parser does
        return preset, e


def unknown_override(argv: list[str]) -> str:
    """The first --config.<path> override whose path the preset does not have, named with what it does have."""
    preset, config = load_preset(argv)
    if isinstance(config, Exception):
        return f"--config={preset} does not load: {config}"
    for arg in argv:
        match = re.match(r"^--?config\.([^=]+)", arg)
        if not match:
            continue
        node, done = config, []
        for part in match.group(1).split("."):
            if not hasattr(node, "keys") or part not in node:
                where = ".".join(done) or "the config"
                known = sorted(node.keys()) if hasattr(node, "keys") else []
                close = difflib.get_close_matches(part, known, n=1)
                return (f"{match.group(1)} is not a config field: {where} has no {part!r}"
                        + (f" (did you mean {'.'.join([*done, close[0]])}?)" if close else "")
                        + (f"; it has {known}" if known else ""))
            node, done = node[part], [*done, part]
    return "an override names no config field"


def split_reward_weights(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """argv without its --config.reward.weights.<name>=<value> overrides, and those as {name: value}. A weight may
    name a reward the preset does not list (one a plugin registers), which ml_collections would refuse as an unknown
    field; whether the domain can score it is validation's question (config.validate.check_rewards)."""
    kept, weights = [], {}
    for arg in argv:
        match = REWARD_WEIGHT.match(arg)
        if match:
            weights[match.group(1)] = match.group(2)
        else:
            kept.append(arg)
    return kept, weights


def split_loss_settings(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """argv without its --config.train.<field>=<value> overrides of fields the preset lacks, and those as
    {field: value}. They may be settings of a policy loss a plugin registers, which become fields only once the
    plugin is imported (config.plugins.add_loss_settings), and ml_collections would refuse them as unknown now; a
    field that no loss makes is refused then, in one line."""
    _, preset = load_preset(argv)
    if isinstance(preset, Exception) or "train" not in preset:  # the flag parser reports it
        return argv, {}
    kept, settings = [], {}
    for arg in argv:
        match = TRAIN_FIELD.match(arg)
        if match and match.group(1) not in preset.train:
            settings[match.group(1)] = match.group(2)
        else:
            kept.append(arg)
    return kept, settings


def weigh_rewards(config, weights: dict[str, str]) -> None:
    """Set reward.weights.<name> for each command-line weight, adding the names the preset does not list."""
    for name, raw in weights.items():
        try:
            value = float(raw)
        except ValueError:
            config_error(f"reward.weights.{name}={raw!r} must be a number")
        with config.reward.weights.unlocked():
            config.reward.weights[name] = value


# No config field is nested deeper than a few sections; ml_collections parses an override's path recursively, and a
# path of thousands of parts ended in a RecursionError.
MAX_OVERRIDE_PARTS = 32


def check_override_paths(argv: list[str]) -> None:
    for arg in argv:
        match = re.match(r"^--?config\.([^=]*)", arg)
        if match and match.group(1).count(".") + 1 > MAX_OVERRIDE_PARTS:
            parts = match.group(1).split(".")
            config_error(f"--config.{'.'.join(parts[:3])}...: an override path of {len(parts)} parts; no config "
                         f"field is deeper than {MAX_OVERRIDE_PARTS}")


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, with a bad --config override reported by `config_error` instead of a traceback."""
    check_override_paths(argv)
    argv, weights = split_reward_weights(argv)
    if not any(re.match(r"^--?config(=|$)", arg) for arg in argv):  # so that the preset is parsed with CONFIG_ARGV
        argv = [argv[0], f"--config={DEFAULT_PRESET}", *argv[1:]]
    preset = load_preset(argv)[0]
    file = preset.split(":", 1)[0] if isinstance(preset, str) else None
    if file and not Path(file).is_file():
        config_error(f"--config={preset}: there is no preset file {file} (looked for from {os.getcwd()})")
    argv, settings = split_loss_settings(argv)
    LOSS_SETTINGS.clear()
    LOSS_SETTINGS.update(settings)
    CONFIG_ARGV[:] = argv
    try:
        rest = FLAGS(argv)
    except flags.Error as e:  # a value that does not parse as the field's type
        config_error(str(e))
    except (AttributeError, KeyError):  # ml_collections: an override of a field the preset does not have
        config_error(unknown_override(argv))
    except RecursionError:  # a value nested thousands deep ("[[[[...") that its parser recursed into
        config_error("an override's value is nested too deeply to parse")
    weigh_rewards(FLAGS.config, weights)
    return rest


def resolve_repo_paths(config) -> None:
    """Relative model and data paths that do not exist from the working directory but do from the repository
    root (the presets' defaults, e.g. checkpoints/recam_tiny_base) are read from the root, so a run can start
    anywhere; run_dir stays relative to where the user is."""
    for section, name in (("model", "pretrained"), ("model", "vae"), ("data", "root")):
        if section in config and name in config[section]:
            value = config[section][name]
            if value and not Path(value).is_absolute() and not Path(value).exists() and (ROOT / value).exists():
                config[section][name] = str(ROOT / value)


def preset_defaults(config) -> dict:
    """The named preset's own values, without the command line's overrides, with the chosen policy loss's defaults
    for the settings it brings: what a field the run's checkpoint does not record is held against on resume
    (config/resume.py)."""
    from recam.engine.losses import POLICY_LOSSES

    _, preset = load_preset(CONFIG_ARGV)
    out = {} if isinstance(preset, Exception) else json.loads(preset.to_json())
    settings = POLICY_LOSSES[config.train.policy_loss].fields()  # registered: validation checked it
    train = out.setdefault("train", {})
    train.update({k: v for k, v in json.loads(json.dumps(settings)).items() if k not in train})
    return out


def resume_changes(config, requested: dict) -> tuple[list[tuple], list[dict]]:
    """(the fields this start changes from the run's recorded config, the run's resume history with this start's
    changes added). A field fixed for the run's life (config/resume.py) that differs ends the start here, exit 2,
    before anything is written."""
    run_dir = Path(config.run_dir)
    try:
        newest = pointed_checkpoint(run_dir / "checkpoints") if config.resume else None
        # the config is read from the checkpoint the resume will take, once its manifest has vouched for it
        newest = resumable_checkpoint(run_dir / "checkpoints", newest) if newest is not None else None
    except CheckpointCorrupt:
        return [], []  # the start says why it cannot resume
    if newest is None:
        return [], []
    try:
        found = resume.recorded(newest, run_dir)
    except (OSError, ValueError, KeyError) as e:
        print(f"[recam] cannot resume: the run's recorded config is unreadable: {e}", file=sys.stderr, flush=True)
        sys.exit(4)
    if found is None:
        print(f"[recam] {run_dir} records no config: resuming without comparing configs", flush=True)
        return [], []
    old, history, source = found
    allowed, refused = resume.differences(old, requested, preset_defaults(config))
    if refused:
        config_error(resume.refusal(refused, source))
    change = {"checkpoint": newest.name, "changes": {f: [a, b] for f, a, b in allowed}}
    return allowed, history + [change] if allowed else history


def folder_examples(config) -> tuple[str, ...]:
    """The examples folders (Domain.examples_dir) the run folder may hold: this run's domain's, and that of the
    earlier run the folder's config.json records (resume=False after a run of another domain archives its examples)."""
    names = [config.domain]
    with contextlib.suppress(OSError, ValueError, AttributeError):  # no earlier run, or a config.json it garbled
        earlier = json.loads((Path(config.run_dir) / "config.json").read_text()).get("domain")
        if isinstance(earlier, str) and earlier != config.domain and earlier in known_domains():
            names.append(earlier)
    found = []
    for name in names:
        with contextlib.suppress(Exception):  # an earlier domain that no longer loads: its folder is named foreign
            found.append(domain_class(name).examples_dir)
    return tuple(dict.fromkeys(d for d in found if d))


def hold_run_dir(accelerator, run_dir: Path) -> str | None:
    """One run per folder: the main process takes the folder's lock (runlog.hold_run_dir) for the launch, whose
    ranks are one holder, and every rank learns whether it got it. A folder another run holds ends this start on
    every rank with exit status 5 and one line naming the folder and the holder's process, before anything is read
    for a resume or written. Returns the line to log when the file system cannot lock."""
    refusal = unlocked = None
    if accelerator.is_main_process:
        try:
            unlocked = runlog.hold_run_dir(run_dir)
        except runlog.RunDirBusy as e:
            refusal = str(e)
    busy = torch.tensor([refusal is not None], dtype=torch.long, device=accelerator.device)
    if accelerator.num_processes > 1:  # a flag, not the message: what crosses processes is a tensor
        busy = accelerator.gather(busy).max()
    if int(busy):
        if refusal:
            print(f"[recam] {refusal}", file=sys.stderr, flush=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        sys.exit(5)
    return unlocked


def write_denied(error: BaseException | None) -> OSError | None:
    """The OSError in `error`'s cause chain that is a write refused (permission taken away, a file system remounted
    read-only mid-run), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return error
        error = error.__cause__ or error.__context__
    return None


def stop_line(what: str, code: int, run_dir: Path, resume: str) -> None:
    """One line: what stopped the run, the checkpoint a resume starts from (`latest`, moved only once a checkpoint is
    whole) and `resume`; then exit `code` at once (os._exit): reward requests still in flight and a process group's
    teardown could otherwise hold the process past a scheduler's grace period, and every file a resume reads is
    whole (stop_signals, runlog's whole-line appends)."""
    try:
        newest = pointed_checkpoint(run_dir / "checkpoints")
    except (CheckpointCorrupt, OSError):
        newest = None
    where = f"the last intact checkpoint is {newest}" if newest else "no checkpoint was written yet"
    if int(os.environ.get("RANK", "0") or 0) == 0:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        print(f"[recam] {what}: {where}; {resume}", file=sys.stderr, flush=True)
    os._exit(code)


def stopped_by_signal(stop: stop_signals.StopSignal, run_dir: Path) -> None:
    """SIGTERM or SIGINT: one line naming the signal and the checkpoint a resume starts from, exit 128 + its
    number."""
    stop_line(f"stopped by {stop.name}", stop.exit_code, run_dir, "the same command resumes")


def main(_):
    config = FLAGS.config
    stop_signals.arm()
    try:
        train(config)
    except stop_signals.StopSignal as stop:
        stopped_by_signal(stop, Path(config.run_dir))
    except Exception as e:  # every write that finds the disk full ends here: one line, exit status 3
        if is_disk_full(e):
            runlog.stop_on_full_disk(e, Path(config.run_dir))
        denied = write_denied(e)
        if denied is None:
            raise
        stop_line(f"stopped: cannot write {denied.filename or config.run_dir} ({denied.strerror})", 3,
                  Path(config.run_dir), "restore write permission and run the same command to resume")


def train(config) -> None:
    requested = json.loads(config.to_json())  # as asked for, before repository paths are resolved on this machine
    resolve_repo_paths(config)
    # Validation comes first, before the Accelerator or any model: the process count is the launcher's WORLD_SIZE.
    num_processes = int(os.environ.get("WORLD_SIZE", "1") or 1)
    try:
        import_plugins(config)  # what they register (rewards, losses) is validated and used like the project's own
        added = add_loss_settings(config, LOSS_SETTINGS)  # a plugin loss's settings, and their command-line values
        derived = validate(config, num_processes)
        validate_files(config)  # paths, in_channels and sample shape against the checkpoint's config.json headers
    except ConfigError as e:
        config_error(str(e))
    # a plugin loss's settings are the run's config like any other field: sealed with it, and compared on resume
    requested["train"].update(json.loads(json.dumps({field: config.train[field] for field in added})))
    examples_dirs = folder_examples(config)
    problem = runlog.run_dir_problem(config.run_dir, examples_dirs)  # before anything is created or computed
    if problem:
        config_error(problem)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    use_cpu_if_no_accelerator()
    accelerator = Accelerator(mixed_precision=config.mixed_precision)
    if accelerator.num_processes != num_processes:  # a launcher that sets no WORLD_SIZE: check the real count
        try:
            derived = validate(config, accelerator.num_processes)
        except ConfigError as e:
            config_error(str(e))
    unlocked = hold_run_dir(accelerator, Path(config.run_dir))  # before the folder is read for a resume or archived
    changes, history = resume_changes(config, requested)
    archived = None
    if not config.resume and accelerator.is_main_process:
        archived = runlog.archive_run(Path(config.run_dir), examples_dirs)
    accelerator.wait_for_everyone()  # no process opens its log in the folder before the earlier run is out of it
    log = runlog.RunLog(Path(config.run_dir), config, enabled=accelerator.is_main_process)
    log.capture_logs(accelerator.process_index)
    if unlocked:
        log.info(unlocked)
    if archived:
        log.info(archived)
    log.detail(f"derived numbers: {json.dumps(derived.record())}")
    torch.manual_seed(config.seed)
    np.random.seed(config.seed)

    try:
        domain = build_domain(config, accelerator.device, log)
        trainer = GRPOTrainer(config, domain, accelerator, log, derived, eval_report_rewards(config))
        for field, old, new in changes:
            log.info(resume.statement(field, old, new))
        log.config_history(history)
        lr_scale = next((b / a for f, a, b in changes if f == "train.learning_rate"), 1.0)
        trainer.checkpoints.seal_config({"config": requested, "history": history}, lr_scale)
    except RewardServerDown as e:  # e.g. the UnifiedReward judge is unreachable: nothing was trained
        print(f"[recam] reward server down before training started: {e}", file=sys.stderr, flush=True)
        log.close()
        sys.exit(3)
    try:
        stopped_by = trainer.train()
    except (CheckpointCorrupt, ResumeMismatch) as e:  # nothing to resume from that can be trusted: nothing is changed
        print(f"[recam] cannot resume: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        log.close()
        sys.exit(4)

    log.close()  # a full disk its log met on the way is raised here, and ends the run in `main`
    # The DDP reducer must die before its process group, or gloo's teardown deadlocks on the GIL at exit.
    accelerator.free_memory()
    trainer = None
    gc.collect()
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if stopped_by:
        sys.exit(3)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
