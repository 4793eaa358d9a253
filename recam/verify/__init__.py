"""Independent verification, from its logs alone, that a GRPO run did what it claims.

Two sources are understood:
  * `metrics.jsonl` written by `recam.infra.runlog` (step / epoch / eval records);
  * plain-text training logs carrying `[GRPO Debug]` lines, as earlier GRPO codebases print them (the forms read
    are listed, with an example each, in `DEBUG_LOG_FORMS`; the table in docs/guide.md is built from it).

A check that could not be evaluated is never a pass. Every line that could not be read is listed with the reason;
an epoch whose sampling facts (gathered dataset indices, or counts per condition) were not read fails "could not
verify", and so does a log without any readable epoch.

Parsing turns text into plain Python data; every check is a function over that data (no I/O) returning a
`Check` with a status (pass / warn / fail), the numbers it compared and a short explanation. `render_markdown`
turns a `Report` into Markdown and `write_plots` is the only function here that writes files.

The verifier shares no code with the trainer it checks: it imports no torch and no recam module but
`recam.infra.schema` (names of metrics.jsonl fields, plain data). Modules, each depending only on those above it:

  core            PASS / WARN / FAIL, `Check`, `Unreadable`, `Report`, `worst`, small value helpers
  parse_metrics   metrics.jsonl parsing: `parse_jsonl`, `looks_like_jsonl`
  text_grammar    the tokenizer and value grammar of [GRPO Debug] text (Python / numpy / torch reprs)
  parse_text      [GRPO Debug] text logs into epochs of facts: `parse_debug_log`, `DEBUG_LOG_FORMS`, `TAG`
  advantages      group advantages recomputed in float64 numpy: `recompute_advantages`
  checks_shared   whole-run checks both sources share (unreadable lines, missing epochs) and the check guard
  checks_noise    the gradient noise scale's epoch fields against their definitions (`check_noise_scale`)
  checks_metrics  checks of metrics.jsonl records (`EPOCH_CHECKS`, step records) and `verify_metrics`
  checks_text     checks of [GRPO Debug] epochs and `verify_debug_log`
  report          `render_markdown` and the table of text-log forms (docs/guide.md) (`debug_log_forms_markdown`)
  plots           `write_plots`, PNG plots of a metrics.jsonl (matplotlib imported only when called)

Everything public is re-exported here: `from recam import verify; verify.parse_debug_log(text)`.
"""

from recam.verify.advantages import GroupStat, recompute_advantages
from recam.verify.checks_metrics import (
    EPOCH_CHECKS,
    EpochView,
    Settings,
    check_advantage_per_condition,
    check_advantage_recompute,
    check_advantage_shape,
    check_advantage_summary,
    check_batch_groups,
    check_condition_ids,
    check_config_arithmetic,
    check_count_per_condition,
    check_epoch_steps,
    check_excluded_samples,
    check_group_size,
    check_reward_finite,
    check_reward_gathered,
    check_reward_means,
    check_reward_shapes,
    check_reward_std_mean,
    check_sample_count,
    check_sampling_facts,
    check_step_records,
    check_trained_prompt_num,
    check_unique_conditions,
    check_zero_std_groups,
    settings_from_config,
    verify_metrics,
)
from recam.verify.checks_noise import check_noise_scale
from recam.verify.checks_shared import check_missing_epochs, check_unreadable
from recam.verify.checks_text import (
    check_debug_advantages,
    check_debug_condition_arithmetic,
    check_debug_condition_samples,
    check_debug_counts,
    check_debug_ranks,
    check_debug_reward_shapes,
    check_debug_sample_arithmetic,
    check_debug_sampling_facts,
    check_debug_shape,
    check_debug_unique,
    expected_samples,
    verify_debug_log,
)
from recam.verify.core import FAIL, PASS, WARN, Check, Report, Unreadable, worst
from recam.verify.parse_metrics import ParsedLog, looks_like_jsonl, parse_jsonl
from recam.verify.parse_text import (
    DEBUG_LOG_FORMS,
    RUN_SETTINGS,
    SAMPLING_FIELDS,
    TAG,
    DebugEpoch,
    DebugLog,
    has_debug_tag,
    parse_debug_log,
)
from recam.verify.plots import write_plots
from recam.verify.report import debug_log_forms_markdown, render_markdown

__all__ = [
    # core
    "PASS", "WARN", "FAIL", "Check", "Unreadable", "Report", "worst",
    # parsing
    "ParsedLog", "parse_jsonl", "looks_like_jsonl",
    "TAG", "DEBUG_LOG_FORMS", "SAMPLING_FIELDS", "RUN_SETTINGS", "DebugEpoch", "DebugLog", "parse_debug_log",
    "has_debug_tag",
    # advantages
    "GroupStat", "recompute_advantages",
    # checks
    "check_unreadable", "check_missing_epochs",
    "Settings", "settings_from_config", "EpochView", "EPOCH_CHECKS", "check_sampling_facts",
    "check_config_arithmetic", "check_sample_count", "check_unique_conditions", "check_count_per_condition",
    "check_condition_ids", "check_batch_groups", "check_reward_shapes", "check_reward_gathered",
    "check_reward_finite", "check_advantage_shape", "check_advantage_per_condition", "check_advantage_recompute",
    "check_advantage_summary", "check_zero_std_groups", "check_reward_means", "check_group_size",
    "check_trained_prompt_num", "check_reward_std_mean", "check_excluded_samples", "check_step_records",
    "check_epoch_steps", "verify_metrics", "check_noise_scale",
    "check_debug_sampling_facts", "check_debug_counts", "check_debug_unique", "check_debug_shape",
    "check_debug_condition_samples", "check_debug_advantages", "check_debug_ranks", "check_debug_sample_arithmetic",
    "check_debug_condition_arithmetic", "check_debug_reward_shapes", "expected_samples", "verify_debug_log",
    # report and plots
    "render_markdown", "debug_log_forms_markdown", "write_plots",
]
