import json

from recam.engine.health import SAMPLE_RULES, diagnose_step
from recam.infra.checkpoint import checkpoint_before, latest_checkpoint, point_latest


def _ckpt(root, epoch, intact=True):
    d = root / f"epoch_{epoch:04d}"
    d.mkdir(parents=True)
    if intact:
        (d / "state.json").write_text(json.dumps({"epoch": epoch}))
    return d


def test_checkpoint_before_skips_the_weights_that_drew_a_collapsed_epoch(tmp_path):
    # epoch_NNNN holds the weights that sample epoch NNNN: a reward collapse seen in epoch 2 condemns epoch_0002
    for e in (0, 1, 2):
        _ckpt(tmp_path, e)
    point_latest(tmp_path, "epoch_0002")
    assert latest_checkpoint(tmp_path).name == "epoch_0002"
    assert checkpoint_before(tmp_path, 2).name == "epoch_0001"
    assert checkpoint_before(tmp_path, 1).name == "epoch_0000"
    assert checkpoint_before(tmp_path, 0) is None
    point_latest(tmp_path, "epoch_0001")
    assert latest_checkpoint(tmp_path).name == "epoch_0001"
    assert not list(tmp_path.glob(".*tmp"))


def test_checkpoint_before_ignores_incomplete_folders_and_other_names(tmp_path):
    _ckpt(tmp_path, 0)
    _ckpt(tmp_path, 1, intact=False)  # a crash mid-write leaves no state.json
    (tmp_path / "epoch_best").mkdir()
    assert checkpoint_before(tmp_path, 2).name == "epoch_0000"


def test_reward_findings_and_only_they_send_a_rollback_past_latest():
    base = {"step": 5, "epoch": 1, "loss": 0.01, "mean_ratio": 1.0, "zero_std_ratio": 0.0, "std_reward": 0.1}
    history = [{**base, "step": 4, "epoch": 0, "mean_reward": 0.6, "reward_cam_score": 0.2}]
    collapsed = diagnose_step({**base, "mean_reward": 0.1, "reward_cam_score": 0.01}, history)
    assert {f.rule for f in collapsed} and {f.rule for f in collapsed} <= SAMPLE_RULES
    blown = diagnose_step({**base, "mean_ratio": 50.0, "mean_reward": 0.6, "reward_cam_score": 0.2}, history)
    assert blown and not ({f.rule for f in blown} & SAMPLE_RULES)  # a bad step is caught before it is applied
