"""Checkpoint selection on validation conditions: the rule, the split it reads, and the log it is rebuilt from."""

import math

import pytest

from config import grpo
from recam.domains.camera.world import SyntheticWorld
from recam.engine.selection import select_checkpoint
from recam.infra import runlog


def ev(cam, fid):
    return {"val/cam_score": cam, "val/fidelity": fid}


def test_best_metric_among_checkpoints_that_keep_the_guard():
    evals = [ev(0.12, 0.24), ev(0.19, 0.20), ev(0.17, 0.235), ev(0.15, 0.26)]
    # epoch 1 is best on cam but loses 0.04 fidelity; epoch 2 loses 0.005, inside the 0.01 allowed
    assert select_checkpoint(evals, "val/cam_score", "val/fidelity", 0.01) == 2
    assert select_checkpoint(evals, "val/cam_score", "val/fidelity", 0.05) == 1
    assert select_checkpoint(evals, "val/cam_score") == 1  # no guard


def test_base_is_reported_when_nothing_beats_it():
    evals = [ev(0.20, 0.24), ev(0.19, 0.30), ev(0.25, 0.10)]
    assert select_checkpoint(evals, "val/cam_score", "val/fidelity", 0.01) == 0
    assert select_checkpoint(evals[:1], "val/cam_score", "val/fidelity", 0.01) == 0


def test_ties_go_to_the_earlier_checkpoint_and_nan_never_wins():
    evals = [ev(0.10, 0.2), ev(0.15, 0.2), ev(0.15, 0.2), ev(math.nan, 0.2), ev(0.3, math.nan)]
    assert select_checkpoint(evals, "val/cam_score", "val/fidelity", 0.0) == 1
    # the guard exactly at the floor is admissible (>=)
    assert select_checkpoint([ev(0.1, 0.25), ev(0.2, 0.24)], "val/cam_score", "val/fidelity", 0.01) == 1


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="base"):
        select_checkpoint([], "val/cam_score")
    with pytest.raises(ValueError, match="max_drop"):
        select_checkpoint([ev(0.1, 0.2)], "val/cam_score", "val/fidelity", -0.1)
    with pytest.raises(KeyError, match="val/fidelity"):
        select_checkpoint([ev(0.1, 0.2), {"val/cam_score": 0.3}], "val/cam_score", "val/fidelity", 0.01)


def test_loop_agrees_with_an_independent_formulation():
    import random

    rng = random.Random(0)
    for _ in range(200):
        evals = [ev(rng.random(), rng.random()) for _ in range(rng.randint(1, 6))]
        drop = rng.choice([0.0, 0.01, 0.1, 0.5])
        floor = evals[0]["val/fidelity"] - drop
        admissible = [0] + [i for i in range(1, len(evals)) if evals[i]["val/fidelity"] >= floor]
        best = max(admissible, key=lambda i: (evals[i]["val/cam_score"], -i))
        assert select_checkpoint(evals, "val/cam_score", "val/fidelity", drop) == best


def test_validation_scenes_are_in_neither_other_split():
    ids = {split: {SyntheticWorld(split, 40, conditions_per_scene=4).scene_id(i) for i in range(40)}
           for split in ("train", "heldout", "val")}
    assert all(len(v) == 10 for v in ids.values())
    assert not ids["val"] & ids["train"] and not ids["val"] & ids["heldout"]
    v = SyntheticWorld("val", 4)[0]
    assert v.split == "val" and v.condition_id.startswith("val/")


def test_resume_keeps_exactly_the_evaluations_of_the_weights_it_continues_from(tmp_path):
    config = grpo.get_config("smoke")
    config.logging.wandb_mode = "disabled"
    log = runlog.RunLog(tmp_path, config)
    log.eval_record("start", 0, ev(0.1, 0.2), epoch=-1, checkpoint="epoch_0000")
    log.eval_record("epoch_0002", 2, ev(0.2, 0.2), epoch=1, checkpoint="epoch_0002")
    log.eval_record("epoch_0004", 4, ev(0.3, 0.2), epoch=3, checkpoint="epoch_0004")
    log.truncate_after(2)  # resume (or roll back) from checkpoint epoch_0002: its evaluation stays
    assert [r["checkpoint"] for r in log.read_evals()] == ["epoch_0000", "epoch_0002"]
    log.truncate_after(0)  # back to the base
    assert [r["checkpoint"] for r in log.read_evals()] == ["epoch_0000"]
