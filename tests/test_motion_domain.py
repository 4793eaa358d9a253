"""The motion domain on the shared engine (recam/domains/motion/domain.py): batches and their padding masks, the
denoiser's padded frames, on-policy ratios of one (to rounding) under the frame mask, decoding, the motion rewards,
config checks, and an end-to-end run of the motion_smoke preset. Everything runs on an untrained tiny base and
evaluator written here, so nothing depends on committed checkpoints."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from config import grpo
from config.validate import ConfigError, validate, validate_files
from recam.domains.motion import evaluator as ev
from recam.domains.motion.domain import (
    MotionDomain,
    MotionSamples,
    WordTextConfig,
    WordTextEncoder,
    cosine_alphas_cumprod,
    save_base,
)
from recam.domains.motion.model import MotionDiffusionModel, tiny_config
from recam.domains.motion.skeleton import MAX_FRAMES, NUM_FEATURES, NUM_JOINTS
from recam.domains.motion.world import MotionWorld, reference_mean_std
from recam.engine.extensions.noise_subspace import SubspaceNoise
from recam.engine.rollout import per_sample_noise, rescore, rollout

# tiny tensors on a shared two-core machine: every test on one torch thread (conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """An untrained tiny base (model + word-level text encoder), a small untrained evaluator (the reward's network)
    and a small untrained grader of the other architecture."""
    root = tmp_path_factory.mktemp("motion")
    captions = [MotionWorld("train", 32, 0)[i].caption for i in range(32)]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        save_base(root / "base", MotionDiffusionModel(**tiny_config()),
                  WordTextEncoder.from_captions(captions, WordTextConfig(text_dim=tiny_config()["text_dim"])),
                  {"diffusion_steps": 1000, "noise_schedule": "cosine", "mask_frames": True, "prediction": "x0",
                   "data": "synthetic"})
        evaluator = ev.TextMotionEvaluator.from_captions(captions, word_dim=16, text_hidden=16, motion_channels=16,
                                                         motion_hidden=16, embed_dim=16)
        torch.manual_seed(1)
        grader = ev.TextMotionEvaluator.from_captions(captions, word_dim=16, text_hidden=16, motion_channels=16,
                                                      motion_hidden=16, embed_dim=16, architecture="transformer")
    mean, std = reference_mean_std()
    for net, name in ((evaluator, "evaluator"), (grader, "grader")):
        net.set_feature_stats(mean.copy(), std.copy())
        net.save(root / name)
    return {"base": root / "base", "evaluator": root / "evaluator", "grader": root / "grader"}


def smoke_config(folders):
    c = grpo.get_config("motion_smoke")
    c.motion.pretrained = str(folders["base"])
    c.motion.evaluator = str(folders["evaluator"])
    c.motion.metric_evaluator = str(folders["grader"])
    return c


@pytest.fixture(scope="module")
def domain(folders):
    d = MotionDomain(smoke_config(folders), "cpu", None)
    d.policy = d.build_policy()
    return d


def test_collate_shapes_masks_and_text(domain):
    train = domain.datasets().train
    batch = domain.collate(train, [0, 0, 3, 3])
    items = [train[i] for i in (0, 0, 3, 3)]
    x = batch.inputs
    assert x.features.shape == (4, NUM_FEATURES, 1, MAX_FRAMES)
    assert x.lengths.tolist() == [it.length for it in items]
    frames = torch.arange(MAX_FRAMES)[None, :]
    assert torch.equal(x.padding_mask, frames >= x.lengths[:, None])
    assert bool((x.features[x.padding_mask[:, None, None, :].expand_as(x.features)] == 0).all())
    assert x.captions == [it.caption for it in items]
    assert x.text_emb.shape == (4, tiny_config()["text_dim"]) and torch.isfinite(x.text_emb).all()
    assert torch.equal(x.text_emb[0], x.text_emb[1]) and not torch.equal(x.text_emb[0], x.text_emb[2])
    mask = domain.element_mask(batch)
    assert mask.shape == (4, 1, 1, MAX_FRAMES) and mask.dtype == torch.bool
    assert mask[:, 0, 0].sum(1).tolist() == x.lengths.tolist()
    # ids are the world's, stable: the same condition has the same id in every run
    assert domain.condition_id(train, 3) == train[3].condition_id == "synth-train-s0-000003"
    cached = domain.collate(train, [3], cache={})
    assert torch.equal(cached.inputs.text_emb[0], x.text_emb[2])


def test_denoiser_keeps_padding_at_zero_and_matches_guided_forward(domain):
    batch = domain.collate(domain.datasets().train, [1, 2])
    x = torch.randn(2, NUM_FEATURES, 1, MAX_FRAMES, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([700, 700])
    with torch.no_grad():
        out = domain.denoiser(domain.policy, batch, contextlib.nullcontext)(x, t)
        guided = domain.policy.guided_forward(x, t, batch.inputs.text_emb, domain.config.motion.guidance_scale,
                                              batch.inputs.padding_mask)
    padded = batch.inputs.padding_mask[:, None, None, :].expand_as(out)
    assert bool((out[padded] == 0).all()) and bool((out[~padded] != 0).all())
    torch.testing.assert_close(out[~padded], guided[~padded], rtol=1e-5, atol=1e-5)


# The rollout scores 8 samples and training rescores 3 of them: a different matmul shape, whose reduction order (and
# so the last bits of the log-prob) may differ on another CPU code path. Max |ratio - 1| measured: 0 natively
# (AVX512) and under ATEN_CPU_CAPABILITY=avx2 or default alone; 1.2e-7 with MKL_CBWR=COMPATIBLE (ATEN avx2) or two
# threads, 1.8e-7 with MKL_CBWR=COMPATIBLE (ATEN default), 2.4e-7 with MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=AVX2,
# i.e. 1-2 float32 ulps of 1; x20. The unmasked rescore's log-prob differs by 1.9e-3 (every element) and 0.27.
RATIO_ROUNDING = 5e-6


@pytest.mark.parametrize("subspace", [None, (8, 8)], ids=["every_element", "noise_subspace"])
def test_rollout_and_rescore_give_ratio_one_under_the_frame_mask(domain, subspace):
    scheduler = domain.scheduler("cpu")
    if subspace is not None:  # sample.noise_frequencies / noise_channels: the log-prob of the subspace coordinates
        scheduler = SubspaceNoise(scheduler, subspace[0], domain.principal_channels(subspace[1]))
    T = scheduler.num_train_steps
    assert 0 < T < scheduler.num_steps  # the last step, to clean data, is never trained
    assert scheduler.prediction_type == "sample" and scheduler.eta == domain.config.motion.eta
    torch.testing.assert_close(scheduler.alphas_cumprod, cosine_alphas_cumprod(1000))
    train = domain.datasets().train
    indices = [4, 4, 4, 4, 5, 5, 5, 5]
    batch = domain.collate(train, indices)
    mask = domain.element_mask(batch)
    noise = per_sample_noise([(0, 0, n) for n in range(len(indices))], scheduler.num_steps + 1, domain.sample_shape())
    out = rollout(domain.denoiser(domain.policy, batch, contextlib.nullcontext), noise, scheduler, mask)
    assert out.states.shape == (8, T + 1, *domain.sample_shape()) and out.log_probs.shape == (8, T)
    padded = (~mask).expand_as(out.final)
    assert bool((out.final[padded] == 0).all())  # the final motion's padding is exactly zero
    # training rescores other micro-batches, in training mode, with gradients
    sel = torch.tensor([6, 1, 3])
    sub = domain.collate(train, [indices[i] for i in sel])
    domain.policy.train()
    try:
        for j in range(T):
            new = rescore(domain.denoiser(domain.policy, sub, contextlib.nullcontext), out.states[sel], scheduler, j,
                          domain.element_mask(sub)).log_prob
            ratio = torch.exp(new.detach() - out.log_probs[sel, j])
            assert float((ratio - 1).abs().max()) <= RATIO_ROUNDING, (j, ratio)
        # the mask matters: averaging over every frame scores the same transition differently
        unmasked = rescore(domain.denoiser(domain.policy, sub, contextlib.nullcontext), out.states[sel], scheduler,
                           0).log_prob.detach()
        assert float((unmasked - out.log_probs[sel, 0]).abs().max()) > 100 * RATIO_ROUNDING
    finally:
        domain.policy.eval()


def test_principal_channels_are_numpy_s_leading_singular_vectors_of_the_training_frames(domain):
    train = domain.datasets().train
    frames = np.concatenate([np.asarray(train[i].features)[:int(train[i].length)] for i in range(len(train))])
    _, values, right = np.linalg.svd(frames.astype(np.float64), full_matrices=False)
    got = domain.principal_channels(6).double().numpy()
    assert got.shape == (NUM_FEATURES, 6)
    np.testing.assert_allclose(got.T @ got, np.eye(6), atol=1e-5)
    for k in range(6):  # each column the k-th right singular vector, up to its sign
        assert abs(float(got[:, k] @ right[k])) == pytest.approx(1.0, abs=1e-4), (k, values[:7])
    with pytest.raises(ValueError, match="sample.noise_channels must be in"):
        domain.principal_channels(0)


def test_decode_gives_joints_cut_at_the_lengths_and_references_are_the_ground_truth(domain):
    heldout = domain.datasets().heldout
    batch = domain.collate(heldout, [0, 1, 2])
    reference = domain.references(batch)["target"]
    assert isinstance(reference, MotionSamples)
    assert reference.features.shape == (3, MAX_FRAMES, NUM_FEATURES)
    assert reference.joints.shape == (3, MAX_FRAMES, NUM_JOINTS, 3)
    for i, item in enumerate(batch.conditions):
        n = item.length
        # decoding the stored features recovers the world's own joints
        torch.testing.assert_close(reference.joints[i, :n], torch.as_tensor(item.joints[:n]), atol=2e-4, rtol=0)
        assert bool((reference.joints[i, n:] == 0).all()) and bool((reference.features[i, n:] == 0).all())
    decoded = domain.decode_batch(torch.randn(3, *domain.sample_shape()), batch)
    assert decoded.joints.shape == (3, MAX_FRAMES, NUM_JOINTS, 3) and decoded.lengths.tolist() == [
        it.length for it in batch.conditions]
    # shaped like a batch where the reward runner needs it: rows by index, shape, detach
    rows = decoded[torch.tensor([2, 0])]
    assert len(rows) == 2 and rows.shape[0] == 2 and torch.equal(rows.joints[0], decoded.joints[2])


def test_shuffled_reference_is_the_next_conditions_ground_truth_and_reads_as_misaligned(domain):
    """The floor of what reads the caption: each condition gets the next one's real motion (its own length), so
    physics stays that of real motion while R-precision in the grader's pools falls to about chance (3/32 at top
    3, against the ground truth's own)."""
    heldout = domain.datasets().heldout
    batch = domain.collate(heldout, list(range(len(heldout))))
    refs = domain.references(batch)
    target, shuffled = refs["target"], refs["shuffled"]
    n = len(batch.conditions)
    for i in range(n):
        torch.testing.assert_close(shuffled.joints[i], target.joints[(i + 1) % n])
        assert int(shuffled.lengths[i]) == int(target.lengths[(i + 1) % n])
    grader = ev.TextMotionEvaluator.load(ROOT / "checkpoints" / "motion_grader")  # trained: it reads captions
    with torch.no_grad():
        text = grader.encode_text([c.caption for c in batch.conditions]).numpy()
        top3 = {name: ev.r_precision(text, grader.encode_motion(m.features, m.lengths).numpy(), n)[2]
                for name, m in refs.items()}
    assert top3["shuffled"] < 0.3 < top3["target"]
    assert "shuffled" not in domain.references(domain.collate(heldout, [0]))  # one condition has no other motion


def test_rewards_on_references_are_finite_in_the_unit_interval_and_nan_on_nan(domain):
    heldout = domain.datasets().heldout
    batch = domain.collate(heldout, [0, 1, 2, 3])
    fn = domain.reward_fn({"motion_alignment": 1.0, "motion_physics": 0.5})
    reference = domain.references(batch)["target"]
    scores, details = fn(reference, batch.conditions)
    for name in ("motion_alignment", "motion_physics", "avg"):
        assert torch.isfinite(scores[name]).all() and bool(((scores[name] >= 0) & (scores[name] <= 1)).all()), name
    assert {"motion_physics/skating", "motion_alignment/text_motion_cosine"} <= set(details)
    # a NaN in a real frame fails that sample (NaN, never a number); NaN in padding is never read
    broken = MotionSamples(reference.features.clone(), reference.joints.clone(), reference.lengths)
    broken.features[1, 5, 10] = float("nan")
    broken.joints[1, 5, 3, 1] = float("nan")
    n = int(reference.lengths[2])
    broken.features[2, n + 1] = float("nan")
    broken.joints[2, n + 1] = float("nan")
    got, _ = fn(broken, batch.conditions)
    for name in ("motion_alignment", "motion_physics", "avg"):
        assert torch.isnan(got[name][1]) and torch.isfinite(got[name][[0, 2, 3]]).all(), name
    torch.testing.assert_close(got["avg"][[0, 2, 3]], scores["avg"][[0, 2, 3]])


def test_retrieval_reward_matches_a_loop_over_training_negatives(domain):
    heldout = domain.datasets().heldout
    batch = domain.collate(heldout, [0, 1, 2])
    fn = domain.reward_fn({"motion_retrieval": 1.0})
    reward = domain._built_rewards["motion_retrieval"]
    negatives = domain.negative_captions(domain.config.motion.retrieval_negatives)
    train_captions = {domain.datasets().train[i].caption for i in range(len(domain.datasets().train))}
    assert reward.negatives and set(reward.negatives) <= train_captions  # never held-out text
    reference = domain.references(batch)["target"]
    scores, details = fn(reference, batch.conditions)
    evaluator, tau = reward.evaluator, reward.temperature
    motion = evaluator.encode_motion(reference.features.float(), torch.as_tensor(reference.lengths).long())
    for i, cond in enumerate(batch.conditions):
        own = float(ev.similarity(evaluator.encode_text([cond.caption]), motion[i:i + 1]))
        negs = [c for c in dict.fromkeys(negatives) if c != cond.caption]
        cos = [float(ev.similarity(evaluator.encode_text([c]), motion[i:i + 1])) for c in negs]
        expected = np.exp(own / tau) / (np.exp(own / tau) + 31 * np.mean(np.exp(np.array(cos) / tau)))
        assert float(scores["motion_retrieval"][i]) == pytest.approx(expected, rel=1e-4)
        assert float(details["motion_retrieval/negative_cosine"][i]) == pytest.approx(np.mean(cos), abs=1e-5)


def test_split_metrics_follow_the_protocol_and_are_repeatable(domain):
    heldout = domain.datasets().heldout
    batch = domain.collate(heldout, list(range(len(heldout))))
    reference = domain.references(batch)["target"]
    items = domain.evaluation_items(reference, batch)
    metrics = domain.evaluation_metrics(items)
    assert metrics["fid"] == pytest.approx(0.0, abs=1e-6)  # the references against themselves
    assert metrics["reward_net/fid"] == pytest.approx(0.0, abs=1e-6)
    assert len(heldout) == 32 and metrics["r_precision_pool"] == 32  # the preset evaluates one full pool
    assert 0 <= metrics["r_precision_top1"] <= metrics["r_precision_top2"] <= metrics["r_precision_top3"] <= 1
    assert metrics == domain.evaluation_metrics(items)  # fixed shuffles: two evaluations of the same weights agree
    # per condition: each caption's top-3 hit rate over the shuffles, whose mean is the split's R-precision
    rows = metrics["rows/r_precision_top3"]
    assert len(rows) == 32 and all(0 <= r <= 1 for r in rows)
    assert np.mean(rows) == pytest.approx(metrics["r_precision_top3"], abs=1e-12)
    assert np.mean(metrics["rows/reward_net/r_precision_top3"]) == pytest.approx(metrics["reward_net/r_precision_top3"])
    items[0]["finite"] = False
    broken = domain.evaluation_metrics(items)
    assert broken["nonfinite_motions"] == 1.0 and broken["rows/r_precision_top3"][0] is None


def test_grader_and_reward_network_metrics_come_from_their_own_networks(domain, folders):
    """The protocol in the grader (eval/...) and in the reward's network (eval/reward_net/...), against each network
    called directly on the same motions: one pool of all 32 held-out conditions (so every shuffle gives the same
    R-precision), ranks from a distance matrix, MM-Dist the mean distance of true pairs, FID from eigenvalues."""
    heldout = domain.datasets().heldout
    batch = domain.collate(heldout, list(range(len(heldout))))
    noise = torch.randn(len(heldout), *domain.sample_shape(), generator=torch.Generator().manual_seed(5))
    decoded = domain.decode_batch(batch.inputs.features + 0.5 * noise, batch)
    metrics = domain.evaluation_metrics(domain.evaluation_items(decoded, batch))
    assert metrics["r_precision_pool"] == 32 and metrics["grader_is_reward_net"] == 0.0
    reference = domain.references(batch)["target"]
    for prefix, folder in (("", folders["grader"]), ("reward_net/", folders["evaluator"])):
        net = ev.load_evaluator(folder)
        with torch.no_grad():
            text = net.encode_text(batch.inputs.captions).double()
            motion = net.encode_motion(decoded.features, decoded.lengths).double()
            real = net.encode_motion(reference.features, reference.lengths).double()
        dist = torch.cdist(text, motion)
        beaten = (dist < dist.diagonal()[:, None]).sum(1)  # motions strictly nearer than the true one
        for k in (1, 2, 3):
            assert metrics[f"{prefix}r_precision_top{k}"] == pytest.approx(float((beaten < k).double().mean()))
        assert metrics[f"{prefix}mm_dist"] == pytest.approx(float(dist.diagonal().mean()), rel=1e-5)
        a, b = real.numpy(), motion.numpy()
        ca, cb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
        root = np.sqrt(np.clip(np.linalg.eigvals(ca @ cb).real, 0, None)).sum()
        want = float(((a.mean(0) - b.mean(0)) ** 2).sum() + np.trace(ca) + np.trace(cb) - 2 * root)
        assert metrics[f"{prefix}fid"] == pytest.approx(want, rel=1e-3, abs=1e-6)
    # the two networks disagree, so the checks above tell them apart
    assert metrics["mm_dist"] != pytest.approx(metrics["reward_net/mm_dist"], rel=1e-3)
    labels = dict((key, label) for label, key in domain.summary_rows)
    assert labels["eval/r_precision_top3"] == "R-precision top-3 (grader)"
    assert labels["eval/reward_net/r_precision_top3"] == "R-precision top-3 (reward's own network)"
    assert labels["eval/r_precision_pool"] == "R-precision pool size"


def test_r_precision_pools_hold_32_and_a_smaller_pool_is_named(folders):
    rng = np.random.default_rng(0)

    def items(n):
        return [{"finite": True, **{f"{p}{k}": rng.normal(size=4).astype(np.float32)
                                    for p in ("", "reward_net/") for k in ("text", "motion", "real")}}
                for _ in range(n)]

    d = MotionDomain(smoke_config(folders), "cpu", None)
    for n in (32, 40, 64, 100):
        assert d.evaluation_metrics(items(n))["r_precision_pool"] == 32, n
    c = smoke_config(folders)
    c.data.num_heldout_conditions = 8
    d = MotionDomain(c, "cpu", None)
    assert len(d.datasets().heldout) == 8
    assert d.evaluation_metrics(items(8))["r_precision_pool"] == 8
    labels = [label for label, _ in d.summary_rows]
    assert "R-precision in one pool of 8, not 32, top-3 (grader)" in labels
    assert not any(label.startswith("R-precision top") for label in labels)


@pytest.mark.parametrize("grader", ["", "copy"])
def test_grading_with_the_reward_network_is_labelled(folders, tmp_path, grader):
    """motion.metric_evaluator '' (the reward's folder) or a copy of that folder: the metrics are the reward
    network's, flagged grader_is_reward_net, reported once, and labelled so in the summary."""
    c = smoke_config(folders)
    if grader == "copy":
        import shutil

        c.motion.metric_evaluator = str(shutil.copytree(folders["evaluator"], tmp_path / "copy"))
    else:
        c.motion.metric_evaluator = ""
    d = MotionDomain(c, "cpu", None)
    d.policy = d.build_policy()
    d.reward_fn({"motion_alignment": 1.0})
    heldout = d.datasets().heldout
    batch = d.collate(heldout, list(range(len(heldout))))
    metrics = d.evaluation_metrics(d.evaluation_items(d.references(batch)["target"], batch))
    assert d.metric_evaluator() is d._built_rewards["motion_alignment"].evaluator
    assert metrics["grader_is_reward_net"] == 1.0 and not any(k.startswith("reward_net/") for k in metrics)
    labels = dict((key, label) for label, key in d.summary_rows)
    assert labels["eval/r_precision_top3"] == "R-precision top-3 (reward's own network, not independent)"


def test_an_evaluator_trained_on_other_data_is_refused(folders, tmp_path):
    import shutil

    grader = shutil.copytree(folders["grader"], tmp_path / "grader")
    (grader / "provenance.json").write_text(json.dumps({"data": "humanml3d:data/HumanML3D"}))
    c = smoke_config(folders)
    c.motion.metric_evaluator = str(grader)
    with pytest.raises(ConfigError, match=r"motion\.metric_evaluator=.*trained on 'humanml3d"):
        validate_files(c)
    (grader / "provenance.json").write_text(json.dumps({"data": "synthetic"}))
    validate_files(c)


def test_humanml3d_folders_give_the_same_batches_as_the_world(folders, tmp_path):
    """data.source 'humanml3d': a HumanML3D-layout folder written from synthetic motions is read as conditions with
    HumanML3D's ids, lengths cut to MDM's units of 4, its own Mean/Std, and decodes to the motions' joints."""
    world = MotionWorld("train", 10, 0)
    mean, std = reference_mean_std()
    root = tmp_path / "HumanML3D"
    (root / "new_joint_vecs").mkdir(parents=True)
    (root / "texts").mkdir()
    ids = [f"{i:06d}" for i in range(10)]
    for motion_id, item in zip(ids, (world[i] for i in range(10)), strict=True):
        raw = item.features[:item.length] * std + mean
        np.save(root / "new_joint_vecs" / f"{motion_id}.npy", raw.astype(np.float32))
        tokens = " ".join(f"{w}/X" for w in item.caption.split())
        (root / "texts" / f"{motion_id}.txt").write_text(f"{item.caption}#{tokens}#0.0#0.0\n")
    np.save(root / "Mean.npy", mean.astype(np.float32))
    np.save(root / "Std.npy", std.astype(np.float32))
    for split, members in (("train", ids[:6]), ("val", ids[6:8]), ("test", ids[8:])):
        (root / f"{split}.txt").write_text("\n".join(members) + "\n")
    c = smoke_config(folders)
    c.data.source, c.data.root = "humanml3d", str(root)
    c.data.num_train_conditions, c.data.num_heldout_conditions, c.data.num_val_conditions = 0, 0, 2
    validate(c, 1)
    validate_files(c)
    d = MotionDomain(c, "cpu", None)
    splits = d.datasets()
    assert (len(splits.train), len(splits.heldout), len(splits.val)) == (6, 2, 2)
    assert d.condition_id(splits.train, 2) == f"000002:0-{world[2].length}:1"
    batch = d.collate(splits.train, [2, 2, 5])
    assert batch.inputs.features.shape == (3, NUM_FEATURES, 1, MAX_FRAMES)
    lengths = batch.inputs.lengths.tolist()
    assert all(n % 4 == 0 and n <= world[i].length for n, i in zip(lengths, (2, 2, 5), strict=True))
    assert d.element_mask(batch)[:, 0, 0].sum(1).tolist() == batch.inputs.lengths.tolist()
    reference = d.references(batch)["target"]
    n = int(batch.inputs.lengths[2])
    torch.testing.assert_close(reference.joints[2, :n], torch.as_tensor(world[5].joints[:n]), atol=2e-4, rtol=0)
    c.data.root = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"data\.root"):
        validate_files(c)


@pytest.mark.parametrize("mutate,field", [
    (lambda c: c.reward.weights.__setitem__("cam_score", 1.0), "reward.weights.cam_score"),
    (lambda c: setattr(c.eval, "report_rewards", "fidelity"), "eval.report_rewards"),
    (lambda c: setattr(c.motion, "eta", 0.0), "motion.eta"),
    (lambda c: setattr(c.motion, "format", "onnx"), "motion.format"),
    (lambda c: setattr(c.motion, "diffusion_steps", 4), "motion.diffusion_steps"),
    (lambda c: setattr(c.motion, "log_prob_reduction", "max"), "motion.log_prob_reduction"),
    (lambda c: setattr(c.motion, "physics_jitter_scale", 0.0), "motion.physics_jitter_scale"),
    (lambda c: setattr(c.motion, "text_encoder", "clip"), "motion.clip_path"),
    (lambda c: setattr(c.sample, "num_steps", 1), "sample.num_steps"),
    (lambda c: setattr(c.data, "source", "recammaster"), "data.source"),
    (lambda c: setattr(c.data, "num_train_conditions", 1), "data.num_train_conditions"),
])
def test_broken_motion_config_names_the_field(mutate, field):
    c = grpo.get_config("motion_smoke")
    mutate(c)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(c, 1)


def test_motion_presets_validate_and_check_their_files(folders, tmp_path):
    for name in ("motion_smoke", "motion_tiny_cpu"):
        c = grpo.get_config(name)
        validate(c, 1)
    c = smoke_config(folders)
    validate_files(c)
    c.motion.diffusion_steps = 500  # the base recorded 1000
    with pytest.raises(ConfigError, match=r"motion\.diffusion_steps"):
        validate_files(c)
    c = smoke_config(folders)
    c.motion.pretrained = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"motion\.pretrained"):
        validate_files(c)


def test_motion_smoke_trains_end_to_end(folders, tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "train_recam.py"), "--config", "config/grpo.py:motion_smoke",
           f"--config.run_dir={tmp_path}", f"--config.motion.pretrained={folders['base']}",
           f"--config.motion.evaluator={folders['evaluator']}", f"--config.motion.metric_evaluator={folders['grader']}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    c = grpo.get_config("motion_smoke")
    k, per_epoch = c.sample.k, c.sample.batch_size * c.sample.num_batches_per_epoch
    epochs = [r for r in records if r["type"] == "epoch"]
    assert [e["epoch"] for e in epochs] == list(range(c.num_epochs))
    for e in epochs:
        counts = Counter(e["dataset_indices"])
        assert len(e["dataset_indices"]) == per_epoch and set(counts.values()) == {k}, counts
        assert all(cid.startswith("synth-train-") for cid in e["condition_ids"])
        assert e["first_step_ratio_deviation"] == 0.0  # on-policy first step, padded frames masked
    evals = {r["tag"]: r for r in records if r["type"] == "eval"}
    for tag in ("start", "final"):
        r = evals[tag]
        assert r["eval/num_conditions"] == c.data.num_heldout_conditions
        for key in ("eval/motion_alignment", "eval/motion_physics", "eval/r_precision_top3", "eval/fid",
                    "eval/mm_dist", "eval/diversity", "eval/skating", "val/motion_alignment",
                    "eval/reward_net/r_precision_top3", "eval/reward_net/fid"):
            assert key in r, key
        assert r["eval/r_precision_pool"] == 32 and r["eval/grader_is_reward_net"] == 0
        rows = r["rows/eval/r_precision_top3"]  # per held-out condition, for the summary's paired interval
        assert len(rows) == r["eval/num_conditions"]
        assert np.mean(rows) == pytest.approx(r["eval/r_precision_top3"], abs=1e-9)
    reference = next(r for r in records if r["type"] == "reference")
    assert 0 <= reference["ref_target/motion_physics"] <= 1
    assert reference["ref_target/fid"] == pytest.approx(0, abs=1e-6)  # the ground truth against itself
    summary = (tmp_path / "summary.md").read_text()
    assert "| R-precision top-3 (grader) |" in summary and "| physics |" in summary
    r3 = next(line for line in summary.splitlines() if line.startswith("| R-precision top-3 (grader) |"))
    assert "±" in r3  # its change is paired over the held-out conditions
    assert "| R-precision top-3 (reward's own network) |" in summary
    assert "| R-precision pool size | 32.0000 |" in summary
    assert list((tmp_path / "motions" / "final").glob("*.gif"))
