import numpy as np
import pytest
import torch

from recam.domains.camera.world import SyntheticWorld, collate_conditions
from rewards import REWARDS, MultiReward, RegisteredReward, build_reward, build_rewards, get_reward, known_rewards
from rewards.cam_score import CamScore, cam_score, geodesic_deg
from rewards.fidelity import fidelity


@pytest.fixture(scope="module")
def heldout():
    world = SyntheticWorld("heldout", 32, seed=0)
    return collate_conditions([world[i] for i in range(32)])


def test_estimator_accuracy_on_ground_truth_renders(heldout):
    scores, d = cam_score(heldout["target_video"], heldout["conditions"])
    median_rot = float(d["rot_err_placed_mean"].median())
    print(f"cam_score estimator on 32 held-out GT renders: median RotErr per frame {median_rot:.3f} deg, "
          f"median TransErr per frame {float(d['trans_err_placed_mean'].median()):.4f}, "
          f"mean score {float(scores.mean()):.3f}")
    assert median_rot <= 2.0
    assert d["failed_frames"].sum() == 0 and ((scores >= 0) & (scores <= 1)).all()


def test_ground_truth_beats_a_video_that_follows_the_source_cameras(heldout):
    gt, _ = cam_score(heldout["target_video"], heldout["conditions"])
    src, d = cam_score(heldout["source_video"], heldout["conditions"])
    assert (gt > src).float().mean() >= 0.9
    assert float(gt.mean()) - float(src.mean()) > 0.3
    assert float(d["rot_err_placed_mean"].median()) > 2.0


@pytest.mark.parametrize("kind", ["zeros", "nan", "noise"])
def test_garbage_scores_zero_and_counts_reasons_without_raising(heldout, kind):
    v = heldout["target_video"][:4]
    bad = {"zeros": torch.zeros_like(v), "nan": torch.full_like(v, float("nan")),
           "noise": torch.rand(v.shape, generator=torch.Generator().manual_seed(0)) * 2 - 1}[kind]
    scores, d = cam_score(bad, heldout["conditions"][:4])
    # every frame unplaced scores as the worst camera (RotErr 180 deg, TransErr 2): below any recovered camera
    assert (scores < 1e-6).all() and torch.isfinite(scores).all() and not d["failed"].any()
    assert int(d["failed_frames"].sum()) == 4 * v.shape[2]
    assert sum(d["fail_reason"].values()) == 4 * v.shape[2]
    assert set(d["fail_reason"]) <= {"too_few_landmarks", "pnp_failed", "non_finite_pixels"}


def test_rotation_error_matches_hand_value():
    a = np.deg2rad(30.0)
    R = np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1]])
    assert geodesic_deg(R[None], np.eye(3)[None])[0] == pytest.approx(30.0, abs=1e-6)


def test_fidelity_is_one_for_ground_truth_and_low_for_noise_and_nan_for_nan(heldout):
    gt = heldout["target_video"][:4]
    conds = heldout["conditions"][:4]
    f_gt, _ = fidelity(gt, conds)
    f_noise, _ = fidelity(torch.rand_like(gt) * 2 - 1, conds)
    f_src, _ = fidelity(heldout["source_video"][:4], conds)
    assert torch.allclose(f_gt, torch.ones(4))
    assert (f_noise < 0.1).all() and (f_src < f_gt).all()
    flicker = gt.clone()
    flicker[:, :, 1::2] += 0.3  # every other frame brighter: flicker the ground truth does not have
    f_flicker, d = fidelity(flicker.clamp(-1, 1), conds)
    assert (d["temporal"] < 0.1).all() and (f_flicker < 0.2).all()
    f_nan, _ = fidelity(torch.full_like(gt, float("nan")), conds)
    assert torch.isnan(f_nan).all()


def test_registry_and_weighted_average(heldout):
    # the camera domain's rewards are those of its sample kind; asking for them by kind registers them
    assert known_rewards("video") == ["cam_score", "discriminator", "fidelity", "unifiedscore"]
    assert {"cam_score", "fidelity", "unifiedscore", "discriminator"} <= set(known_rewards())
    with pytest.raises(ValueError, match="camscore"):
        get_reward("camscore")
    with pytest.raises(ValueError, match="camscore"):
        MultiReward({"camscore": 1.0})
    m = MultiReward({"cam_score": 2.0, "fidelity": 1.0})
    v, c = heldout["source_video"][:4], heldout["conditions"][:4]
    scores, details = m(v, c)
    cam, _ = cam_score(v, c)
    fid, _ = fidelity(v, c)
    torch.testing.assert_close(scores["avg"], (2 * cam + fid) / 3)
    assert "cam_score/rot_err_sum" in details and "fidelity/psnr" in details


def test_built_in_rewards_are_found_by_their_decorators_and_load_by_kind():
    # builtin_rewards reads rewards/*.py and the motion and toy domains' rewards modules (declared by recam.domains)
    # without importing them; what it reads must be what they register
    import importlib

    import recam.domains  # noqa: F401  (declares recam/domains/motion/rewards.py)
    from rewards import builtin_rewards, reward_kind

    found = builtin_rewards()
    assert {n: k for n, (k, _) in found.items()} == {
        "cam_score": "video", "fidelity": "video", "unifiedscore": "video", "discriminator": "video",
        "motion_alignment": "motion", "motion_retrieval": "motion", "motion_physics": "motion",
        "target": "points", "near": "points"}
    for name, (kind, module) in found.items():
        importlib.import_module(module)
        assert REWARDS[name].scores == kind == reward_kind(name)
    assert {m for k, m in found.values() if k == "motion"} == {"recam.domains.motion.rewards"}
    assert known_rewards("motion") == ["motion_alignment", "motion_physics", "motion_retrieval"]
    assert reward_kind("no_such_reward") is None


def test_a_reward_must_say_what_it_scores():
    from rewards import register_reward

    with pytest.raises(TypeError):
        register_reward("test_no_kind")
    with pytest.raises(ValueError, match="scores"):
        register_reward("test_no_kind", scores="")
    assert "test_no_kind" not in REWARDS


def test_pure_rewards_are_built_as_the_functions_themselves(heldout):
    # Wrapping cam_score and fidelity as objects must not move their numbers.
    from config.base import get_config

    assert isinstance(build_reward("cam_score", get_config()), CamScore) and build_reward("fidelity", None) is fidelity
    v, c = heldout["target_video"][:3], heldout["conditions"][:3]
    m = MultiReward({"cam_score": 1.0, "fidelity": 1.0}, config=get_config())
    scores, details = m(v, c)
    direct_cam, d_cam = cam_score(v, c)
    direct_fid, d_fid = fidelity(v, c)
    assert torch.equal(scores["cam_score"], direct_cam) and torch.equal(scores["fidelity"], direct_fid)
    assert torch.equal(details["cam_score/rot_err_sum"], d_cam["rot_err_sum"])
    assert torch.equal(details["fidelity/psnr"], d_fid["psnr"])


class _Counter:
    """A reward object with state and a resource to release, as a judge or a critic is."""

    def __init__(self, value):
        self.value, self.calls, self.closed = value, 0, False

    def __call__(self, videos, conditions):
        self.calls += 1
        return torch.full((videos.shape[0],), self.value), {"calls": torch.full((videos.shape[0],), self.calls)}

    def close(self):
        self.closed = True


def test_multireward_holds_shared_objects_and_closes_only_what_it_built(monkeypatch):
    built = []

    def factory(config, device):
        built.append(_Counter(config["value"] if config else 0.5))
        return built[-1]

    monkeypatch.setitem(REWARDS, "test_counter", RegisteredReward(factory, "video"))
    shared = _Counter(0.25)
    video = torch.zeros(2, 3, 2, 4, 4)
    train = MultiReward({"test_counter": 1.0}, rewards={"test_counter": shared})
    evaluation = MultiReward({"test_counter": 1.0}, report=("test_counter",), rewards={"test_counter": shared})
    assert train.rewards["test_counter"] is shared is evaluation.rewards["test_counter"] and built == []
    train(video, [0, 1])
    scores, details = evaluation(video, [0, 1])
    assert shared.calls == 2 and details["test_counter/calls"].tolist() == [2, 2]  # one object, called twice
    assert scores["avg"].tolist() == [0.25, 0.25]
    train.close()
    evaluation.close()
    assert not shared.closed  # its owner (the domain) closes it
    own = MultiReward({"test_counter": 2.0}, config={"value": 0.75})
    assert own(video, [0, 1])[0]["test_counter"].tolist() == [0.75, 0.75] and len(built) == 1
    own.close()
    assert built[0].closed


def test_a_failing_factory_closes_the_rewards_built_before_it(monkeypatch):
    built = []

    def good(config, device):
        built.append(_Counter(0.5))
        return built[-1]

    def down(config, device):
        raise ConnectionError("judge at http://127.0.0.1:9 is unreachable")

    monkeypatch.setitem(REWARDS, "test_good", RegisteredReward(good, "video"))
    monkeypatch.setitem(REWARDS, "test_down", RegisteredReward(down, "video"))
    with pytest.raises(ConnectionError, match="unreachable"):
        MultiReward({"test_good": 1.0, "test_down": 1.0})
    with pytest.raises(ConnectionError, match="unreachable"):
        build_rewards(["test_good", "test_good", "test_down"])
    assert len(built) == 2 and all(r.closed for r in built)  # one per call: a name is built once per set


def test_camera_domain_shares_one_critic_between_training_evaluation_and_its_hook():
    from config import grpo
    from recam.domains.camera.domain import CameraDomain, DiscriminatorHook
    from rewards.discriminator import DiscriminatorReward

    c = grpo.get_config("tiny_cpu")
    c.reward.weights.discriminator = 0.5
    messages = []
    log = type("Log", (), {"info": lambda self, m: messages.append(m), "detail": lambda self, m: messages.append(m)})()
    domain = CameraDomain(c, "cpu", log)
    weights = dict(c.reward.weights)
    evaluation = domain.reward_fn(weights, report=("cam_score", "fidelity"))
    train = domain.reward_fn(weights)
    (hook,) = domain.hooks()
    critic = evaluation.rewards["discriminator"]
    assert isinstance(critic, DiscriminatorReward) and train.rewards["discriminator"] is critic
    assert isinstance(hook, DiscriminatorHook) and hook.disc is critic.discriminator
    assert train.rewards["cam_score"] is evaluation.rewards["cam_score"]  # one estimator (SfM workers) per run
    assert sum("discriminator: a critic" in m for m in messages) == 1  # built once
    # What the hook trains is what both rewards score with.
    video = torch.rand(2, 3, 4, 16, 16) * 2 - 1
    before = train.rewards["discriminator"](video, [0, 1])[0]
    hook.disc.train_step(torch.rand(2, 3, 4, 16, 16), torch.rand(2, 3, 4, 16, 16) * 2 - 1)
    after_train, _ = train.rewards["discriminator"](video, [0, 1])
    after_eval, _ = evaluation.rewards["discriminator"](video, [0, 1])
    assert not torch.equal(before, after_train) and torch.equal(after_train, after_eval)
    c.reward.weights.discriminator = 0.0
    assert CameraDomain(c, "cpu", log).hooks() == []  # no critic used: none built, none trained


def test_condition_without_landmarks_scores_zero_with_reason(heldout):
    # Real footage (recam.domains.camera.data) carries no 3D landmarks: every frame is unestimable, counted, nothing
    # raises.
    import dataclasses

    cond = dataclasses.replace(heldout["conditions"][0], landmarks=torch.zeros(0, 3),
                               landmark_colors=torch.zeros(0, 3))
    video = heldout["target_video"][:1]
    scores, d = cam_score(video, [cond])
    assert float(scores[0]) < 1e-6 and not d["failed"][0]
    assert d["fail_reason"] == {"scene_has_too_few_landmarks": video.shape[2]}
    assert int(d["frames_ok"][0]) == 0 and torch.isnan(d["rot_err_placed_mean"][0])
    # the sum counts every unplaced frame at 180 deg: a video the estimator cannot read never shows a small error
    assert float(d["rot_err_sum"][0]) == pytest.approx(180.0 * video.shape[2]) and float(d["placed_fraction"][0]) == 0


def test_reported_rewards_are_scored_but_never_enter_avg(heldout):
    v, c = heldout["source_video"][:4], heldout["conditions"][:4]
    m = MultiReward({"cam_score": 1.0, "fidelity": 0.0}, report=("fidelity", "cam_score"))
    scores, details = m(v, c)
    cam, _ = cam_score(v, c)
    fid, _ = fidelity(v, c)
    torch.testing.assert_close(scores["avg"], cam)
    torch.testing.assert_close(scores["fidelity"], fid)
    assert "fidelity/psnr" in details and m.report == ("fidelity",)
    with pytest.raises(ValueError, match="fidlity"):
        MultiReward({"cam_score": 1.0}, report=("fidlity",))


def test_without_served_never_calls_a_served_reward_and_leaves_the_weighted_average_nan(monkeypatch):
    calls = {"served": 0, "local": 0}

    class Served:
        server = "http://127.0.0.1:1"

        def __call__(self, videos, conditions):
            calls["served"] += 1
            return torch.full((len(conditions),), 0.5), {}

    def local(videos, conditions):
        calls["local"] += 1
        return torch.full((len(conditions),), 0.25), {}

    monkeypatch.setitem(REWARDS, "test_served", RegisteredReward(lambda config, device: Served(), "video"))
    monkeypatch.setitem(REWARDS, "test_local", RegisteredReward(lambda config, device: local, "video"))
    m = MultiReward({"test_served": 1.0, "test_local": 1.0})
    assert m.served() == ["test_served"]
    full, _ = m(torch.zeros(2, 3, 1, 4, 4), ["a", "b"])
    assert full["avg"].tolist() == [0.375, 0.375] and calls == {"served": 1, "local": 1}
    skipped = m.without_served("its server is down")
    scores, details = skipped(torch.zeros(2, 3, 1, 4, 4), ["a", "b"])
    assert calls == {"served": 1, "local": 2}  # the served reward was not called again
    assert torch.isnan(scores["test_served"]).all() and torch.isnan(scores["avg"]).all()
    assert scores["test_local"].tolist() == [0.25, 0.25]
    assert details["test_served/skipped"] == ["its server is down"] * 2
    skipped.close()  # shares the objects: closes nothing
    assert m.rewards["test_served"] is not skipped.rewards["test_served"]
