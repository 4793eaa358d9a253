import importlib.util
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from config.base import get_config
from recam import verify
from recam.engine.advantages import broadcast_over_timesteps, group_advantages
from recam.engine.records import epoch_line, verification_record
from recam.engine.reward_runner import exclusion_mask, masked_group_advantages
from recam.engine.sampler import global_batch_indices
from recam.infra import reports, runlog

P, BS, NB, K, T = 2, 4, 2, 4, 3  # 16 samples = 4 conditions x k=4 per epoch
N = P * BS * NB
EPOCHS = 3
STEPS_PER_EPOCH = 2
ROOT = Path(__file__).resolve().parents[1]


def _load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


verify_script = _load_script("verify_grpo_log")


def _derived():
    return {"num_processes": P, "per_device_batch": BS, "k": K, "num_batches_per_epoch": NB,
            "samples_per_batch": P * BS, "conditions_per_batch": P * BS // K, "samples_per_epoch": N,
            "unique_conditions_per_epoch": N // K, "num_train_timesteps": T}


def _gathered_indices(epoch):
    # What accelerator.gather returns: each rank's batches concatenated, ranks in order.
    per_rank = [[] for _ in range(P)]
    for b in range(NB):
        g = global_batch_indices(64, P * BS // K, K, 0, epoch, b, NB)
        for r in range(P):
            per_rank[r] += g[r * BS:(r + 1) * BS].tolist()
    return torch.tensor(sum(per_rank, []))


def _step_metrics(step):
    return {"loss": 0.01 * (-1) ** step, "policy_loss": 0.009, "kl_penalty": 1e-4 * step, "mean_ratio": 1.0002,
            "ratio_min": 0.999, "ratio_max": 1.001, "clipfrac": 0.05, "clipfrac_high": 0.03, "clipfrac_low": 0.02,
            "approx_kl": 1e-7, "mean_log_prob_current": 1.3, "mean_log_prob_old": 1.3, "mean_log_prob_ref": 1.29,
            "mean_advantage": 1e-9, "grad_norm": 0.4, "learning_rate": 1e-4}


def make_epoch(epoch, step, failed=(), policy="sample"):
    """A correct epoch record, built with the trainer's own functions; one group has all-equal rewards.

    failed: sample positions whose judge reward failed (NaN, so avg is NaN too), excluded as the trainer excludes
    them (exclusion_mask with `policy`, then masked_group_advantages)."""
    idx = _gathered_indices(epoch)
    gen = torch.Generator().manual_seed(epoch)
    cam = torch.rand(N, generator=gen)
    fid = torch.rand(N, generator=gen)
    judge = torch.rand(N, generator=gen)
    cam[idx == idx[0]] = 0.5
    fid[idx == idx[0]] = 0.25
    judge[idx == idx[0]] = 0.75
    judge[list(failed)] = float("nan")
    rewards = {"avg": (cam + 0.5 * fid + judge) / 2.5, "cam_score": cam, "fidelity": fid, "unifiedscore": judge}
    keep, exclusion = exclusion_mask(torch.isfinite(rewards["avg"]), idx, policy)
    adv, _, stats = masked_group_advantages(rewards["avg"], idx, keep)
    ids = [f"scene{i // 4:03d}/traj{i % 4}" for i in idx.tolist()]
    rec = verification_record(epoch, step, _derived(), ids, idx, rewards, broadcast_over_timesteps(adv, T), stats,
                              0.1)
    rec["excluded"] = (~keep).tolist()
    rec.update(exclusion)
    return {"type": "epoch", **rec}


def make_records(epochs=EPOCHS):
    out, step = [], 0
    out.append({"type": "eval", "tag": "start", "step": 0, "eval/cam_score": 0.4})
    for e in range(epochs):
        rec = make_epoch(e, step)
        steps = []
        for _ in range(STEPS_PER_EPOCH):
            step += 1
            m = _step_metrics(step)
            out.append({"type": "step", "step": step, "epoch": e, **m})
            steps.append(m)
        rec["optimizer_steps"] = steps
        rec["first_step_ratio_deviation"] = 2e-4
        rec["epoch_seconds"] = 1.5
        out.append(rec)
    return out


def write_run(tmp_path, records, tail=""):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    c = get_config()
    c.sample.batch_size, c.sample.k, c.sample.num_batches_per_epoch, c.train.batch_size = BS, K, NB, BS
    (run / "config.json").write_text(c.to_json(indent=1))
    return run


def report_of(records, tail="", config=None):
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    return verify.verify_metrics(verify.parse_jsonl(text), config)


def epoch_rec(records, e):
    return next(r for r in records if r.get("type") == "epoch" and r["epoch"] == e)


def status(report, name, epoch=None):
    found = report.find(name, epoch)
    assert len(found) == 1, f"{name} epoch {epoch}: {found}"
    return found[0]


# ---------------------------------------------------------------------------------------------------------


def test_correct_log_passes_every_check_via_script(tmp_path, capsys):
    run = write_run(tmp_path, make_records())
    out = tmp_path / "report" / "verify.md"
    assert verify_script.main([str(run), "--out", str(out)]) == 0
    text = out.read_text()
    assert "**Result: PASS**" in text
    for png in ("verify_rewards.png", "verify_advantages.png", "verify_ratio_kl.png"):
        assert (out.parent / png).stat().st_size > 1000
        assert f"]({png})" in text
    assert "PASS" in capsys.readouterr().out


def test_correct_log_every_check_passes_per_epoch():
    records = make_records()
    c = get_config()
    c.sample.batch_size, c.sample.k, c.sample.num_batches_per_epoch = BS, K, NB
    report = report_of(records, config=json.loads(c.to_json()))
    bad = [(c.name, c.epoch, c.detail) for c in report.checks if c.status != verify.PASS]
    assert bad == []
    assert report.epochs == [0, 1, 2]
    per_epoch = {c.name for c in report.checks if c.epoch == 1}
    assert {fn.__name__[len("check_"):] for fn in verify.EPOCH_CHECKS} | {"epoch_step"} == per_epoch
    zero = status(report, "zero_std_groups", 0)
    assert zero.numbers["zero_std_groups"] == 1 and zero.numbers["zero_std_ratio"] == pytest.approx(0.25)
    table = status(report, "advantage_per_condition", 0).table
    assert len(table) == N // K and all(r["samples"] == K for r in table)
    assert sum(r["note"] == "zero-std group: all 0" for r in table) == 1


def test_condition_with_three_copies_fails_count_per_condition():
    records = make_records()
    rec = epoch_rec(records, 1)
    victim = rec["dataset_indices"][0]
    rec["dataset_indices"][0] = 999
    rec["condition_ids"][0] = "scene999/traj0"
    report = report_of(records)
    c = status(report, "count_per_condition", 1)
    assert c.status == verify.FAIL
    assert c.numbers["offender_counts"] == {str(victim): 3, "999": 1} or c.numbers["offender_counts"] == {
        "999": 1, str(victim): 3}
    assert f"{victim}" in c.detail and ": 3" in c.detail
    assert status(report, "unique_conditions", 1).status == verify.FAIL
    assert status(report, "count_per_condition", 0).status == verify.PASS


def test_wrong_group_size_fails_only_group_size():
    records = make_records()
    epoch_rec(records, 2)["group_size"] = 3.0
    report = report_of(records)
    failing = [(c.name, c.epoch) for c in report.failing()]
    assert failing == [("group_size", 2)]
    assert status(report, "group_size", 2).numbers["logged_group_size"] == 3.0


def test_group_with_half_std_advantages_fails():
    records = make_records()
    rec = epoch_rec(records, 0)
    idx = np.array(rec["dataset_indices"])
    constant = rec["dataset_indices"][0]
    target = next(int(i) for i in idx if i != constant)
    adv = np.array(rec["advantages"])
    adv[idx == target] *= 0.5
    rec["advantages"] = adv.tolist()
    rec["advantage_per_condition"][str(target)]["std"] = float(adv[idx == target, 0].std())
    report = report_of(records)
    c = status(report, "advantage_per_condition", 0)
    assert c.status == verify.FAIL
    row = next(r for r in c.table if r["condition"] == target)
    assert row["status"] == verify.FAIL and row["std"] == pytest.approx(0.5, abs=1e-3)
    assert all(r["status"] == verify.PASS for r in c.table if r["condition"] != target)
    rc = status(report, "advantage_recompute", 0)
    assert rc.status == verify.FAIL and rc.numbers["samples_off"] == K
    assert status(report, "advantage_summary", 0).status == verify.PASS  # the summary matches the bad array
    md = verify.render_markdown(report)
    assert f"| {target} |" in md and "| FAIL | std 0.499" in md


def test_missing_epoch_fails():
    records = [r for r in make_records(4) if r.get("epoch") != 1]
    report = report_of(records)
    c = status(report, "missing_epochs")
    assert c.status == verify.FAIL and c.numbers["missing"] == [1]
    assert report.epochs == [0, 2, 3]


def test_an_absurd_epoch_number_fails_missing_epochs_without_building_its_range():
    # epoch 1e18 made the missing-epochs check build range(1e18 + 1): the verifier was killed for memory
    records = make_records(2)
    next(r for r in records if r.get("type") == "epoch" and r["epoch"] == 1)["epoch"] = 10 ** 18
    c = status(report_of(records), "missing_epochs")
    assert c.status == verify.FAIL and c.numbers["missing"] == list(range(1, 13))
    assert c.numbers["missing_count"] == 10 ** 18 - 1 and "(+999999999999999987) have no epoch record" in c.detail


def test_torn_epoch_record_fails_its_epoch_and_the_rest_is_verified(tmp_path, capsys):
    # A torn epoch record is an epoch whose samples nobody can check: it fails "could not verify" (it used to
    # be a warning with exit 0), while the epochs before it are still verified and pass.
    records = make_records()
    extra = make_epoch(EPOCHS, EPOCHS * STEPS_PER_EPOCH)
    steps = [{"type": "step", "step": EPOCHS * STEPS_PER_EPOCH + 1, "epoch": EPOCHS,
              **_step_metrics(EPOCHS * STEPS_PER_EPOCH + 1)}]
    torn = json.dumps(extra)[:300]
    run = write_run(tmp_path, records + steps, tail=torn)
    n_lines = len(records) + len(steps) + 1
    out = tmp_path / "r.md"
    assert verify_script.main([str(run), "--out", str(out), "--no-plots"]) == 1
    report, _ = verify_script.build_report(run, 1e-3)
    c = status(report, "unreadable_lines")
    assert c.status == verify.WARN and c.numbers["lines"] == [n_lines]
    assert report.unreadable[0].reason.startswith("torn last line")
    lost = status(report, "epoch_record", EPOCHS)
    assert lost.status == verify.FAIL and lost.detail.startswith(f"could not verify epoch {EPOCHS}")
    missing = status(report, "missing_epochs")
    assert missing.status == verify.FAIL and missing.numbers["steps_without_epoch_record"] == [EPOCHS]
    assert {(c.name, c.epoch) for c in report.failing()} == {("epoch_record", EPOCHS), ("missing_epochs", None)}
    assert f"line {n_lines}: torn last line" in out.read_text()
    assert f"could not read line(s): {n_lines}" in capsys.readouterr().out


def test_torn_eval_record_is_only_a_warning(tmp_path):
    records = make_records()
    torn = json.dumps({"type": "eval", "tag": "end", "step": EPOCHS * STEPS_PER_EPOCH, "eval/cam_score": 0.5})[:40]
    run = write_run(tmp_path, records, tail=torn)
    assert verify_script.main([str(run), "--out", str(tmp_path / "r.md"), "--no-plots"]) == 0
    report, _ = verify_script.build_report(run, 1e-3)
    assert report.status == verify.WARN and status(report, "unreadable_lines").status == verify.WARN


def test_epoch_record_without_dataset_indices_fails_could_not_verify(tmp_path):
    records = make_records()
    del epoch_rec(records, 1)["dataset_indices"]
    epoch_rec(records, 2)["dataset_indices"] = "[3 5 ... 7]"
    run = write_run(tmp_path, records)
    assert verify_script.main([str(run), "--out", str(tmp_path / "r.md"), "--no-plots"]) == 1
    report, _ = verify_script.build_report(run, 1e-3)
    for e, why in ((1, "not logged"), (2, "not a list of integers")):
        c = status(report, "sampling_facts", e)
        assert c.status == verify.FAIL and c.detail.startswith("could not verify") and why in c.detail
        assert status(report, "count_per_condition", e).status == verify.FAIL
    assert status(report, "sampling_facts", 0).status == verify.PASS


def test_corrupt_middle_line_is_listed_and_later_epochs_still_verified():
    records = make_records()
    text = "".join(json.dumps(r) + "\n" for r in records)
    lines = text.splitlines()
    lines.insert(3, '{"type": "step", "step": 1, "loss": nan}\x00\x00')
    report = verify.verify_metrics(verify.parse_jsonl("\n".join(lines) + "\n"))
    assert [u.line for u in report.unreadable] == [4]
    assert "not valid JSON" in report.unreadable[0].reason
    assert status(report, "count_per_condition", 2).status == verify.PASS


def test_malformed_fields_fail_checks_instead_of_raising():
    records = make_records()
    rec = epoch_rec(records, 0)
    rec["advantages"] = "oops"
    rec["rewards/avg"] = [[1.0, 2.0], [3.0]]
    rec["k"] = "four"
    report = report_of(records)
    assert status(report, "advantage_shape", 0).status == verify.FAIL
    assert status(report, "reward_shapes", 0).status == verify.FAIL
    assert "ragged" in status(report, "reward_shapes", 0).detail
    assert status(report, "config_arithmetic", 0).status == verify.FAIL
    assert status(report, "count_per_condition", 1).status == verify.PASS
    verify.render_markdown(report)


def test_wrong_logged_reward_mean_and_ungathered_rewards_fail():
    records = make_records()
    epoch_rec(records, 0)["reward_cam_score"] += 0.1
    rec = epoch_rec(records, 1)
    rec["rewards/fidelity"] = rec["rewards/fidelity"][: N // P]
    report = report_of(records)
    assert "reward_cam_score" in status(report, "reward_means", 0).detail
    gathered = status(report, "reward_gathered", 1)
    assert gathered.status == verify.FAIL and "one process's share" in gathered.detail


def test_epoch_step_must_be_global_step():
    records = make_records()
    epoch_rec(records, 2)["step"] = 2
    report = report_of(records)
    assert status(report, "epoch_step", 2).status == verify.FAIL
    assert status(report, "epoch_step", 1).status == verify.PASS


def test_a_step_metric_that_is_not_a_number_fails_step_records():
    # each of these passed: the numeric checks skipped what was not a number
    records = make_records()
    next(r for r in records if r["type"] == "step" and r["step"] == 2).update(loss=True, grad_norm="0.4")
    epoch_rec(records, 1)["optimizer_steps"] = "2 steps"
    c = status(report_of(records), "step_records")
    assert c.status == verify.FAIL
    assert "2 step record field(s) not a number: step 2 loss, step 2 grad_norm" in c.detail
    assert "epoch(s) 1 store optimizer_steps that are not a list" in c.detail


def test_a_non_finite_step_loss_fails_step_records(tmp_path, capsys):
    # this passed: NaN is a float, so the step's fields were all numbers (diagnose called it CRITICAL)
    records = make_records()
    next(r for r in records if r["type"] == "step" and r["step"] == 3).update(loss=math.nan)
    run = write_run(tmp_path, records)
    assert verify_script.main([str(run), "--out", str(tmp_path / "r.md"), "--no-plots"]) == 1
    out = capsys.readouterr().out
    assert "FAIL step_records [run]: 1 step record value(s) NaN or infinite: step 3 loss" in out


def test_a_run_without_step_records_fails(tmp_path, capsys):
    records = [r for r in make_records() if r["type"] != "step"]
    run = write_run(tmp_path, records)
    assert verify_script.main([str(run), "--out", str(tmp_path / "r.md"), "--no-plots"]) == 1
    out = capsys.readouterr().out
    assert "FAIL step_records [run]: no step record for 3 epoch record(s) storing 6 optimizer step(s)" in out
    # epochs that each say they took no optimizer step: consistent, but the run trained nothing
    for r in records:
        if r["type"] == "epoch":
            r["optimizer_steps"] = []
    c = status(report_of(records), "step_records")
    assert c.status == verify.FAIL and "nothing was trained" in c.detail


def test_missing_input_is_a_parse_failure_not_a_traceback(tmp_path, capsys):
    out = tmp_path / "r.md"
    assert verify_script.main([str(tmp_path / "nope"), "--out", str(out)]) == 2  # exit 2: no such file
    assert "parse" in out.read_text() and "FAIL" in out.read_text()
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert verify_script.main([str(empty), "--out", str(out)]) == 2


@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("std_mode", ["group", "global", "none"])
def test_recompute_matches_trainer(std_mode, unbiased):
    g = torch.Generator().manual_seed(3)
    r = torch.rand(24, generator=g)
    ids = torch.arange(6).repeat_interleave(4)[torch.randperm(24, generator=g)]
    r[ids == 2] = 0.7
    want, _ = group_advantages(r, ids, std_mode, unbiased=unbiased)
    got, stats = verify.recompute_advantages(r.tolist(), ids.numpy(), std_mode, unbiased=unbiased)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-6)
    assert stats[2].constant and not stats[0].constant and stats[0].count == 4


def test_small_reward_std_is_a_warning_not_a_failure():
    records = make_records(1)
    rec = epoch_rec(records, 0)
    idx = torch.tensor(rec["dataset_indices"])
    avg = torch.tensor([row[0] for row in rec["rewards/avg"]])
    target = int(idx[-1])
    avg[idx == target] = 0.5 + 1e-4 * torch.arange(K, dtype=torch.float32)  # reward std ~1e-4 ~ eps
    adv, stats = group_advantages(avg, idx)
    rec["rewards/avg"] = avg[:, None].expand(-1, T).tolist()
    rec["reward_avg"] = float(avg.mean())
    rec["reward_std_mean"] = float(stats["reward_std_mean"])
    rec["advantages"] = broadcast_over_timesteps(adv, T).tolist()
    rec["advantage_per_condition"][str(target)]["std"] = float(adv[idx == target].double().std(unbiased=False))
    report = report_of(records)
    c = status(report, "advantage_per_condition", 0)
    assert c.status == verify.WARN and "eps" in next(r for r in c.table if r["condition"] == target)["note"]
    assert status(report, "advantage_recompute", 0).status == verify.PASS


# ---------------------------------------------------------------------------------------------------------
# [GRPO Debug] text logs


def debug_log(epochs=3, k=4, conds=4, three_copy_epoch=None, explicit=True, extra=""):
    lines = ["2024-05-01 10:00:00 INFO starting", f"[rank0] [GRPO Debug] k={k}"]
    rng = np.random.default_rng(0)
    for e in range(epochs):
        chosen = [int(c) for c in rng.choice(200, conds, replace=False)]
        idx = [c for c in chosen for _ in range(k)]
        if e == three_copy_epoch:
            idx[0] = 777
        rng.shuffle(idx)
        counts = {}
        for i in idx:
            counts[i] = counts.get(i, 0) + 1
        pre = f"2024-05-01 10:0{e}:00 [rank0] [GRPO Debug] " + (f"epoch {e} " if explicit else "")
        lines.append(pre + f"gathered dataset indices: {idx}")
        lines.append(f"[GRPO Debug] number of unique conditions: {len(counts)}")
        lines.append(f"[GRPO Debug] count per condition: {counts}")
        lines.append(f"[GRPO Debug] advantages shape: torch.Size([{len(idx)}, 9])" if e % 2 == 0 else
                     f"[GRPO Debug] advantages shape: ({len(idx)}, 9)")
        for j, c in enumerate(sorted(counts)):
            mean, std = (0.0, 0.0) if j == 0 else (-0.0, 1.0)
            lines.append(f"[GRPO Debug] condition {c} advantage mean: {mean:.4f} std: {std:.4f}")
        lines.append("some unrelated line: loss 0.01")
    return "\n".join(lines) + "\n" + extra


def test_good_debug_log_passes(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(debug_log())
    out = tmp_path / "r.md"
    assert verify_script.main([str(log), "--out", str(out)]) == 0
    report, _ = verify_script.build_report(log, 1e-3)
    assert report.kind == "[GRPO Debug] text log"
    assert report.epochs == [0, 1, 2]
    assert [c for c in report.checks if c.status != verify.PASS] == []
    names = {c.name for c in report.checks if c.epoch == 1}
    assert names == {"sampling_facts", "count_per_condition", "unique_conditions", "advantage_shape",
                     "advantage_per_condition"}
    assert "**Result: PASS**" in out.read_text()


def test_debug_log_with_three_copy_condition_fails(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(debug_log(three_copy_epoch=1, explicit=False))
    out = tmp_path / "r.md"
    assert verify_script.main([str(log), "--out", str(out)]) == 1
    report, _ = verify_script.build_report(log, 1e-3)
    c = status(report, "count_per_condition", 1)
    assert c.status == verify.FAIL and ": 3" in c.detail and "777: 1" in c.detail
    assert status(report, "count_per_condition", 0).status == verify.PASS
    assert any("order" in n for n in report.notes)


def test_debug_log_bad_advantage_std_and_shape_fail():
    text = debug_log(epochs=1).replace("std: 1.0000", "std: 1.5000", 1).replace("torch.Size([16, 9])",
                                                                                 "torch.Size([15, 9])")
    report = verify.verify_debug_log(verify.parse_debug_log(text))
    assert status(report, "advantage_per_condition", 0).status == verify.FAIL
    assert status(report, "advantage_shape", 0).status == verify.FAIL


def test_debug_advantage_std_below_one_passes_when_its_implied_reward_std_is_not_a_few_eps(tmp_path):
    """std_A = s / (s + eps) for every group: 0.9988 means a reward std s = 1e-4 x 0.9988 / 0.0012 = 0.083, far
    above 10 eps, so it passes and the implied s is printed; 0.85 means s = 5.7e-4 = 5.7 eps, where eps and not the
    rewards sets the advantages: a warning; 1.2 is no eps effect and fails."""
    text = debug_log(epochs=1).replace("std: 1.0000", "std: 0.9988", 1)
    report = verify.verify_debug_log(verify.parse_debug_log(text))
    c = status(report, "advantage_per_condition", 0)
    [row] = [r for r in c.table if r["std"] == 0.9988]
    assert c.status == verify.PASS and row["status"] == verify.PASS
    assert row["reward_std"] == pytest.approx(1e-4 * 0.9988 / 0.0012) and "s = 0.0832" in row["note"]
    assert c.numbers["min_implied_reward_std"] == pytest.approx(0.0832, abs=1e-4)
    log = tmp_path / "train.log"
    log.write_text(text)
    assert verify_script.main([str(log), "--out", str(tmp_path / "r.md")]) == 0
    text = debug_log(epochs=1).replace("std: 1.0000", "std: 0.8500", 1)
    c = status(verify.verify_debug_log(verify.parse_debug_log(text)), "advantage_per_condition", 0)
    assert c.status == verify.WARN and "below 10 eps" in c.detail
    # s / eps = std / (1 - std) whatever eps is: another eps moves the implied s, not the verdict
    c = status(verify.verify_debug_log(verify.parse_debug_log(text), eps=1e-5), "advantage_per_condition", 0)
    assert c.status == verify.WARN and "s = 5.67e-05" in c.detail
    text = debug_log(epochs=1).replace("std: 1.0000", "std: 1.2000", 1)
    assert status(verify.verify_debug_log(verify.parse_debug_log(text)), "advantage_per_condition", 0).status == \
        verify.FAIL


def test_a_clean_seed_form_log_with_eps_stds_passes(tmp_path):
    """Issue 31: advantage stds of 0.9985-0.9998 with eps 1e-4 are reward stds of 0.07-0.5 (every group here):
    PASS, exit 0, not a warning per condition."""
    stds = [0.9985, 0.9990, 0.9992, 0.9995, 0.9998, 0.9987, 0.9989, 0.9996]
    lines = ["[GRPO Debug] Gathered dataset_indices: [" + ", ".join(str(c) for c in range(8) for _ in range(4)) + "]",
             "[GRPO Debug] Unique conditions: 8",
             "[GRPO Debug] Count per condition: {" + ", ".join(f"'{c}': 4" for c in range(8)) + "}",
             "[GRPO Debug] Advantages shape: (32, 5)"]
    lines += [f"[GRPO Debug] Condition {c}: samples=4, advantage mean=0.0000, std={std}" for c, std in enumerate(stds)]
    code, report = run_cli(tmp_path, "\n".join(lines) + "\n")
    c = status(report, "advantage_per_condition", 0)
    assert code == 0 and report.status == verify.PASS and c.status == verify.PASS, c.detail
    implied = sorted(r["reward_std"] for r in c.table if r["reward_std"] is not None)  # std 1 within tol: none
    expected = sorted(1e-4 * x / (1 - x) for x in stds if abs(x - 1) > 1e-3)  # std 1 within tol: none implied
    assert implied == pytest.approx(expected, rel=1e-9) and min(implied) > 10 * 1e-4


def test_truncated_debug_log_reports_what_it_could_not_read():
    # Epoch 2's only line is cut: that epoch now fails "could not verify" (it used to be skipped, exit 0).
    text = debug_log(epochs=2)
    lines = text.splitlines()
    lines.append("[GRPO Debug] epoch 2 gathered dataset indices: [12, 12, 7")
    lines.insert(5, "[GRPO Debug] count per condition: {12: 4, 7:")
    report = verify.verify_debug_log(verify.parse_debug_log("\n".join(lines)))
    c = status(report, "unreadable_lines")
    assert c.status == verify.WARN and c.numbers["lines"] == [6, len(lines)]
    assert "truncated" in report.unreadable[-1].reason and "last line" in report.unreadable[-1].reason
    assert status(report, "count_per_condition", 1).status == verify.PASS
    # epoch 0 lost a second (cut) counts line but its indices and first counts line were read: a warning
    assert status(report, "sampling_facts", 0).status == verify.WARN
    failing = {(c.name, c.epoch) for c in report.failing()}
    assert failing == {("sampling_facts", 2), ("count_per_condition", 2)}
    assert status(report, "sampling_facts", 2).detail.startswith("could not verify")


def test_debug_missing_epoch_and_forms():
    text = "\n".join([
        "[GRPO Debug] group size: 2",
        "[GRPO Debug] epoch 0 gathered dataset indices: tensor([3, 5, 3, 5], device='npu:0')",
        "[GRPO Debug] epoch 0 count per condition: Counter({3: 2, 5: 2})",
        "[GRPO Debug] epoch 0 advantages shape: [4, 2]",
        "[GRPO Debug] epoch 0 condition 3 advantage mean: 1.2e-08 std: 0.99995",
        "[GRPO Debug] epoch 2 gathered dataset indices: [1, 1, 2, 2]",
        "[GRPO Debug] epoch 2 something else entirely",
    ])
    log = verify.parse_debug_log(text)
    assert log.epochs[0].k == 2 and log.epochs[0].counts == {3: 2, 5: 2} and log.epochs[0].shape == (4, 2)
    report = verify.verify_debug_log(log)
    assert status(report, "missing_epochs").numbers["missing"] == [1]
    assert status(report, "advantage_per_condition", 0).status == verify.WARN  # condition 5 not printed
    assert [u.line for u in report.unreadable] == [7]


def test_fuzzed_epoch_records_never_raise():
    rng = np.random.default_rng(0)
    junk = [None, "x", -1, 2.5, float("nan"), [], [[1], [2, 3]], {"a": 1}, [None], True]
    base = make_records(2)
    keys = sorted(epoch_rec(base, 0))
    for _ in range(60):
        records = json.loads(json.dumps(base))
        rec = epoch_rec(records, 0)
        for key in rng.choice(keys, 3, replace=False):
            rec[str(key)] = junk[rng.integers(len(junk))]
        report = report_of(records)
        verify.render_markdown(report)
        assert status(report, "count_per_condition", 1).status == verify.PASS


def test_debug_log_cut_anywhere_never_raises():
    text = debug_log(epochs=2)
    for cut in range(0, len(text), 41):
        report = verify.verify_debug_log(verify.parse_debug_log(text[:cut]))
        assert not any(c.detail.startswith("could not evaluate") for c in report.checks)
        verify.render_markdown(report)


# ---------------------------------------------------------------------------------------------------------
# [GRPO Debug] logs as earlier codebases really print them, built from a correct synthetic GRPO epoch

M_COND, K_COPIES, T_STEPS, ADV_EPS = 16, 4, 18, 1e-4
TQDM = "\r 30%|###       | 3/10 [00:01<00:02,  2.1it/s]\r 40%|####      | 4/10 [00:01<00:02,  2.1it/s]"


def grpo_epoch(seed, move=None):
    """Gathered indices, counts and per-condition advantage stats of one epoch, advantages computed here as
    (r - mean) / (std + eps) per condition. `move=(a, b)` turns one copy of condition a into condition b."""
    rng = np.random.default_rng(seed)
    conds = rng.choice(np.arange(10000, 30000), M_COND, replace=False)
    idx = np.repeat(conds, K_COPIES)
    if move is not None:
        idx[np.flatnonzero(idx == conds[move[0]])[0]] = conds[move[1]]
    idx = idx[rng.permutation(idx.size)]
    rewards = np.empty(idx.size)
    for c in np.unique(idx):
        sel = idx == c
        # rewards spread enough that eps leaves the advantage std within 1e-3 of 1
        rewards[sel] = rng.uniform(0, 1) + rng.uniform(0.5, 1.0) * rng.permutation(np.linspace(0, 1, sel.sum()))
    rewards[idx == conds[0]] = 0.25  # one group with equal rewards: advantages exactly 0
    adv = np.zeros(idx.size)
    stats = {}
    for c in np.unique(idx):
        sel = idx == c
        r = rewards[sel]
        adv[sel] = 0.0 if r.max() == r.min() else (r - r.mean()) / (r.std() + ADV_EPS)
        stats[int(c)] = (int(sel.sum()), float(adv[sel].mean()), float(adv[sel].std()))
    counts = {int(c): int(n) for c, n in zip(*np.unique(idx, return_counts=True), strict=True)}
    return {"idx": idx, "conds": [int(c) for c in conds], "counts": counts, "stats": stats,
            "shape": (idx.size, T_STEPS)}


def _torch_repr(idx, device="npu:0"):
    return repr(torch.tensor(idx.tolist()))[:-1] + f", device='{device}')"


def render_epoch(ep, e, style, rank=None):
    """One epoch's [GRPO Debug] output in a given codebase's style, as a list of physical lines."""
    import pprint

    out = []
    if style == "numpy":  # logging prefix on the first line only, numpy arrays wrapped, str keys, Epoch line
        pre = f"2025-06-01 12:00:0{e},123 - INFO - [GRPO Debug] "
        out.append(pre + f"Epoch {e}")
        out += (pre + f"Gathered dataset_indices: {ep['idx']}").split("\n")
        out.append(TQDM)
        out.append(pre + f"Unique conditions: {len(ep['counts'])}")
        out.append(pre + f"Count per condition: { {str(c): n for c, n in ep['counts'].items()} }")
        out.append(pre + f"Advantages shape: {ep['shape']}")
        for c, (n, m, s) in ep["stats"].items():
            out.append(pre + f"Condition {c}: samples={n}, advantage mean={m:.4f}, std={s:.4f}")
    elif style == "torch":  # torchrun [rankN]: on every line, tensors with device, Counter, torch.Size, no epochs
        pre = f"[rank{rank or 0}]: "
        text = f"[GRPO Debug] Gathered dataset_indices: {_torch_repr(ep['idx'])}"
        out += [pre + line for line in text.split("\n")]
        out.append(pre + "UserWarning: some deprecation | /path/to/file.py:12")
        out.append(pre + f"[GRPO Debug] Number of unique conditions: {len(ep['counts'])}")
        out.append(pre + f"[GRPO Debug] Count per condition: {Counter(ep['idx'].tolist())!r}")
        out.append(pre + f"[GRPO Debug] Advantages shape: {torch.zeros(ep['shape']).shape}")
        out.append(TQDM)
        if not rank:
            for c, (_, m, s) in ep["stats"].items():
                out.append(pre + f"[GRPO Debug] condition {c} advantage mean: {m:.4f} std: {s:.4f}")
    elif style == "pprint":  # [time] [Rank 3] prefix, `epoch N:` in the body, pprint'ed dict with str keys
        pre = f"[2025-06-01 12:00:0{e}] [Rank 3] [GRPO Debug] epoch {e}: "
        out += (pre + f"Gathered dataset indices: {ep['idx']}").split("\n")
        out.append(pre + f"Number of unique conditions: {len(ep['counts'])}")
        counts = pprint.pformat({str(c): n for c, n in ep["counts"].items()}, width=40)
        out += (pre + f"Count per condition: {counts}").split("\n")
        out.append(pre + f"Advantages shape: torch.Size([{ep['shape'][0]}, {ep['shape'][1]}])")
        for c, (n, m, s) in ep["stats"].items():
            out.append(pre + f"Condition {c}: samples={n}, advantage mean={m:.4f}, std={s:.4f}")
    elif style == "int_keys":  # plain print, lists with commas, int-keyed defaultdict and numpy 2 scalars
        out.append(f"[GRPO Debug] k={K_COPIES}")
        out.append(f"[GRPO Debug] gathered dataset indices: {ep['idx'].tolist()}")
        np_keys = ", ".join(f"np.int64({c}): np.int64({n})" for c, n in ep["counts"].items())
        out.append(f"[GRPO Debug] count per condition: defaultdict(<class 'int'>, {dict(ep['counts'])})"
                   if e % 2 == 0 else f"[GRPO Debug] counts per condition: {{{np_keys}}}")
        out.append(f"[GRPO Debug] advantages shape: [{ep['shape'][0]}, {ep['shape'][1]}]")
        for c, (_, m, s) in ep["stats"].items():
            out.append(f"[GRPO Debug] condition {c} advantage mean: {m:.4f} std: {s:.4f}")
    else:
        raise ValueError(style)
    return out


def debug_text(style, epochs=3, moves=None, ranks=1):
    """A whole log: unrelated output around the epochs; with ranks > 1 every rank prints every epoch and the
    ranks' lines interleave one by one, as torchrun merges its processes' output."""
    lines = ["loading model ...", "Loading checkpoint shards: 100%|##########| 2/2 [00:01<00:00,  1.5it/s]"]
    for e in range(epochs):
        ep = grpo_epoch(e, (moves or {}).get(e))
        per_rank = [render_epoch(ep, e, style, rank=r) for r in range(ranks)]
        for row in range(max(len(p) for p in per_rank)):
            lines += [p[row] for p in per_rank if row < len(p)]
        lines.append(f"step {e}: loss=0.0123 kl=1.2e-05")
    return "\n".join(lines) + "\n"


CLEAN_STYLES = ["numpy", "torch", "pprint", "int_keys"]


def run_cli(tmp_path, text, name="train.log"):
    log = tmp_path / name
    log.write_text(text)
    code = verify_script.main([str(log), "--out", str(tmp_path / "report.md")])
    report, _ = verify_script.build_report(log, 1e-3)
    return code, report


@pytest.mark.parametrize("style", CLEAN_STYLES)
def test_clean_debug_log_in_each_form_passes(tmp_path, style):
    code, report = run_cli(tmp_path, debug_text(style))
    assert report.unreadable == []
    assert [(c.name, c.epoch, c.detail) for c in report.checks if c.status != verify.PASS] == []
    assert code == 0 and report.epochs == [0, 1, 2]
    for e in range(3):
        ep = grpo_epoch(e)
        counts = status(report, "count_per_condition", e)
        assert counts.numbers["conditions"] == M_COND and counts.numbers["samples"] == M_COND * K_COPIES
        table = status(report, "advantage_per_condition", e).table
        assert {r["condition"] for r in table} == set(ep["counts"])
        assert sum(r["note"] == "zero-std group: all 0" for r in table) == 1
    assert "**Result: PASS**" in (tmp_path / "report.md").read_text()


def test_parsed_facts_equal_what_was_printed():
    log = verify.parse_debug_log(debug_text("pprint", epochs=2))
    assert [ep.epoch for ep in log.epochs] == [0, 1]
    for e, parsed in enumerate(log.epochs):
        ep = grpo_epoch(e)
        assert parsed.indices == ep["idx"].tolist() and parsed.counts == ep["counts"]
        assert parsed.unique == M_COND and parsed.shape == ep["shape"]
        assert {c: (s["samples"], s["mean"], s["std"]) for c, s in parsed.cond_stats.items()} == {
            c: (n, round(m, 4), round(s, 4)) for c, (n, m, s) in ep["stats"].items()}


def test_two_ranks_printing_the_same_epoch_are_one_epoch(tmp_path):
    code, report = run_cli(tmp_path, debug_text("torch", ranks=2))
    assert code == 0 and report.unreadable == [] and report.epochs == [0, 1, 2]
    agree = status(report, "ranks_agree", 1)
    assert agree.status == verify.PASS and agree.numbers["repeated_statements"] == 4


def test_two_ranks_that_disagree_fail_naming_the_conditions(tmp_path):
    text = debug_text("torch", epochs=1, ranks=2)
    ep, bad = grpo_epoch(0), grpo_epoch(0, move=(1, 2))
    a, b = ep["conds"][1], ep["conds"][2]
    rank1 = render_epoch(bad, 0, "torch", rank=1)
    clean1 = render_epoch(ep, 0, "torch", rank=1)
    for good_line, bad_line in zip(clean1, rank1, strict=True):
        text = text.replace(good_line, bad_line)
    code, report = run_cli(tmp_path, text)
    assert code == 1
    c = status(report, "ranks_agree", 0)
    assert c.status == verify.FAIL and f"{a} (4 vs 3)" in c.detail and f"{b} (4 vs 5)" in c.detail


@pytest.mark.parametrize("style", CLEAN_STYLES)
def test_condition_with_three_copies_and_one_with_five_fails_naming_both(tmp_path, style):
    ep = grpo_epoch(1, move=(3, 5))
    a, b = ep["conds"][3], ep["conds"][5]
    assert ep["counts"][a] == 3 and ep["counts"][b] == 5
    code, report = run_cli(tmp_path, debug_text(style, moves={1: (3, 5)}))
    assert code == 1 and report.unreadable == []
    c = status(report, "count_per_condition", 1)
    assert c.status == verify.FAIL and f"{a}: 3" in c.detail and f"{b}: 5" in c.detail
    assert c.numbers["offenders"] == {str(a): 3, str(b): 5}
    assert {(c.name, c.epoch) for c in report.failing()} == {("count_per_condition", 1)}


def test_printed_counts_disagreeing_with_indices_fail_naming_the_conditions(tmp_path):
    good, bad = grpo_epoch(0), grpo_epoch(0, move=(2, 7))
    a, b = good["conds"][2], good["conds"][7]
    lines = render_epoch(good, 0, "numpy")
    bad_lines = render_epoch(bad, 0, "numpy")
    n_idx = sum(1 for line in bad_lines if not line.startswith(("2025", "\r"))) + 1  # the wrapped array's lines
    lines[1:1 + n_idx] = bad_lines[1:1 + n_idx]  # the gathered indices say one thing, the counts dict another
    code, report = run_cli(tmp_path, "\n".join(lines) + "\n")
    assert code == 1 and report.unreadable == []
    c = status(report, "count_per_condition", 0)
    assert c.status == verify.FAIL and "disagree" in c.detail
    assert f"{a} (4 vs 3)" in c.detail and f"{b} (4 vs 5)" in c.detail


def test_condition_samples_disagreeing_with_counts_fail_naming_the_condition(tmp_path):
    ep = grpo_epoch(0)
    victim = ep["conds"][4]
    n, m, s = ep["stats"][victim]
    text = debug_text("numpy", epochs=1).replace(f"Condition {victim}: samples={n},", f"Condition {victim}: "
                                                                                       f"samples={n + 1},")
    code, report = run_cli(tmp_path, text)
    assert code == 1
    c = status(report, "condition_samples", 0)
    assert c.status == verify.FAIL and f"{victim}: samples={n + 1} but {n} gathered" in c.detail
    assert status(report, "count_per_condition", 0).status == verify.PASS


def test_bad_advantage_stats_fail_naming_the_condition(tmp_path):
    ep = grpo_epoch(0)
    victim = ep["conds"][6]
    n, m, s = ep["stats"][victim]
    text = debug_text("torch", epochs=1).replace(f"condition {victim} advantage mean: {m:.4f} std: {s:.4f}",
                                                 f"condition {victim} advantage mean: 0.2500 std: {s:.4f}")
    code, report = run_cli(tmp_path, text)
    c = status(report, "advantage_per_condition", 0)
    assert code == 1 and c.status == verify.FAIL and f"{victim}: mean 0.25 is not 0" in c.detail


def test_unrelated_text_exits_non_zero(tmp_path, capsys):
    text = "epoch 1 loss 0.3\n" + TQDM + "\nWARNING: nothing to see | here\n{'a': 1}\n"
    code, report = run_cli(tmp_path, text)
    assert code == 1 and report.epochs == []
    assert status(report, "epoch_records").status == verify.FAIL
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text(text)
    assert verify_script.main([str(run), "--out", str(tmp_path / "r2.md")]) == 2  # no log with the tag at all


def test_tagged_lines_without_sampling_facts_exit_non_zero(tmp_path):
    text = "[GRPO Debug] Epoch 0\n[GRPO Debug] Advantages shape: (64, 18)\n[GRPO Debug] reward mean: 0.5\n"
    code, report = run_cli(tmp_path, text)
    assert code == 1 and report.unreadable == []
    c = status(report, "sampling_facts", 0)
    assert c.status == verify.FAIL and c.detail.startswith("could not verify")
    assert status(report, "epoch_records").status == verify.FAIL
    assert any("reward mean" in n for n in report.notes)  # read, but used by no check: said so


def _elided(text):
    """The numpy-style log with its index arrays printed as numpy prints big ones."""
    out = []
    for e in range(3):
        ep = grpo_epoch(e)
        full = str(ep["idx"])
        short = np.array2string(ep["idx"], threshold=10)
        text = text.replace(full, short)
        out.append(short)
    assert all("..." in s for s in out)
    return text


def test_elided_array_with_readable_counts_is_verified_from_the_counts(tmp_path):
    code, report = run_cli(tmp_path, _elided(debug_text("numpy")))
    assert len(report.unreadable) == 3 and all("'...'" in u.reason for u in report.unreadable)
    c = status(report, "sampling_facts", 1)
    assert c.status == verify.WARN and "counts per condition" in c.detail
    assert status(report, "count_per_condition", 1).status == verify.PASS
    assert report.failing() == [] and code == 0


def test_elided_array_without_counts_fails_could_not_verify(tmp_path):
    text = "\n".join(line for line in _elided(debug_text("numpy")).splitlines() if "Count per condition" not in line)
    code, report = run_cli(tmp_path, text + "\n")
    assert code == 1
    for e in range(3):
        c = status(report, "sampling_facts", e)
        assert c.status == verify.FAIL and c.detail.startswith("could not verify") and "'...'" in c.detail
    assert any("Count per condition" not in u.text and "..." in u.reason for u in report.unreadable)


def test_every_documented_form_example_is_read():
    for what, example in verify.DEBUG_LOG_FORMS:
        if not example:
            continue
        log = verify.parse_debug_log(example)
        assert log.unreadable == [] and not log.ignored, what
        if not log.epochs:  # run settings alone (k, the batch arithmetic) open no epoch
            assert log.k_values or log.setting_values, what
            continue
        assert len(log.epochs) == 1, what
        ep = log.epochs[0]
        facts = [ep.indices, ep.counts, ep.unique, ep.shape, ep.cond_stats or None, ep.epoch, log.k_values or None,
                 ep.samples, ep.reward_shapes or None]
        assert any(f is not None for f in facts), what


@pytest.mark.parametrize("text, want", [
    ("0: [GRPO Debug] Gathered dataset_indices: [3 5\n0:  3 5]", {"indices": [3, 5, 3, 5]}),  # srun -l
    ("[default0]:[GRPO Debug] Gathered dataset_indices: [3 5\n[default0]: 3 5]", {"indices": [3, 5, 3, 5]}),
    ("[GRPO Debug] Gathered dataset_indices: array([[3, 5], [3, 5]], dtype=int64)", {"indices": [3, 5, 3, 5]}),
    ("[GRPO Debug] Count per condition: OrderedDict([(3, 2), (5, 2)])", {"counts": {3: 2, 5: 2}}),
    ("[GRPO Debug] Count per condition: OrderedDict({'3': 2, '5': 2})", {"counts": {3: 2, 5: 2}}),
    ("[GRPO Debug] Count per condition: Counter({tensor(3, device='cuda:0'): 2})", {"counts": {3: 2}}),
    ("[GRPO Debug] Epoch 3/10\n[GRPO Debug] Unique conditions: 2", {"epoch": 3, "unique": 2}),
    ("Epoch 2 | [GRPO Debug] Gathered dataset indices: [3 5 3 5]", {"epoch": 2, "indices": [3, 5, 3, 5]}),
    ("[GRPO Debug] === Epoch 4 ===\n[GRPO Debug] group size: 2", {"epoch": 4}),
    ("[GRPO Debug] Advantages shape: [64, 18]", {"shape": (64, 18)}),
    ("[GRPO Debug] Count per condition:\n{'3': 2,\n '5': 2}", {"counts": {3: 2, 5: 2}}),
])
def test_less_common_forms_are_read(text, want):
    log = verify.parse_debug_log(text)
    assert log.unreadable == [] and len(log.epochs) == 1
    ep = log.epochs[0]
    assert {key: getattr(ep, key) for key in want} == want


def test_nan_stats_are_read_and_fail():
    report = verify.verify_debug_log(verify.parse_debug_log(
        "[GRPO Debug] Gathered dataset_indices: [3 5 3 5]\n[GRPO Debug] condition 3 advantage mean: nan std: nan\n"
        "[GRPO Debug] condition 5 advantage mean: 0.0000 std: 1.0000"))
    assert report.unreadable == []
    c = status(report, "advantage_per_condition", 0)
    assert c.status == verify.FAIL and "3: mean nan is not 0" in c.detail


def test_interleaved_continuations_that_cannot_be_told_apart_are_unreadable():
    # Two ranks whose logger prefixes only the first line: whose continuation is whose cannot be known.
    text = ("[Rank 0] [GRPO Debug] Gathered dataset_indices: [3 5\n[Rank 1] [GRPO Debug] Gathered dataset_indices: "
            "[3 5\n 3 5]\n 3 5]\n")
    log = verify.parse_debug_log(text)
    assert [u.line for u in log.unreadable] == [1, 2]
    report = verify.verify_debug_log(log)
    assert status(report, "sampling_facts", 0).status == verify.FAIL


def test_unparsable_line_about_sampling_keeps_its_epoch_from_passing():
    text = debug_text("numpy", epochs=1).replace("[GRPO Debug] Unique conditions:", "[GRPO Debug] (Unique conditions)")
    report = verify.verify_debug_log(verify.parse_debug_log(text))
    assert len(report.unreadable) == 1
    assert status(report, "sampling_facts", 0).status == verify.WARN
    assert status(report, "count_per_condition", 0).status == verify.PASS


def test_the_guide_s_table_lists_every_form():
    guide = (ROOT / "docs" / "guide.md").read_text()
    assert verify.debug_log_forms_markdown() in guide


def test_issue_example_log_is_read(tmp_path):
    # The shape of the log in the issue: numpy indices over several lines, str-keyed counts, Condition lines.
    text = """[rank0]: 2025-06-01 12:00:01,123 - INFO - [GRPO Debug] Gathered dataset_indices: [19928 16416 24708
[rank0]:  19928 16416 24708 19928 16416 24708 19928 16416 24708]
[rank0]: 2025-06-01 12:00:01,124 - INFO - [GRPO Debug] Unique conditions: 3
[rank0]: 2025-06-01 12:00:01,125 - INFO - [GRPO Debug] Count per condition: {'19928': 4, '16416': 4, '24708': 4}
[rank0]: 2025-06-01 12:00:01,126 - INFO - [GRPO Debug] Advantages shape: (12, 18)
[rank0]: 2025-06-01 12:00:01,127 - INFO - [GRPO Debug] Condition 16416: samples=4, advantage mean=-0.0000, std=0.9996
[rank0]: 2025-06-01 12:00:01,127 - INFO - [GRPO Debug] Condition 19928: samples=4, advantage mean=0.0000, std=0.9997
[rank0]: 2025-06-01 12:00:01,127 - INFO - [GRPO Debug] Condition 24708: samples=4, advantage mean=0.0000, std=0.9998
"""
    code, report = run_cli(tmp_path, text)
    assert code == 0 and report.unreadable == [] and report.status == verify.PASS
    bad = text.replace("24708]", "16416]").replace("'24708': 4}", "'24708': 3}").replace("'16416': 4,", "'16416': 5,")
    code, report = run_cli(tmp_path, bad)
    c = status(report, "count_per_condition", 0)
    assert code == 1 and "16416: 5" in c.detail and "24708: 3" in c.detail


def test_multiline_debug_log_cut_anywhere_never_raises():
    text = debug_text("pprint", epochs=1) + debug_text("torch", epochs=1, ranks=2)
    for cut in range(0, len(text), 97):
        report = verify.verify_debug_log(verify.parse_debug_log(text[:cut]))
        assert not any(c.detail.startswith("could not evaluate") for c in report.checks)
        if report.epochs:
            verify.render_markdown(report)
        else:
            assert report.status == verify.FAIL


# ---------------------------------------------------------------------------------------------------------
# excluded samples (a failed reward): checks over the kept samples, never a false alarm, never a blind pass


def records_with(failures: dict, policy="sample", epochs=EPOCHS):
    """make_records with failed judge rewards at the given sample positions of some epochs; an epoch that keeps
    nothing takes no optimizer step, as in the trainer."""
    out, step = [], 0
    out.append({"type": "eval", "tag": "start", "step": 0, "eval/cam_score": 0.4})
    for e in range(epochs):
        rec = make_epoch(e, step, failures.get(e, ()), policy)
        steps = []
        for _ in range(STEPS_PER_EPOCH if not all(rec["excluded"]) else 0):
            step += 1
            m = _step_metrics(step)
            out.append({"type": "step", "step": step, "epoch": e, **m})
            steps.append(m)
        rec["optimizer_steps"] = steps
        rec["first_step_ratio_deviation"] = 2e-4 if steps else None
        rec["epoch_seconds"] = 1.5
        out.append(rec)
    return out


def _positions_in_distinct_groups(epoch, n):
    idx = _gathered_indices(epoch).tolist()
    seen, out = set(), []
    for pos, i in enumerate(idx):
        if i not in seen and i != idx[0]:  # not the all-equal group: its kept copies stay all equal either way
            seen.add(i)
            out.append(pos)
    return out[:n]


def test_excluded_samples_pass_every_check_and_warn_with_their_count():
    failed = _positions_in_distinct_groups(1, 2)
    records = records_with({1: failed})
    rec = epoch_rec(records, 1)
    assert rec["group_size"] == pytest.approx((N - 2) / (N // K))  # 3.5: the trainer's stats are over kept samples
    report = report_of(records)
    assert report.failing() == []
    warned = [(c.name, c.epoch) for c in report.checks if c.status == verify.WARN]
    assert warned == [("excluded_samples", 1)]  # the only warning: the run trained on fewer samples than it drew
    ex = status(report, "excluded_samples", 1)
    assert ex.numbers["excluded_samples"] == 2 and ex.numbers["failed_samples"] == 2 and ex.numbers["groups_short"] == 2
    assert "2 of 16 samples excluded" in ex.detail
    gs = status(report, "group_size", 1)
    assert gs.status == verify.PASS and gs.numbers["mean_kept_copies"] == pytest.approx(3.5)
    assert gs.numbers["excluded_samples"] == 2
    cpc = status(report, "count_per_condition", 1)
    assert cpc.status == verify.PASS and cpc.numbers["min_kept"] == 3 and "not a missing copy" in cpc.detail
    finite = status(report, "reward_finite", 1)
    assert finite.status == verify.PASS and finite.numbers["failed_samples"] == 2
    assert status(report, "excluded_samples", 0).status == verify.PASS  # nothing excluded there


def test_a_whole_group_excluded_is_not_a_missing_prompt():
    idx = _gathered_indices(2).tolist()
    group = [p for p, i in enumerate(idx) if i == idx[-1]]
    records = records_with({2: group[:1]}, policy="group")  # drop_group: one failure takes its whole group
    report = report_of(records)
    assert report.failing() == []
    tpn = status(report, "trained_prompt_num", 2)
    assert tpn.status == verify.PASS and tpn.numbers["groups_kept"] == N // K - 1
    assert tpn.numbers["groups_excluded_whole"] == 1
    ex = status(report, "excluded_samples", 2)
    assert ex.status == verify.WARN and ex.numbers["excluded_samples"] == K and ex.numbers["failed_samples"] == 1


def test_a_genuinely_missing_copy_still_fails_when_samples_are_also_excluded():
    failed = _positions_in_distinct_groups(1, 1)
    records = records_with({1: failed})
    rec = epoch_rec(records, 1)
    victim = rec["dataset_indices"][-1]
    rec["dataset_indices"][-1] = 999  # one copy of `victim` was never drawn
    rec["condition_ids"][-1] = "scene999/traj0"
    report = report_of(records)
    assert status(report, "count_per_condition", 1).status == verify.FAIL
    gs = status(report, "group_size", 1)
    assert gs.status == verify.FAIL and f"{victim}: 3" in gs.detail


def test_exclusion_bookkeeping_that_disagrees_fails():
    failed = _positions_in_distinct_groups(0, 2)
    records = records_with({0: failed})
    epoch_rec(records, 0)["excluded_samples"] = 1
    c = status(report_of(records), "excluded_samples", 0)
    assert c.status == verify.FAIL and "excluded_samples=1" in c.detail
    records = records_with({0: failed})
    rec = epoch_rec(records, 0)
    rec["advantages"][failed[0]] = [0.5] * T  # an excluded sample that was trained on
    report = report_of(records)
    assert status(report, "excluded_samples", 0).status == verify.FAIL
    assert status(report, "advantage_recompute", 0).status == verify.FAIL
    records = records_with({0: failed})
    epoch_rec(records, 0)["excluded"][failed[0]] = False  # a NaN reward on a kept sample
    assert status(report_of(records), "reward_finite", 0).status == verify.FAIL


def test_wrong_group_size_with_exclusions_fails():
    records = records_with({1: _positions_in_distinct_groups(1, 2)})
    epoch_rec(records, 1)["group_size"] = 4.0  # k, but two samples were excluded: 3.5 is what the kept ones give
    c = status(report_of(records), "group_size", 1)
    assert c.status == verify.FAIL and "mean kept copies per group is 3.5" in c.detail


def test_epoch_that_kept_nothing_warns_and_fails_nothing():
    # drop_group with a failure in every group: nothing kept, no optimizer step, NaN group statistics
    idx = _gathered_indices(1).tolist()
    one_per_group = [idx.index(i) for i in dict.fromkeys(idx)]
    records = records_with({1: one_per_group}, policy="group")
    rec = epoch_rec(records, 1)
    assert all(rec["excluded"]) and rec["optimizer_steps"] == [] and rec["zero_std_ratio"] != rec["zero_std_ratio"]
    report = report_of(records)
    assert report.failing() == []
    assert status(report, "advantage_per_condition", 1).status == verify.WARN  # nothing to check is not a pass
    assert status(report, "excluded_samples", 1).status == verify.WARN
    assert status(report, "zero_std_groups", 1).status == verify.PASS
    assert status(report, "trained_prompt_num", 1).numbers["groups_kept"] == 0


def test_a_log_without_an_exclusion_mask_warns():
    records = make_records()
    for r in records:
        r.pop("excluded", None)
    c = status(report_of(records), "excluded_samples", 0)
    assert c.status == verify.WARN and "no exclusion mask" in c.detail


# ---------------------------------------------------------------------------------------------------------
# the run log prints a missing value as n/a


def test_epoch_line_prints_missing_values_as_na():
    records = records_with({1: [_gathered_indices(1).tolist().index(i) for i in dict.fromkeys(
        _gathered_indices(1).tolist())]}, policy="group")
    rec = epoch_rec(records, 1)  # no optimizer step: first_step_ratio_deviation None, zero_std_ratio NaN
    line = epoch_line(rec)
    assert "first-step |ratio-1| n/a" in line and "zero_std_ratio n/a" in line and "loss n/a" in line
    assert f"kept 0/{N} samples" in line
    rec["reward_unifiedscore"] = float("nan")
    assert "reward_unifiedscore n/a" in epoch_line(rec)
    ok = epoch_line(epoch_rec(records, 0))
    assert "n/a" not in ok and "first-step |ratio-1| 2.00e-04" in ok and f"kept {N}/{N} samples" in ok


def test_summarise_eval_leaves_missing_values_out_and_summary_prints_na(tmp_path):
    rows = [{"index": 0, "reward_cam_score": 0.5, "reward_unifiedscore": float("nan")},
            {"index": 1, "reward_cam_score": 0.7, "reward_unifiedscore": 0.25},
            {"index": 2, "reward_cam_score": None, "reward_unifiedscore": float("nan")}]
    out = reports.summarise_eval(rows, "eval")
    assert out["eval/num_conditions"] == 3
    assert out["eval/cam_score"] == pytest.approx(0.6) and out["eval/unifiedscore"] == pytest.approx(0.25)
    assert out["rows/eval/cam_score"] == [0.5, 0.7, None] and out["rows/eval/unifiedscore"] == [None, 0.25, None]
    none = reports.summarise_eval([{"index": 0, "reward_unifiedscore": float("nan")}], "val")
    assert none["val/unifiedscore"] != none["val/unifiedscore"]  # NaN: no value at all
    log = runlog.RunLog(tmp_path, get_config(), enabled=False)
    log.run_dir = tmp_path
    text = reports.write_summary(log, {"eval/cam_score": 0.5, "eval/unifiedscore": float("nan")},
                                 {"eval/cam_score": 0.75, "eval/unifiedscore": 0.5},
                                 rows=(("cam_score", "eval/cam_score"), ("judge", "eval/unifiedscore"),
                                       ("gone", "eval/x")))
    assert "| cam_score | 0.5000 | 0.7500 | +0.2500 |" in text
    assert "| judge | n/a | 0.5000 | n/a |" in text and "gone" not in text


def test_summary_change_carries_the_paired_interval_over_conditions(tmp_path):
    """Per-condition rows in both evaluations: the change column is the mean paired difference +- its 95% t
    half-width, by hand; a metric over the whole split (no rows) keeps its plain difference; a selected checkpoint
    is paired with the base the same way."""
    base = reports.summarise_eval([{"index": i, "reward_cam_score": v} for i, v in enumerate([0.1, 0.2, 0.4, 0.3])])
    late = reports.summarise_eval([{"index": i, "reward_cam_score": v} for i, v in enumerate([0.2, 0.2, 0.7, None])])
    base["eval/r_precision_top3"], late["eval/r_precision_top3"] = 0.5, 0.625
    diffs = np.array([0.1, 0.0, 0.3])  # the third condition's after is missing: only pairs scored twice count
    half = 4.302652729911275 * diffs.std(ddof=1) / np.sqrt(3)  # t_{0.975, 2}
    log = runlog.RunLog(tmp_path, get_config(), enabled=False)
    log.run_dir = tmp_path
    rows = (("cam_score", "eval/cam_score"), ("R@3", "eval/r_precision_top3"))
    text = reports.write_summary(log, base, late, rows=rows)
    assert f"| cam_score | 0.2500 | 0.3667 | {diffs.mean():+.4f} ± {half:.4f} |" in text
    assert "| R@3 | 0.5000 | 0.6250 | +0.1250 |" in text and "paired 95% t-interval" in text
    selected = {**late, "checkpoint": "epoch_0002"}
    text = reports.write_summary(log, base, base, rows=rows, selected=selected, selection="best val")
    assert f"| {diffs.mean():+.4f} ± {half:.4f} | +0.0000 ± 0.0000 |" in text


# ---------------------------------------------------------------------------------------------------------
# the plan's arithmetic in a text log: replicas x batch x batches = samples, conditions = samples / k, reward shapes


def arithmetic_log(conditions=16, k=4, header="num_replicas: 8, batch_size: 2, num_batches_per_epoch: 4",
                   reward_shape=None, adv_t=18, samples_line=True):
    """One epoch of a log that prints its batch arithmetic (8 replicas x 2 per device x 4 batches = 64 samples by
    default) and gathers `conditions` x k samples."""
    idx = [1000 + c for c in range(conditions) for _ in range(k)]
    n = len(idx)
    lines = [f"[GRPO Debug] {header}, k: {k}", "[GRPO Debug] Epoch 0",
             f"[GRPO Debug] Gathered dataset_indices: {idx}",
             f"[GRPO Debug] Unique conditions: {conditions}",
             f"[GRPO Debug] Count per condition: { {c: k for c in sorted(set(idx))} }",
             f"[GRPO Debug] Advantages shape: ({n}, {adv_t})"]
    if samples_line:
        lines.append(f"[GRPO Debug] Gathered samples: {n}")
    lines.append(f"[GRPO Debug] rewards['avg'] shape: {reward_shape or (n, adv_t)}")
    return "\n".join(lines) + "\n"


def test_a_log_whose_arithmetic_does_not_add_up_fails_naming_both_numbers(tmp_path):
    # the issue's log: 8 replicas x 2 x 4 batches, but 60 samples and 15 conditions gathered (each condition k times,
    # so every check that reads only what was gathered passes)
    code, report = run_cli(tmp_path, arithmetic_log(conditions=15))
    assert code == 1 and report.status == verify.FAIL
    samples = status(report, "sample_arithmetic", 0)
    assert samples.status == verify.FAIL
    assert "8 replicas x 2 per device x 4 batches = 64 samples expected, but 60 were gathered" in samples.detail
    assert (samples.numbers["expected_samples"], samples.numbers["gathered_samples"]) == (64, 60)
    conditions = status(report, "condition_arithmetic", 0)
    assert conditions.status == verify.FAIL
    assert "/ k=4 = 16 unique conditions expected, but 15 were gathered" in conditions.detail
    assert status(report, "count_per_condition", 0).status == verify.PASS  # 15 x 4: consistent, and wrong
    md = (tmp_path / "report.md").read_text()
    assert "**Result: FAIL**" in md and "64 samples expected, but 60 were gathered" in md
    assert not any("read but not used" in n and "replicas" in n for n in report.notes)  # used, not ignored
    # the same log with the 64 samples its arithmetic gives passes
    code, report = run_cli(tmp_path, arithmetic_log(conditions=16))
    assert code == 0, [(c.name, c.detail) for c in report.checks if c.status != verify.PASS]
    assert status(report, "sample_arithmetic", 0).detail == ("8 replicas x 2 per device x 4 batches = 64 samples, "
                                                             "as gathered")
    assert status(report, "condition_arithmetic", 0).numbers["expected_conditions"] == 16


@pytest.mark.parametrize("header", ["world_size: 8, per_device_batch_size: 2, batches per epoch: 4",
                                    "num_processes=8 sample.batch_size=2 num_batches=4",
                                    "global_batch_size: 16, num_batches_per_epoch: 4"])
def test_the_arithmetic_is_read_in_the_forms_logs_print_it(tmp_path, header):
    _, report = run_cli(tmp_path, arithmetic_log(conditions=15, header=header))
    assert status(report, "sample_arithmetic", 0).status == verify.FAIL
    assert "64 samples expected, but 60 were gathered" in status(report, "sample_arithmetic", 0).detail


def test_arithmetic_that_cannot_be_evaluated_is_never_a_pass(tmp_path):
    # batches per epoch never printed: replicas x batch alone says nothing of an epoch's samples
    code, report = run_cli(tmp_path, arithmetic_log(header="num_replicas: 8, batch_size: 2"))
    c = status(report, "sample_arithmetic", 0)
    assert c.status == verify.WARN and c.detail.startswith("could not evaluate") and "batches per epoch" in c.detail
    assert status(report, "condition_arithmetic", 0).status == verify.WARN
    assert code == 0 and report.status == verify.WARN  # nothing failed, and nothing unevaluated passed
    # a log that prints none of it: the checks are not run, and the report says so
    text = "\n".join(line for line in arithmetic_log().splitlines() if "num_replicas" not in line
                     and "Gathered samples" not in line)
    _, report = run_cli(tmp_path, text + "\n")
    assert report.find("sample_arithmetic", 0) == []
    assert any("never prints its batch arithmetic" in n for n in report.notes)
    # k not printed: conditions = samples / k cannot be evaluated
    text = arithmetic_log().replace(", k: 4", "")
    _, report = run_cli(tmp_path, text)
    c = status(report, "condition_arithmetic", 0)
    assert c.status == verify.WARN and "k is not printed" in c.detail


def test_reward_shapes_are_held_against_the_samples_and_the_log_s_t(tmp_path):
    _, report = run_cli(tmp_path, arithmetic_log(reward_shape=(64, 10)))
    c = status(report, "reward_shapes", 0)
    assert c.status == verify.FAIL and "reward avg has shape (64, 10), but the advantages have T=18" in c.detail
    _, report = run_cli(tmp_path, arithmetic_log(reward_shape=(60, 18)))
    assert "reward avg has shape (60, 18), but 64 samples were gathered" in status(report, "reward_shapes", 0).detail
    # without a 2-D advantages shape or a printed T, a (N, T) reward's T is not compared: a warning, not a pass
    text = arithmetic_log().replace("[GRPO Debug] Advantages shape: (64, 18)\n", "")
    _, report = run_cli(tmp_path, text)
    c = status(report, "reward_shapes", 0)
    assert c.status == verify.WARN and "could not compare reward avg's T" in c.detail
    _, report = run_cli(tmp_path, text.replace("k: 4", "k: 4, num_train_timesteps: 18"))
    assert status(report, "reward_shapes", 0).status == verify.PASS


def test_unique_conditions_with_nothing_to_compare_is_not_a_pass():
    log = verify.parse_debug_log("[GRPO Debug] Gathered dataset_indices: [3, 5, 3, 5]\n")
    c = verify.check_debug_unique(log.epochs[0], None)
    assert c.status == verify.WARN and c.detail.startswith("not compared")
    log = verify.parse_debug_log("[GRPO Debug] k=2\n[GRPO Debug] Gathered dataset_indices: [3, 5, 3, 5]\n")
    assert verify.check_debug_unique(log.epochs[0], 2).status == verify.PASS  # 2 conditions x k=2 = 4 samples
