import logging
import random
import threading
import time

import pytest
import torch

from recam.engine.advantages import group_advantages
from recam.engine.reward_runner import (
    AsyncRewardRunner,
    RewardServerDown,
    concat_results,
    exclusion_mask,
    masked_group_advantages,
    valid_mask,
)
from rewards import REWARDS, MultiReward, RegisteredReward


class Cond:
    def __init__(self, ident):
        self.condition_id = f"c{ident}"
        self.ident = ident


def make_batch(batch, b=4):
    """Videos whose first pixel carries the sample identity, with matching conditions."""
    idents = [batch * 100 + i for i in range(b)]
    videos = torch.zeros(b, 3, 2, 4, 4)
    videos[:, 0, 0, 0, 0] = torch.tensor(idents, dtype=torch.float32)
    return videos, [Cond(i) for i in idents]


def identity_reward(videos, conditions):
    """Score = identity read from the video; details say which condition it was paired with."""
    time.sleep(random.uniform(0.0, 0.03))
    from_video = videos[:, 0, 0, 0, 0].clone()
    cond = torch.tensor([c.ident for c in conditions], dtype=torch.float32)
    return {"ident": from_video, "avg": from_video}, {"cond_ident": cond, "names": [c.condition_id for c in conditions]}


def test_order_kept_and_rewards_never_mixed(caplog):
    random.seed(0)
    caplog.set_level(logging.INFO, logger="recam.engine.reward_runner")
    with AsyncRewardRunner(identity_reward, max_workers=3) as runner:
        for b in range(8):
            runner.submit(f"batch{b}", *make_batch(b))
        results = runner.collect()
    assert [r.batch_id for r in results] == [f"batch{b}" for b in range(8)]
    for b, r in enumerate(results):
        expected = torch.tensor([b * 100 + i for i in range(4)], dtype=torch.float32)
        assert torch.equal(r.scores["ident"], expected)
        assert torch.equal(r.details["cond_ident"], expected)
        assert r.valid.all() and r.attempts == 1 and len(r.call_seconds) == 1
    scores, valid = concat_results(results)
    assert scores["avg"].shape == (32,) and valid.all()
    assert len(runner.timings) == 8 and all(sec >= 0 for _, n, sec in runner.timings)
    assert any("s/sample" in rec.getMessage() for rec in caplog.records)


def test_submit_returns_while_rewards_run():
    gate = threading.Event()

    def blocked(videos, conditions):
        assert gate.wait(5)
        return torch.ones(len(conditions)), {}

    with AsyncRewardRunner(blocked, max_workers=1) as runner:
        fut = runner.submit(0, *make_batch(0))
        runner.submit(1, *make_batch(1))
        assert not fut.done()  # the caller is free to sample the next batch
        gate.set()
        results = runner.collect()
    assert [r.batch_id for r in results] == [0, 1]


def test_wait_policy_retries_only_failed_samples():
    calls = []

    def flaky(videos, conditions):
        idents = [c.ident for c in conditions]
        calls.append(idents)
        scores = videos[:, 0, 0, 0, 0].clone()
        failed = torch.zeros(len(idents), dtype=torch.bool)
        for j, i in enumerate(idents):
            # sample 1 fails on its first call only; sample 3 always fails
            if i == 3 or (i == 1 and len(calls) == 1):
                scores[j] = float("nan")
                failed[j] = True
        reasons = [f"judge down for {i}" if f else None for i, f in zip(idents, failed.tolist(), strict=True)]
        return scores, {"failed": failed, "failure_reason": reasons}

    sleeps = []
    runner = AsyncRewardRunner(flaky, failure_policy="wait", max_retries=2, retry_backoff_s=0.1,
                               sleep=sleeps.append)
    runner.submit(0, *make_batch(0))
    (r,) = runner.collect()
    runner.close()
    assert calls == [[0, 1, 2, 3], [1, 3], [3]]  # the retries see only what failed
    assert sleeps == [0.1, 0.2]  # exponential backoff
    assert r.valid.tolist() == [True, True, True, False]
    assert r.scores[:3].tolist() == [0.0, 1.0, 2.0] and torch.isnan(r.scores[3])
    assert r.details["failed"].tolist() == [False, False, False, True]
    assert r.reasons[:3] == [None, None, None] and "judge down for 3" in r.reasons[3]
    assert r.attempts == 3 and len(r.call_seconds) == 3
    assert runner.exclusion_policy == "sample"


def test_stop_policy_raises_server_down():
    def half_nan(videos, conditions):
        s = torch.ones(len(conditions))
        s[0] = float("nan")
        return s, {}

    runner = AsyncRewardRunner(half_nan, failure_policy="stop")
    runner.submit("b7", *make_batch(0))
    with pytest.raises(RewardServerDown) as err:
        runner.collect()
    runner.close()
    assert err.value.batch_id == "b7" and err.value.reasons[0] == "non-finite reward"


@pytest.mark.parametrize("policy", ["wait", "drop_group", "stop"])
def test_reward_that_always_raises_is_server_down(policy):
    calls = []

    def down(videos, conditions):
        calls.append(1)
        raise ConnectionError("connection refused")

    runner = AsyncRewardRunner(down, failure_policy=policy, max_retries=2, sleep=lambda s: None)
    runner.submit(0, *make_batch(0))
    with pytest.raises(RewardServerDown, match="connection refused"):
        runner.collect()
    runner.close()
    assert len(calls) == (1 if policy == "stop" else 3)


def test_drop_group_policy_does_not_retry():
    calls = []

    def one_nan(videos, conditions):
        calls.append(1)
        s = torch.arange(len(conditions), dtype=torch.float32)
        s[1] = float("nan")
        return s, {}

    with AsyncRewardRunner(one_nan, failure_policy="drop_group") as runner:
        runner.submit(0, *make_batch(0))
        (r,) = runner.collect()
    assert len(calls) == 1 and r.valid.tolist() == [True, False, True, True]
    assert runner.exclusion_policy == "group"


def test_valid_mask_reads_nan_dicts_and_failed_flags():
    scores = {"a": torch.tensor([1.0, float("nan"), 2.0, 3.0]), "avg": torch.tensor([1.0, 2.0, float("inf"), 3.0])}
    details = {"unifiedscore": {"failed": torch.tensor([False, False, False, True])}}
    assert valid_mask(scores, details).tolist() == [True, False, False, False]
    flat = {"unifiedscore/failed": torch.tensor([True, False, False, False]), "x/failed_count": 3}
    assert valid_mask({"avg": torch.ones(4)}, flat).tolist() == [False, True, True, True]


_JUDGE_CALLS: list[int] = []


def _flaky_judge(videos, conditions):
    """Registered test reward: sample 2 fails (NaN + failed flag + reason) on the first call only."""
    _JUDGE_CALLS.append(len(conditions))
    ids = [c.ident for c in conditions]
    failed = torch.tensor([i == 2 and len(_JUDGE_CALLS) == 1 for i in ids])
    scores = torch.where(failed, torch.tensor(float("nan")), torch.tensor(ids, dtype=torch.float32) / 10)
    return scores, {"failed": failed, "failure_reason": ["timeout" if f else None for f in failed.tolist()],
                    "raw": [f"answer {i}" for i in ids]}


def _constant(videos, conditions):
    return torch.full((len(conditions),), 0.5), {}


def test_with_multi_reward_flattened_details(monkeypatch):
    """MultiReward names details "<reward>/<key>": failures and reasons must still be found and merged."""
    _JUDGE_CALLS.clear()
    # factories registered for this test only: monkeypatch removes them afterwards, so known_rewards() stays clean
    monkeypatch.setitem(REWARDS, "test_async_judge", RegisteredReward(lambda config, device: _flaky_judge, "video"))
    monkeypatch.setitem(REWARDS, "test_async_constant", RegisteredReward(lambda config, device: _constant, "video"))
    multi = MultiReward({"test_async_judge": 1.0, "test_async_constant": 1.0})
    runner = AsyncRewardRunner(multi, failure_policy="wait", max_retries=1, sleep=lambda s: None)
    runner.submit(0, *make_batch(0))
    (r,) = runner.collect()
    runner.close()
    assert _JUDGE_CALLS == [4, 1] and r.valid.all()
    assert r.scores["test_async_judge"].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert r.scores["avg"].tolist() == pytest.approx([0.25, 0.3, 0.35, 0.4])
    assert r.details["test_async_judge/raw"] == [f"answer {i}" for i in range(4)]
    assert not r.details["test_async_judge/failed"].any()


# ----------------------------------------------------------------------------------------------------
# exclusion and advantages

GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
GROUP_REWARDS = torch.tensor([0.9, 0.1, float("nan"), 0.5, 0.3, 0.4, 0.2, 0.8, 0.6, 0.6, 0.7, float("nan")])


def test_exclusion_mask_policies():
    valid = torch.isfinite(GROUP_REWARDS)
    keep, counts = exclusion_mask(valid, GROUPS, "sample")
    assert torch.equal(keep, valid)
    assert counts == {"excluded_samples": 2, "excluded_groups": 0, "failed_samples": 2, "affected_groups": 2}
    keep, counts = exclusion_mask(valid, GROUPS, "group")
    assert keep.tolist() == [False] * 4 + [True] * 4 + [False] * 4  # the whole group goes
    assert counts == {"excluded_samples": 8, "excluded_groups": 2, "failed_samples": 2, "affected_groups": 2}
    with pytest.raises(ValueError):
        exclusion_mask(valid, GROUPS, "other")


def test_failed_reward_never_enters_advantages_as_zero():
    keep, _ = exclusion_mask(torch.isfinite(GROUP_REWARDS), GROUPS, "sample")
    adv, excluded, stats = masked_group_advantages(GROUP_REWARDS, GROUPS, keep)
    ref, _ = group_advantages(GROUP_REWARDS[keep], GROUPS[keep])
    assert torch.equal(adv[keep], ref)  # statistics of the kept subset only
    assert (adv[~keep] == 0).all() and torch.equal(excluded, ~keep)
    assert stats["excluded_samples"].item() == 2
    # group 0 over its three kept rewards (0.9, 0.1, 0.5): mean 0.5
    std = torch.tensor([0.9, 0.1, 0.5], dtype=torch.float64).std(unbiased=False)
    assert adv[0].item() == pytest.approx(0.4 / (std.item() + 1e-4), rel=1e-5)
    # filling the failure with 0 would have dragged group 0's mean down and changed every advantage in it
    naive, _ = group_advantages(torch.nan_to_num(GROUP_REWARDS, nan=0.0), GROUPS)
    assert not torch.allclose(naive[keep & (GROUPS == 0)], adv[keep & (GROUPS == 0)], atol=1e-3)
    assert naive[2].item() < -1  # and the failed sample itself would be trained as a bad video
    # untouched groups are identical either way
    assert torch.allclose(naive[GROUPS == 1], adv[GROUPS == 1])


def test_group_policy_advantages_and_all_excluded():
    keep, _ = exclusion_mask(torch.isfinite(GROUP_REWARDS), GROUPS, "group")
    adv, excluded, _ = masked_group_advantages(GROUP_REWARDS, GROUPS, keep)
    assert (adv[GROUPS != 1] == 0).all() and excluded.tolist() == (~keep).tolist()
    ref, _ = group_advantages(GROUP_REWARDS[GROUPS == 1], GROUPS[GROUPS == 1])
    assert torch.equal(adv[GROUPS == 1], ref)
    none = torch.zeros(12, dtype=torch.bool)
    adv, excluded, stats = masked_group_advantages(GROUP_REWARDS, GROUPS, none)
    assert (adv == 0).all() and excluded.all() and stats["trained_prompt_num"].item() == 0
    with pytest.raises(ValueError, match="non-finite"):
        masked_group_advantages(GROUP_REWARDS, GROUPS, torch.ones(12, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------------
# a whole outage: every sample of a batch failed after the retries -> RewardServerDown, whatever the form


def _all_failed(form):
    """A reward that answers nothing: NaN with a `failed` flag and a reason (UnifiedReward's form), or bare NaN."""
    calls = []

    def reward(videos, conditions):
        calls.append(len(conditions))
        scores = torch.full((len(conditions),), float("nan"))
        if form == "bare_nan":
            return {"judge": scores, "avg": scores.clone()}, {}
        failed = torch.ones(len(conditions), dtype=torch.bool)
        return scores, {"judge/failed": failed,
                        "judge/failure_reason": ["gave up after 1 attempts: HTTP 500: injected"] * len(conditions)}

    return reward, calls


@pytest.mark.parametrize("form", ["nan_with_reason", "bare_nan"])
@pytest.mark.parametrize("policy,calls_expected", [("wait", [4, 4, 4]), ("drop_group", [4])])
def test_batch_with_no_valid_sample_after_retries_is_server_down(policy, calls_expected, form):
    reward, calls = _all_failed(form)
    sleeps = []
    runner = AsyncRewardRunner(reward, failure_policy=policy, max_retries=2, retry_backoff_s=0.1, sleep=sleeps.append)
    runner.submit("b3", *make_batch(0))
    with pytest.raises(RewardServerDown) as err:
        runner.collect()
    runner.close()
    assert calls == calls_expected  # "wait" retries the whole outage before calling the server down
    assert sleeps == ([0.1, 0.2] if policy == "wait" else [])
    message = str(err.value)
    assert "\n" not in message and "every one of the 4 samples of batch b3 failed" in message
    assert ("HTTP 500: injected" if form == "nan_with_reason" else "non-finite reward") in message
    assert err.value.batch_id == "b3" and len(err.value.reasons) == 4 and all(err.value.reasons)


def test_outage_that_recovers_within_the_retries_is_not_server_down():
    calls = []

    def recovering(videos, conditions):
        calls.append(len(conditions))
        scores = videos[:, 0, 0, 0, 0].clone()
        if len(calls) == 1:
            scores[:] = float("nan")  # the judge was restarting
        elif len(calls) == 2:
            scores[0] = float("nan")  # back, but one request still lost
        return scores, {}

    with AsyncRewardRunner(recovering, failure_policy="wait", max_retries=1, sleep=lambda s: None) as runner:
        runner.submit(0, *make_batch(0))
        (r,) = runner.collect()
    assert calls == [4, 4]
    assert r.valid.tolist() == [False, True, True, True]  # one sample excluded, the run goes on
    assert r.scores[1:].tolist() == [1.0, 2.0, 3.0]


def test_one_batch_down_among_healthy_ones_raises_after_every_job_finished():
    finished = []

    def by_batch(videos, conditions):
        batch = int(videos[0, 0, 0, 0, 0]) // 100
        time.sleep(0.02 * (3 - batch))
        finished.append(batch)
        scores = videos[:, 0, 0, 0, 0].clone()
        if batch == 1:
            scores[:] = float("nan")
        elif batch == 2:
            scores[0] = float("nan")  # partial: excluded, never server down
        return scores, {}

    runner = AsyncRewardRunner(by_batch, max_workers=3, failure_policy="drop_group")
    for b in range(3):
        runner.submit(b, *make_batch(b))
    with pytest.raises(RewardServerDown, match="batch 1"):
        runner.collect()
    runner.close()
    assert sorted(finished) == [0, 1, 2]  # no job left running behind the exception
