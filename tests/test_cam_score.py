"""cam_score's errors and scoring rule against hand-computed values and OpenCV's own rotation angles; SfM's choice of
solve on worker results; SfM worker failures (timeout, crash, a video without features) and what each scores."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from rewards.cam_score import (
    SUMMARY_KEYS,
    WORST_ROT_DEG,
    WORST_TRANS,
    CamScore,
    CamScoreSettings,
    frame_indices,
    geodesic_deg,
    to_uint8_frames_torch,
    trajectory_errors,
)
from rewards.pose import NOT_SENT, PoseEstimate, landmarks, to_uint8_frames
from rewards.pose.landmarks import estimate_video
from rewards.pose.sfm import SfMEstimator, SfMSettings, combine


def rot_y(deg: float) -> np.ndarray:
    a = math.radians(deg)
    return np.array([[math.cos(a), 0, math.sin(a)], [0, 1, 0], [-math.sin(a), 0, math.cos(a)]])


def w2c_from(R_c2w: np.ndarray, centre: np.ndarray) -> np.ndarray:
    """World-to-camera [R | t] of a camera at `centre` with camera-to-world rotation R_c2w."""
    R = R_c2w.T
    return np.concatenate([R, (-R @ centre)[:, None]], 1)


def trajectory(F=5, step=(1.0, 0.0, 0.0), yaw_deg=0.0) -> np.ndarray:
    """(F, 3, 4): the camera moves by `step` per frame and turns by yaw_deg per frame."""
    return np.stack([w2c_from(rot_y(yaw_deg * f), np.array(step) * f) for f in range(F)])


def estimate(poses: np.ndarray, ok=None, has_translation=True, reasons=None, method="test") -> PoseEstimate:
    ok = np.ones(len(poses), bool) if ok is None else np.asarray(ok)
    poses = np.where(ok[:, None, None], poses, np.nan)
    reasons = reasons or [None if o else "not_registered" for o in ok]
    return PoseEstimate(poses=poses, ok=ok, reasons=reasons, method=method, has_translation=has_translation)


def in_other_world(poses: np.ndarray, scale: float, yaw_deg: float, shift) -> np.ndarray:
    """The same trajectory expressed in another world frame (rotated, shifted) and unit (scaled): what SfM returns."""
    M = np.eye(4)
    M[:3, :3], M[:3, 3] = rot_y(yaw_deg), shift  # new-world-from-old-world
    out = []
    for P in poses:
        P4 = np.vstack([P, [0, 0, 0, 1]]) @ np.linalg.inv(M)  # camera-from-new-world
        out.append(np.concatenate([P4[:3, :3], scale * P4[:3, 3:]], 1))
    return np.stack(out)


# ------------------------------------------------------------------------------------------------------- errors


def test_geodesic_angle_matches_opencv_rodrigues():
    rng = np.random.default_rng(0)
    Rs = [cv2.Rodrigues(rng.normal(size=3) * 0.8)[0] for _ in range(12)]
    expected = [math.degrees(np.linalg.norm(cv2.Rodrigues(a.T @ b)[0])) for a, b in zip(Rs[:6], Rs[6:], strict=True)]
    np.testing.assert_allclose(geodesic_deg(np.stack(Rs[:6]), np.stack(Rs[6:])), expected, atol=1e-6)


def test_errors_ignore_world_frame_and_scale_but_not_direction():
    gt = trajectory(step=(0.5, 0.0, 0.2), yaw_deg=3.0)
    same = trajectory_errors(estimate(in_other_world(gt, 7.0, 40.0, (1.0, -2.0, 3.0))), gt, 0.05)
    np.testing.assert_allclose(same["rot"], 0.0, atol=1e-6)
    np.testing.assert_allclose(same["trans"], 0.0, atol=1e-9)
    np.testing.assert_allclose(same["cammc"], 0.0, atol=1e-6)
    # truck left instead of right: normalised centres (-f/4, 0, 0) against (f/4, 0, 0), so TransErr = f/2
    mirrored = trajectory_errors(estimate(trajectory(step=(-1.0, 0, 0))), trajectory(step=(1.0, 0, 0)), 0.05)
    np.testing.assert_allclose(mirrored["trans"], [0.0, 0.5, 1.0, 1.5, 2.0], atol=1e-9)
    np.testing.assert_allclose(mirrored["rot"], 0.0, atol=1e-6)
    # CamMC by hand: R equal, t = -R c differs by the centre difference
    np.testing.assert_allclose(mirrored["cammc"], [0.0, 0.5, 1.0, 1.5, 2.0], atol=1e-9)


def test_rotation_error_is_the_extra_turn_relative_to_the_first_frame():
    gt = trajectory(yaw_deg=2.0)
    est = trajectory(yaw_deg=4.0)
    err = trajectory_errors(estimate(est), gt, 0.05)
    np.testing.assert_allclose(err["rot"], [0, 2, 4, 6, 8], atol=1e-6)


def test_reference_is_the_first_placed_frame():
    gt = trajectory(step=(1.0, 0, 0))
    ok = np.array([False, True, True, True, True])
    err = trajectory_errors(estimate(in_other_world(gt, 2.0, 10.0, (0, 1, 0)), ok=ok), gt, 0.05)
    assert err["ref"] == 1 and np.isnan(err["rot"][0])
    np.testing.assert_allclose(err["rot"][1:], 0.0, atol=1e-6)
    np.testing.assert_allclose(err["trans"][1:], 0.0, atol=1e-9)


def test_a_target_that_stands_still_judges_translation_by_the_videos_parallax():
    gt = trajectory(step=(0.001, 0, 0), yaw_deg=2.0)  # a pan with a millimetre of drift
    est = trajectory(step=(0.0, 0.0, 1.0), yaw_deg=2.0)  # normalised, the drift's direction would be all error
    err = trajectory_errors(estimate(est), gt, 0.05)
    # CamI2V's TransErr is undefined without a direction to normalise; the poses' own translation has no scale
    assert err["translation"] == "parallax_unknown" and np.isnan(err["trans"]).all()
    s = CamScoreSettings(trans_scale=0.25, static_parallax=0.01)
    cases = {"still": 0.0, "wandering": 0.01, "far": 1.0, "unmeasured": math.nan}
    ests = []
    for parallax in cases.values():
        e = estimate(est)
        e.parallax = parallax
        ests.append(e)
    scores, d = CamScore(s).score(ests, [gt] * len(cases))
    # by hand: rotations right, per frame exp(-min(2, 0.25 * parallax / 0.01) / 0.25); not measured: the worst
    expected = [1.0, math.exp(-1.0), math.exp(-WORST_TRANS / 0.25), math.exp(-WORST_TRANS / 0.25)]
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-5)
    assert d["translation"] == ["parallax", "parallax", "parallax", "parallax_unknown"]
    np.testing.assert_allclose(d["static_target_parallax"].numpy(), [0.0, 0.01, 1.0, np.nan])
    assert torch.isnan(d["trans_err_sum"]).all() and torch.isnan(d["trans_err_placed_mean"]).all()
    # a target that translates leaves static_target_parallax empty: its eval mean is over still targets only
    _, moving = CamScore(s).score([estimate(trajectory())], [trajectory()])
    assert torch.isnan(moving["static_target_parallax"]).all() and moving["translation"] == ["scored"]


def cami2v_sums(gt_w2c: np.ndarray, est_w2c: np.ndarray) -> tuple[float, float, float]:
    """CamI2V's RotErr (in degrees), TransErr and CamMC written out as its evaluation/glomap_evaluation.py `metric`
    computes them, frame by frame: camera-to-world poses relative to the first (utils/common.py relative_pose
    "left"), translations divided by their largest norm (normalize_t), errors summed over frames."""
    def relative_c2w(w2c):
        c2w = [np.linalg.inv(np.vstack([P, [0, 0, 0, 1]])) for P in w2c]
        rel = [np.linalg.inv(c2w[0]) @ M for M in c2w]
        scale = max(np.linalg.norm(M[:3, 3]) for M in rel)
        return [np.concatenate([M[:3, :3], M[:3, 3:] / scale], 1) for M in rel]

    rot = trans = cammc = 0.0
    for g, e in zip(relative_c2w(gt_w2c), relative_c2w(est_w2c), strict=True):
        rot += math.degrees(math.acos(max(-1.0, min(1.0, (np.trace(g[:, :3].T @ e[:, :3]) - 1) / 2))))
        trans += float(np.linalg.norm(g[:, 3] - e[:, 3]))
        cammc += float(np.linalg.norm((g - e).ravel()))
    return rot, trans, cammc


def test_cami2v_sums_by_hand():
    # target: trucks 1, 1, 0 to the right without turning; estimate: twice as far, then 3 forward, turning 10, 0, 30
    gt = np.stack([w2c_from(np.eye(3), np.array(c, float)) for c in ((0, 0, 0), (1, 0, 0), (2, 0, 0), (2, 0, 0))])
    est = np.stack([w2c_from(rot_y(y), np.array(c, float))
                    for y, c in ((0, (0, 0, 0)), (10, (2, 0, 0)), (0, (4, 0, 0)), (30, (4, 0, 3)))])
    # normalised centres: target / 2 -> x = 0, .5, 1, 1; estimate / 5 -> (0,0,0), (.4,0,0), (.8,0,0), (.8,0,.6)
    trans = [0.0, 0.1, 0.2, math.sqrt(0.2 ** 2 + 0.6 ** 2)]
    frob2 = [4 * (1 - math.cos(math.radians(y))) for y in (0, 10, 0, 30)]  # ||R_y - I||_F^2 = 2 (3 - tr R_y)
    cammc = [math.sqrt(f + t ** 2) for f, t in zip(frob2, trans, strict=True)]
    _, d = CamScore(CamScoreSettings()).score([estimate(est)], [gt])
    assert float(d["rot_err_sum"][0]) == pytest.approx(40.0, abs=1e-4)
    assert float(d["trans_err_sum"][0]) == pytest.approx(sum(trans), rel=1e-6)
    assert float(d["cammc_sum"][0]) == pytest.approx(sum(cammc), rel=1e-6)
    assert float(d["rot_err_placed_mean"][0]) == pytest.approx(10.0, abs=1e-4)
    assert float(d["cammc_placed_mean"][0]) == pytest.approx(sum(cammc) / 4, rel=1e-6)
    assert float(d["placed_fraction"][0]) == 1.0
    np.testing.assert_allclose(cami2v_sums(gt, est), (40.0, sum(trans), sum(cammc)), rtol=1e-9)


def test_sums_match_cami2v_written_out_on_random_trajectories():
    rng = np.random.default_rng(1)

    def random_trajectory(F=6):
        return np.stack([w2c_from(cv2.Rodrigues(rng.normal(size=3) * 0.3)[0], rng.normal(size=3)) for _ in range(F)])

    pairs = [(random_trajectory(), random_trajectory()) for _ in range(5)]
    _, d = CamScore(CamScoreSettings()).score([estimate(e) for _, e in pairs], [g for g, _ in pairs])
    for i, (g, e) in enumerate(pairs):
        expected = cami2v_sums(g, e)
        got = [float(d[k][i]) for k in ("rot_err_sum", "trans_err_sum", "cammc_sum")]
        np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_a_checkpoint_that_breaks_the_estimator_shows_larger_sums_not_smaller_errors():
    from recam.infra.reports import summarise_eval

    gt = trajectory(step=(1.0, 0, 0))
    good, wrong = estimate(gt), estimate(trajectory(step=(1.0, 0, 0), yaw_deg=5.0))  # 5 deg more turn per frame
    cs = CamScore(CamScoreSettings())

    def evaluation(second):
        _, d = cs.score([good, second], [gt, gt])
        rows = [{f"cam_score/{k}": float(d[k][i]) for k in SUMMARY_KEYS} for i in range(2)]
        return summarise_eval(rows)

    read_wrong, unreadable = evaluation(wrong), evaluation(PoseEstimate.failed(5, "not_registered", "sfm"))
    # per placed frame the unreadable video drops out and its checkpoint looks better; the sums do not let it
    assert unreadable["eval/rot_err_placed_mean"] < read_wrong["eval/rot_err_placed_mean"]
    assert unreadable["eval/rot_err_sum"] == pytest.approx((0 + 5 * 180.0) / 2, abs=1e-3)
    assert read_wrong["eval/rot_err_sum"] == pytest.approx((0 + (5 + 10 + 15 + 20)) / 2, abs=1e-3)
    for key in ("rot_err_sum", "trans_err_sum", "cammc_sum"):
        assert unreadable[f"eval/{key}"] > read_wrong[f"eval/{key}"], key
    assert unreadable["eval/placed_fraction"] == 0.5 and read_wrong["eval/placed_fraction"] == 1.0


def test_losing_frames_never_lowers_the_rotation_sum():
    gt = trajectory(step=(1.0, 0, 0))
    est = trajectory(step=(1.0, 0, 0), yaw_deg=3.0)
    cs = CamScore(CamScoreSettings())
    masks = [np.ones(5, bool), np.array([1, 1, 1, 1, 0], bool), np.array([1, 0, 1, 0, 1], bool),
             np.array([0, 1, 1, 1, 1], bool)]
    _, d = cs.score([estimate(est, ok=m) for m in masks], [gt] * len(masks))
    sums = d["rot_err_sum"].numpy()
    assert (sums[1:] > sums[0]).all() and (d["rot_err_placed_mean"][1:2] < d["rot_err_placed_mean"][0]).all()
    np.testing.assert_allclose(d["placed_fraction"].numpy(), [1.0, 0.8, 0.6, 0.8])


def test_frames_not_sent_count_in_neither_sum_nor_fraction_and_an_unjudged_video_has_no_errors():
    gt = trajectory(yaw_deg=2.0)
    ok = np.array([True, False, False, False, True])
    est = estimate(gt, ok=ok, reasons=[None, NOT_SENT, "not_registered", NOT_SENT, None])
    down = PoseEstimate.failed(5, "server_error: HTTP 503", "served", unavailable=True)
    _, d = CamScore(CamScoreSettings()).score([est, down], [gt, gt])
    assert float(d["placed_fraction"][0]) == pytest.approx(2 / 3)
    assert float(d["rot_err_sum"][0]) == pytest.approx(WORST_ROT_DEG, abs=1e-3)  # one scored frame unplaced
    assert all(math.isnan(float(d[k][1])) for k in SUMMARY_KEYS)


# ------------------------------------------------------------------------------------------------------ scoring


def test_score_by_hand_and_the_reference_frame_is_not_counted():
    s = CamScoreSettings(rot_scale_deg=10.0, trans_scale=0.25)
    gt = trajectory(step=(1.0, 0, 0))
    est = trajectory(step=(1.0, 0, 0), yaw_deg=5.0)
    scores, d = CamScore(s).score([estimate(est)], [gt])
    expected = np.mean([math.exp(-5 * f / 10) for f in range(1, 5)])  # frames 1..4; TransErr 0 (same centres)
    assert float(scores[0]) == pytest.approx(expected, rel=1e-5)
    assert float(d["rot_err_placed_mean"][0]) == pytest.approx(np.mean([0, 5, 10, 15, 20]), abs=1e-4)
    assert float(d["rot_err_sum"][0]) == pytest.approx(0 + 5 + 10 + 15 + 20, abs=1e-4)
    assert d["rot_err_per_frame"][0][4] == pytest.approx(20.0, abs=1e-3)


def test_failing_never_beats_a_wrong_camera_and_is_counted_not_silent():
    cs = CamScore(CamScoreSettings())
    gt = trajectory(step=(1.0, 0, 0))
    wrong = [trajectory(step=(-1.0, 0, 0)), trajectory(step=(0, 1.0, 0), yaw_deg=-30.0), trajectory(step=(0, 0, 0))]
    nothing = PoseEstimate.failed(5, "not_registered", "sfm")
    half = estimate(gt, ok=[True, True, False, False, False])
    unknown_translation = estimate(np.concatenate([gt[:, :, :3], np.zeros((5, 3, 1))], 2), has_translation=False)
    scores, d = cs.score([estimate(w) for w in wrong] + [nothing, half, unknown_translation], [gt] * 6)
    floor = math.exp(-WORST_ROT_DEG / 10.0) * math.exp(-WORST_TRANS / 0.25)
    assert float(scores[3]) == pytest.approx(floor, rel=1e-4)  # everything at its worst value
    assert (scores[:3] > scores[3]).all()  # however wrong, a recovered camera scores above a failure
    # frames 2..4 missing: half the scored frames (1..4) perfect, the rest at the floor
    assert float(scores[4]) == pytest.approx((1 + floor * 3) / 4, rel=1e-4)
    # rotations right, translation not recovered: TransErr at its worst for every frame
    assert float(scores[5]) == pytest.approx(math.exp(-WORST_TRANS / 0.25), rel=1e-4)
    assert d["fail_reason"] == {"not_registered": 5 + 3}
    assert d["frames_ok"].tolist() == [5, 5, 5, 0, 2, 5] and not d["failed"].any()
    assert torch.isnan(d["rot_err_placed_mean"][3]) and torch.isnan(d["trans_err_placed_mean"][5])
    # the sums count what was not measured at its worst: nothing placed, three frames missing, no translation
    np.testing.assert_allclose(d["rot_err_sum"][3:].numpy(), [5 * WORST_ROT_DEG, 3 * WORST_ROT_DEG, 0.0], atol=1e-3)
    np.testing.assert_allclose(d["trans_err_sum"][3:].numpy(), [5 * WORST_TRANS, 3 * WORST_TRANS, 4 * WORST_TRANS],
                               atol=1e-5)
    np.testing.assert_allclose(d["placed_fraction"].numpy(), [1, 1, 1, 0, 0.4, 1])


def test_an_estimator_that_did_not_answer_gives_nan_with_a_reason():
    cs = CamScore(CamScoreSettings())
    down = PoseEstimate.failed(5, "server_error: HTTP 503", "served", unavailable=True)
    scores, d = cs.score([down, estimate(trajectory())], [trajectory()] * 2)
    assert math.isnan(float(scores[0])) and float(scores[1]) == pytest.approx(1.0)
    assert d["failed"].tolist() == [True, False]
    assert d["failure_reason"] == ["server_error: HTTP 503", None]


def test_frames_not_sent_are_left_out_not_failed():
    cs = CamScore(CamScoreSettings())
    gt = trajectory(yaw_deg=2.0)
    ok = np.array([True, False, True, False, True])
    est = estimate(gt, ok=ok, reasons=[None, NOT_SENT, None, NOT_SENT, None])
    scores, d = cs.score([est], [gt])
    assert float(scores[0]) == pytest.approx(1.0, abs=1e-6) and d["fail_reason"] == {}


def test_rotation_residual_is_translation_over_depth_for_a_rendered_point_cloud():
    from rewards.pose.sfm_solve import parallax_of_pair, rotation_residuals

    rng = np.random.default_rng(0)
    points = np.c_[rng.uniform(-1, 1, (200, 2)), np.full(200, 4.0)]  # a wall at depth 4
    K_ = np.array([[300.0, 0, 160], [0, 300.0, 120], [0, 0, 1]])

    def project(P):
        x = (points @ P[:, :3].T + P[:, 3]) @ K_.T
        return x[:, :2] / x[:, 2:]

    first = w2c_from(np.eye(3), np.zeros(3))
    turned = w2c_from(rot_y(7.0), np.zeros(3))
    slid = w2c_from(np.eye(3), np.array([0.2, 0.0, 0.0]))
    offsets = rotation_residuals(project(first), project(turned), first[:, :3], turned[:, :3], K_)
    np.testing.assert_allclose(offsets, 0.0, atol=1e-9)  # rotation alone explains a camera that turned
    px, rel = parallax_of_pair(rotation_residuals(project(first), project(slid), first[:, :3], slid[:, :3], K_), K_)
    assert px == pytest.approx(300 * 0.2 / 4.0) and rel == pytest.approx(0.2 / 4.0)  # f t / Z pixels; t / Z
    assert parallax_of_pair(np.full((5, 2), [3.0, 4.0]), K_, floor_px=1.5)[1] == pytest.approx(3.5 / 300)


@pytest.mark.parametrize("scene_id", [0, 1, 2])
def test_landmark_world_a_camera_asked_to_stand_still_is_punished_for_moving(scene_id):
    from recam.domains.camera import world

    scene = world.make_scene(scene_id)
    K_ = world.default_intrinsics(32)

    def render(kinds, amounts):
        w2c = world.c2w_to_w2c(world.trajectory_c2w(np.eye(4), kinds, amounts, scene.centre, 8))
        video = world.render(scene, torch.from_numpy(w2c), K_, 32, 32)
        frames = ((video.permute(1, 2, 3, 0).numpy() + 1) * 127.5 + 0.5).astype(np.uint8)
        return w2c, estimate_video(frames, K_.double().numpy(), scene.landmarks, scene.colors)

    still, still_est = render([], [])
    pan, pan_est = render(["pan"], [math.radians(11)])
    truck, truck_est = render(["truck"], [0.3])
    cs = CamScore(CamScoreSettings())
    scores, d = cs.score([still_est, pan_est, truck_est, truck_est], [still, pan, still, truck])
    still_ok, pan_ok, truck_vs_still, truck_own = scores.tolist()
    assert still_ok >= 0.9 and pan_ok >= 0.9, d["static_target_parallax"]  # targets that do not translate
    assert truck_own - truck_vs_still >= 0.1 and still_ok > truck_vs_still


def _landmarks_pixel_by_pixel(frame: np.ndarray, colors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """find_landmarks' rule written out over pixels, one frame."""
    h, w, _ = frame.shape
    L = len(colors)
    mass, su, sv, border = np.zeros(L), np.zeros(L), np.zeros(L), np.zeros(L)
    votes = []
    for v in range(h):
        for u in range(w):
            dist = [math.dist(frame[v, u], c) for c in colors]
            n = int(np.argmin(dist))
            wt = max(0.0, 1.0 - dist[n] / landmarks.COLOUR_RADIUS) ** 2
            votes.append((n, u, v, wt))
            mass[n] += wt
            su[n] += wt * u
            sv[n] += wt * v
            border[n] += wt if v in (0, h - 1) or u in (0, w - 1) else 0.0
    uc, vc = su / np.where(mass > 0, mass, 1), sv / np.where(mass > 0, mass, 1)
    spread2 = np.zeros(L)
    for n, u, v, wt in votes:
        spread2[n] += wt * ((u - uc[n]) ** 2 + (v - vc[n]) ** 2)
    spread = np.sqrt(spread2 / np.where(mass > 0, mass, 1))
    found = ((mass >= landmarks.MIN_MASS) & (spread <= landmarks.MAX_SPREAD_FRACTION * max(h, w))
             & (border <= landmarks.MAX_BORDER_SHARE * mass))
    uv = np.stack([uc, vc], -1)
    uv[~found] = np.nan
    return uv, found


def test_landmarks_of_a_stack_of_frames_are_each_frame_s_pixel_by_pixel():
    """The video's frames go through find_landmarks as one stack; each frame's answer is what the rule gives it
    pixel by pixel (a rendered orbit, where a landmark leaves the view, plus a frame of noise)."""
    from recam.domains.camera import world

    scene = world.make_scene(4)
    w2c = world.c2w_to_w2c(world.trajectory_c2w(np.eye(4), ["orbit"], [math.radians(40)], scene.centre, 6))
    video = world.render(scene, torch.from_numpy(w2c), world.default_intrinsics(24), 24, 24)
    frames = np.concatenate([(video.permute(1, 2, 3, 0).numpy() + 1) / 2,
                             np.random.default_rng(0).random((1, 24, 24, 3))]).astype(np.float64)
    uv, found = landmarks.find_landmarks(frames, scene.colors)
    assert uv.shape == (7, len(scene.colors), 2) and found.shape == (7, len(scene.colors))
    assert found[:6].sum() >= 6 * 4 and not found[6].any()  # the renders' landmarks found; noise has none
    for f, frame in enumerate(frames):
        uv_f, found_f = _landmarks_pixel_by_pixel(frame, scene.colors)
        np.testing.assert_array_equal(found[f], found_f)
        np.testing.assert_allclose(uv[f], uv_f, rtol=0, atol=1e-9)


# ------------------------------------------------------------------------ the landmark search in torch, batched




def _world_batch(n: int = 8, noisy: int = 3):
    """The synthetic world's target videos (B, 3, F, H, W) and conditions (6 and 7 landmarks), the last `noisy` of
    them degraded so that some landmarks are not found: grain, a colour cast, and a frame washed to grey."""
    from recam.domains.camera.world import SyntheticWorld

    world = SyntheticWorld("train", n, seed=0, conditions_per_scene=1)
    conds = [world[i] for i in range(n)]
    videos = torch.stack([c.target_video for c in conds])
    g = torch.Generator().manual_seed(0)
    for k, b in enumerate(range(n - noisy, n)):
        videos[b] = videos[b] + (0.05 + 0.075 * k) * torch.randn(videos[b].shape, generator=g)
        videos[b, 0] += 0.15 * k  # a red cast
        videos[b, :, k] = 0.0  # one frame washed out
    return videos.clamp(-1.2, 1.2), conds


def _host_frames(videos: torch.Tensor) -> list[np.ndarray]:
    """What cam_score hands estimate_video today: each video's uint8 frames as a view of its (3, F, H, W) tensor."""
    frames = ((videos.float().permute(0, 2, 3, 4, 1) + 1.0) / 2.0).numpy()
    return [to_uint8_frames(f) for f in frames]


def test_torch_quantisation_is_numpy_s_bit_for_bit():
    levels = np.arange(256, dtype=np.float32) / 255.0
    edges = np.concatenate([levels, (np.arange(256, dtype=np.float32) + 0.5) / 255.0, [-0.5, -0.0, 1.0, 1.5]])
    x = np.concatenate([edges, np.nextafter(edges, np.float32(2)), np.nextafter(edges, np.float32(-2)),
                        np.random.default_rng(0).uniform(-0.1, 1.1, 4096).astype(np.float32)]).astype(np.float32)
    np.testing.assert_array_equal(to_uint8_frames_torch(torch.from_numpy(x)).numpy(), to_uint8_frames(x))


@pytest.mark.usefixtures("one_thread")
def test_sqrt_nearest_rounds_as_numpy_does():
    rng = np.random.default_rng(0)
    s = np.concatenate([rng.random(20000) * 3, rng.random(20000) ** 8, [0.0, 1.0, 4.0, 0.25, 2.0 ** -60],
                        np.nextafter([1.0, 4.0, 2.0], 0), np.nextafter([1.0, 4.0, 2.0], 9)])
    np.testing.assert_array_equal(landmarks._sqrt_nearest(torch.from_numpy(s)).numpy(), np.sqrt(s))


@pytest.mark.usefixtures("one_thread")
def test_torch_landmark_search_is_numpy_s_on_world_and_degraded_videos():
    videos, conds = _world_batch()
    colors = [c.landmark_colors.double().numpy() for c in conds]
    counts = [len(c) for c in colors]
    assert len(set(counts)) > 1  # conditions of different landmark counts share the batch
    host = _host_frames(videos)
    frames = to_uint8_frames_torch((videos.permute(0, 2, 3, 4, 1) + 1.0) / 2.0)
    np.testing.assert_array_equal(frames.numpy(), np.stack(host))
    uv, found = landmarks.find_landmarks_torch(frames, colors, chunk=3)  # chunks of mixed counts
    L = max(counts)
    assert uv.shape == (len(conds), frames.shape[1], L, 2) and found.shape == uv.shape[:-1]
    missing = 0
    for b, (video, col) in enumerate(zip(host, colors, strict=True)):
        uv_np, found_np = landmarks.find_landmarks(np.asarray(video, np.float64) / 255.0, col)
        n = counts[b]
        np.testing.assert_array_equal(found[b, :, :n].numpy(), found_np)
        np.testing.assert_allclose(uv[b, :, :n].numpy(), uv_np, rtol=0, atol=1e-6)  # NaN where NaN
        # to the bit, in fact, on the frames cam_score hands over (see the next test for why it matters)
        np.testing.assert_array_equal(uv[b, :, :n].numpy(), uv_np)
        assert not found[b, :, n:].any() and uv[b, :, n:].isnan().all()  # the padding
        missing += int((~found_np).sum())
    assert missing > 0 and found[:-3].float().mean() > 0.8  # the degraded videos lose landmarks, the rest do not


@pytest.mark.usefixtures("one_thread")
def test_torch_landmark_search_gives_a_pixel_to_the_first_colour_at_the_rounded_nearest_distance():
    """numpy's owner is the first landmark at the least *rounded* distance: a colour listed first whose squared
    distance is an ulp larger than another's but rounds to the same root takes the pixel (torch's argmin over the
    squared distances alone would not give it)."""
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 256, (2, 12, 12, 3)).astype(np.uint8)
    x = frame.astype(np.float64) / 255.0
    base = np.array([0.3, 0.55, 0.7])
    colors = np.stack([base + [2e-16, 0, 0], base, [0.9, 0.1, 0.2], [0.05, 0.05, 0.9]])
    sq = (((x[..., None, :] - colors) ** 2).sum(-1))
    d = np.linalg.norm(x[..., None, :] - colors, axis=-1)
    assert (sq.argmin(-1) != d.argmin(-1)).any()  # the case arises on these pixels
    uv_np, found_np = landmarks.find_landmarks(x, colors)
    uv, found = landmarks.find_landmarks_torch(torch.from_numpy(frame)[None], [colors])
    np.testing.assert_array_equal(found[0].numpy(), found_np)
    np.testing.assert_array_equal(uv[0].numpy(), uv_np)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("pnp", ["torch", "opencv"])
def test_cam_score_searching_on_the_videos_device_scores_as_the_per_video_numpy_path(pnp):
    from rewards.pose.landmarks import LandmarkEstimator

    videos, conds = _world_batch()
    conds = list(conds)
    conds[1] = dataclasses.replace(conds[1], landmarks=conds[1].landmarks[:3],
                                   landmark_colors=conds[1].landmark_colors[:3])  # footage without landmarks
    videos[2, :, 1, 0, 0] = float("nan")  # not judged
    host, batched = CamScore(CamScoreSettings()), CamScore(CamScoreSettings())
    host.estimator = LandmarkEstimator(pnp=pnp)
    batched.estimator = LandmarkEstimator(processes=0, torch_on_cpu=True, pnp=pnp)
    assert not host.estimator.searches_on(videos.device) and batched.estimator.searches_on(videos.device)
    scores, details = host(videos, conds)
    scores_b, details_b = batched(videos, conds)
    assert float(scores[2]) < 1e-6 and details["frames_ok"][1] == 0 and details["frames_ok"][-1] > 0
    np.testing.assert_array_equal(scores_b.numpy(), scores.numpy())
    assert set(details_b) == set(details)
    for key, value in details.items():
        if key.startswith("seconds"):
            continue
        if isinstance(value, torch.Tensor):
            np.testing.assert_array_equal(details_b[key].numpy(), value.numpy(), err_msg=key)
        else:
            assert details_b[key] == value, key
    # the estimates themselves, frame by frame
    idx = frame_indices(videos.shape[2], 16)
    frames = to_uint8_frames_torch((videos[:, :, idx].permute(0, 2, 3, 4, 1) + 1.0) / 2.0)
    keep = [b for b in range(len(conds)) if b != 2]
    Ks = [conds[b].intrinsics.double().numpy() for b in keep]
    old = host.estimator.estimate([frames[b].numpy() for b in keep], Ks, [conds[b] for b in keep])
    new = batched.estimator.estimate_device_frames(frames[keep], Ks, [conds[b] for b in keep])
    for e_old, e_new in zip(old, new, strict=True):
        np.testing.assert_array_equal(e_new.poses, e_old.poses)
        np.testing.assert_array_equal(e_new.ok, e_old.ok)
        assert (e_new.reasons, e_new.method, e_new.video_reason, e_new.confidence) == \
            (e_old.reasons, e_old.method, e_old.video_reason, e_old.confidence)
        assert e_new.parallax == e_old.parallax or (math.isnan(e_new.parallax) and math.isnan(e_old.parallax))
        assert set(e_new.seconds) == set(e_old.seconds)


def test_pnp_in_a_pool_of_processes_gives_the_estimates_of_pnp_in_this_thread(monkeypatch):
    """With reward.cam.pnp="opencv", large batches solve PnP on spawned processes (threads gave no speedup: the
    GIL); the estimates are the same, to the bit, as solving them here, and close() ends the processes."""
    from rewards.pose import landmarks

    videos, conds = _world_batch()
    idx = frame_indices(videos.shape[2], 16)
    frames = to_uint8_frames_torch((videos[:, :, idx].permute(0, 2, 3, 4, 1) + 1.0) / 2.0)
    Ks = [c.intrinsics.double().numpy() for c in conds]
    here = landmarks.LandmarkEstimator(processes=0, torch_on_cpu=True, pnp="opencv").estimate_device_frames(
        frames, Ks, conds)
    monkeypatch.setattr(landmarks, "MIN_POOLED_VIDEOS", 2)
    pooled = landmarks.LandmarkEstimator(processes=2, torch_on_cpu=True, pnp="opencv")
    try:
        far = pooled.estimate_device_frames(frames, Ks, conds)
        assert pooled._pool is not None
    finally:
        pooled.close()
    assert pooled._pool is None and len(far) == len(here) == len(conds)
    for a, b in zip(here, far, strict=True):
        np.testing.assert_array_equal(a.poses, b.poses)
        assert (a.reasons, a.confidence, a.ok.tolist()) == (b.reasons, b.confidence, b.ok.tolist())


def test_pool_processes_share_the_node_s_cores(monkeypatch):
    from rewards.pose.landmarks import pnp_processes

    monkeypatch.setattr("os.cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert pnp_processes() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert pnp_processes() == 1


def test_frame_indices_are_even_and_keep_both_ends():
    assert frame_indices(81, 16).tolist()[0] == 0 and frame_indices(81, 16).tolist()[-1] == 80
    assert len(frame_indices(81, 16)) == 16 and frame_indices(5, 16).tolist() == [0, 1, 2, 3, 4]


def test_landmark_world_video_gets_the_reason_for_non_finite_pixels():
    from recam.domains.camera.world import SyntheticWorld

    cond = SyntheticWorld("heldout", 1, seed=0)[0]
    video = cond.target_video[None].clone()
    video[0, :, 3] = float("nan")
    scores, d = CamScore(CamScoreSettings())(video, [cond])
    assert float(scores[0]) < 1e-6 and d["fail_reason"] == {"non_finite_pixels": video.shape[2]}


# ------------------------------------------------------------------------------------------- SfM's choice of solve


def worker_result(full=None, rotation=None, points3d=500, residual=10.0, pairs=28, F=8):
    R = {f: rot_y(2.0 * f) for f in range(F)}
    return {"full": {f: w2c_from(R[f].T, np.array([0.1 * f, 0, 0])) for f in range(F)} if full is None else full,
            "rotation": {f: R[f] for f in range(F)} if rotation is None else rotation, "points3d": points3d,
            "reproj_px": 0.3, "residual_px": residual, "features": 900.0, "pairs": pairs, "seconds": {"extract": 1.0}}


def test_combine_keeps_the_full_solve_when_it_is_sound():
    e = combine(worker_result(), 8, SfMSettings())
    assert e.method == "sfm" and e.has_translation and e.ok.all()
    assert e.confidence["disagreement_deg"] == pytest.approx(0.0, abs=1e-6)


def test_combine_without_parallax_uses_rotations_and_a_camera_that_stayed_put():
    e = combine(worker_result(full={}, points3d=0, residual=0.3), 8, SfMSettings())
    assert e.method == "sfm_rotation_only" and e.has_translation and e.ok.all()
    np.testing.assert_allclose(e.poses[:, :, 3], 0.0)


@pytest.mark.parametrize("why", ["few_registered", "few_points", "poor_fit", "flipped"])
def test_combine_falls_back_to_rotations_with_translation_unknown(why):
    r = worker_result()
    if why == "few_registered":
        r["full"] = {f: P for f, P in r["full"].items() if f < 4}
    elif why == "few_points":
        r["points3d"] = 10
    elif why == "poor_fit":
        r["reproj_px"] = 5.0
    else:
        r["full"] = {f: w2c_from(rot_y(180.0 * (f % 2)), np.zeros(3)) for f in range(8)}  # flipped frames
    e = combine(r, 8, SfMSettings())
    assert e.method == "sfm_rotation_only" and not e.has_translation and e.ok.all()
    np.testing.assert_allclose(e.poses[:, :, :3], np.stack([r["rotation"][f] for f in range(8)]))


def test_combine_reports_why_nothing_was_placed():
    r = worker_result(full={}, rotation={}, points3d=0, residual=math.nan)
    r["features"] = 3.0
    none = combine(r, 8, SfMSettings())
    assert none.video_reason == "too_few_features" and not none.ok.any() and not none.unavailable
    few = combine(worker_result(full={}, rotation={0: np.eye(3), 1: np.eye(3)}, residual=math.nan), 8, SfMSettings())
    assert few.video_reason == "not_registered" and not few.unavailable


# ------------------------------------------------------------------------------------------------- SfM workers


def textured_frames(F=6, H=96, W=160, shift_px=3):
    """A random texture panned sideways: plenty of SIFT features, a pure image translation per frame."""
    rng = np.random.default_rng(0)
    tex = cv2.resize(rng.integers(0, 256, (H // 4, (W + F * shift_px) // 4, 3), dtype=np.uint8),
                     (W + F * shift_px, H), interpolation=cv2.INTER_CUBIC)
    return np.stack([tex[:, f * shift_px: f * shift_px + W] for f in range(F)])


def K_for(H, W):
    return np.array([[float(W), 0, (W - 1) / 2], [0, float(W), (H - 1) / 2], [0, 0, 1.0]])


def test_sfm_worker_past_its_timeout_is_killed_and_not_judged():
    est = SfMEstimator(SfMSettings(timeout_s=0.05))
    (e,) = est.estimate([textured_frames()], [K_for(96, 160)])
    assert e.unavailable and e.video_reason.startswith("sfm_timeout") and not e.ok.any()


def test_sfm_worker_crash_is_not_judged(monkeypatch, tmp_path):
    import rewards.pose.sfm as sfm

    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nsys.stderr.write('Segmentation fault in native code\\n')\nsys.exit(139)\n")
    monkeypatch.setattr(sfm, "_SOLVER", crash)
    (e,) = SfMEstimator(SfMSettings()).estimate([textured_frames()], [K_for(96, 160)])
    assert e.unavailable and "exit 139" in e.video_reason and "Segmentation fault" in e.video_reason


def test_featureless_video_is_judged_unrecoverable_and_scored_at_the_floor():
    blank = np.full((6, 96, 160, 3), 128, np.uint8)
    (e,) = SfMEstimator(SfMSettings()).estimate([blank], [K_for(96, 160)])
    assert not e.unavailable and not e.ok.any() and e.video_reason == "too_few_features"
    assert set(e.seconds) >= {"extract", "match", "total"}


def test_the_solver_runs_standalone_without_the_package():
    # The worker imports numpy and pycolmap only; its folder must hold nothing it imports from the package.
    source = (Path(__file__).resolve().parents[1] / "rewards" / "pose" / "sfm_solve.py").read_text()
    assert "from rewards" not in source and "import torch" not in source


def test_the_score_fits_the_estimates_scale_so_a_barely_moving_estimate_is_not_noise():
    gt = trajectory(step=(1.0, 0, 0))  # normalised target centres (f / 4, 0, 0)
    rng = np.random.default_rng(0)
    jitter = np.stack([w2c_from(np.eye(3), rng.normal(size=3) * 1e-3) for _ in range(5)])
    jitter[0] = w2c_from(np.eye(3), np.zeros(3))
    cases = {"scaled": in_other_world(gt, 3.0, 0.0, (0, 0, 0)), "static": trajectory(step=(0, 0, 0)),
             "mirrored": trajectory(step=(-1.0, 0, 0)), "jitter": jitter}
    errs = {k: trajectory_errors(estimate(v), gt, 0.05) for k, v in cases.items()}
    np.testing.assert_allclose(errs["scaled"]["trans_aligned"], 0.0, atol=1e-9)
    target = np.arange(5) / 4.0
    np.testing.assert_allclose(errs["static"]["trans_aligned"], target, atol=1e-9)  # s* = 0: stood still
    np.testing.assert_allclose(errs["mirrored"]["trans_aligned"], target, atol=1e-9)  # s* clamped at 0
    # CamI2V's own normalisation blows the millimetre jitter up to unit length; the fit cannot exceed the target
    assert np.nanmax(errs["jitter"]["trans"]) > 0.5
    assert (np.linalg.norm(np.sum(errs["jitter"]["trans_aligned"] ** 2)) <= np.sum(target ** 2) + 1e-9)
