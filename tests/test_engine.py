"""The engine on its own: schedulers, rollouts, step weights, and the seam that keeps domains out of it."""

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler

from recam.engine.advantages import step_sample_weights
from recam.engine.evaluation import FirstConditions
from recam.engine.rollout import deterministic_sample, per_sample_noise, rescore, rollout
from recam.engine.scheduler import DDIMScheduler, FlowMatchScheduler
from recam.engine.sde import ddim_step_with_logprob, flow_sde_step, ode_step

ROOT = Path(__file__).resolve().parents[1]


def _linear_denoiser(seed=0):
    """A fixed map standing in for a model: output = A x + b t (depends on the state and the time)."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(6, 6, generator=g) * 0.3, torch.randn(6, generator=g)

    def denoise(x, t):
        return x @ a.T + t.float()[:, None] * b
    return denoise


def test_flow_rollout_matches_the_steps_by_hand_and_rescores_on_policy():
    denoise = _linear_denoiser()
    sched = FlowMatchScheduler(num_steps=5, shift=3.0, noise_level=0.7, sde_type="sde", num_train_steps=3)
    noise = per_sample_noise([(0, 0, i) for i in range(4)], sched.num_steps + 1, (6,))
    out = rollout(denoise, noise, sched)
    assert out.states.shape == (4, 4, 6) and out.log_probs.shape == (4, 3)
    # loop version: stochastic steps drawn with the stored noise, then ODE steps
    x, s = noise[:, 0], sched.sigmas
    for j in range(5):
        v = denoise(x, s[j].expand(4))
        if j < 3:
            probe = flow_sde_step(v, s[j], s[j + 1], x, 0.7, prev_sample=x)
            nxt = probe.mean + probe.std * noise[:, j + 1]
            step = flow_sde_step(v, s[j], s[j + 1], x, 0.7, prev_sample=nxt)
            torch.testing.assert_close(out.log_probs[:, j], step.log_prob)
            x = nxt
            torch.testing.assert_close(out.states[:, j + 1], x)
        else:
            x = ode_step(v, s[j], s[j + 1], x)
    torch.testing.assert_close(out.final, x)
    for j in range(3):  # the same policy scores its own stored transitions exactly: ratio 1
        assert torch.equal(rescore(denoise, out.states, sched, j).log_prob, out.log_probs[:, j])
    assert not torch.equal(rescore(_linear_denoiser(1), out.states, sched, 0).log_prob, out.log_probs[:, 0])


def test_ddim_scheduler_timesteps_and_deterministic_sampling_follow_the_ddim_step():
    ddpm = DDPMScheduler(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2")
    sched = DDIMScheduler(ddpm.alphas_cumprod, num_steps=10, eta=1.0, prediction_type="epsilon", num_train_steps=4)
    assert sched.timesteps.tolist() == list(range(90, -1, -10)) and sched.prev[-1] == -1
    denoise = _linear_denoiser()
    noise = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    x = noise
    for j, t in enumerate(sched.timesteps.tolist()):
        out = denoise(x, torch.full((3,), t))
        x = ddim_step_with_logprob(out, t, int(sched.prev[j]), x, ddpm.alphas_cumprod, 0.0).prev_sample
    torch.testing.assert_close(deterministic_sample(denoise, noise, sched), x)
    roll = rollout(denoise, per_sample_noise([(1, i) for i in range(3)], 11, (6,)), sched)
    assert roll.log_probs.shape == (3, 4) and torch.isfinite(roll.log_probs).all()
    assert torch.equal(rescore(denoise, roll.states, sched, 2).log_prob, roll.log_probs[:, 2])


def test_step_weights_make_every_process_take_the_same_steps_with_equal_weight_per_kept_sample():
    g = torch.Generator().manual_seed(0)
    P, n = 3, 8
    keep = torch.rand(P, n, generator=g) > 0.4
    keep[:, :2] = False  # a step whose samples are all excluded everywhere
    order = torch.randperm(n, generator=g)
    steps = [order[i:i + 3] for i in range(0, n, 3)]
    for positions in steps:
        per_rank = [step_sample_weights(keep, positions, r) for r in range(P)]
        kept = int(keep[:, positions].sum())
        if kept == 0:
            assert all(w is None for w in per_rank)  # skipped by every process alike
            continue
        # loop version: the step's gradient, averaged over processes, is the mean over its kept samples
        total = 0.0
        for r, w in enumerate(per_rank):
            for i in positions.tolist():
                assert w[i] == (P / kept if keep[r, i] else 0.0)
                total += float(w[i]) / P
        assert abs(total - 1.0) < 1e-6
    assert all(step_sample_weights(keep, torch.tensor([0, 1]), r) is None for r in range(P))


def test_noise_is_drawn_on_the_cpu_whatever_the_default_device():
    expected = per_sample_noise([(0, 3), (0, 4)], 2, (3, 5))
    with torch.device("meta"):  # stands in for set_default_device("cuda"): a CPU generator must still be used
        got = per_sample_noise([(0, 3), (0, 4)], 2, (3, 5))
    assert got.device.type == "cpu" and torch.equal(got, expected)


def test_noise_drawn_on_threads_is_the_sequential_draw_of_each_sample_s_own_stream():
    """The streams are independent, so drawing them on threads changes nothing: every sample's noise is what its
    own generator gives when drawn alone (sizes not a multiple of 16 included, where torch's normal kernel
    treats the tail apart)."""
    keys = [(7, 2, i) for i in range(5)]
    alone = []
    for key in keys:
        seed = int(np.random.SeedSequence(list(key)).generate_state(1, dtype=np.uint64)[0])
        alone.append(torch.randn(3, 7, 3, generator=torch.Generator().manual_seed(seed % (2**63))))
    for workers in (1, 3, 8):
        assert torch.equal(per_sample_noise(keys, 3, (7, 3), workers=workers), torch.stack(alone))


def _loaded(*statements: str) -> tuple[list[str], list[str]]:
    """(the lines `statements` printed, the modules of recam.domains, rewards and pycolmap loaded by then), run in a
    fresh interpreter."""
    code = "; ".join(["import sys", *statements, "print(' '.join(sorted(m for m in sys.modules if m.startswith("
                      "('recam.domains.', 'rewards', 'pycolmap')))))"])
    lines = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    return lines[:-1], lines[-1].split()


def test_the_engine_and_the_reward_registry_load_no_domain_and_no_reward():
    assert _loaded("import recam.engine.trainer, recam.engine.objective, recam.engine.hooks, recam.engine.domain",
                   "import rewards") == ([], ["rewards", "rewards.registry"])


def test_one_domain_never_loads_another():
    # the camera's rewards are the registry's of its sample kind, "video": asking for them loads their modules
    # and the motion domain's rewards are known by kind without loading it (recam/domains/motion/rewards.py, declared
    # to the registry by recam.domains), so a camera run that weights one is told whose reward it is
    printed, camera = _loaded("import recam.domains.camera, config.validate",
                              "from rewards import known_rewards, reward_kind",
                              "print(known_rewards('video'))", "print(reward_kind('motion_physics'))")
    assert printed == ["['cam_score', 'discriminator', 'fidelity', 'unifiedscore']", "motion"]
    assert "recam.domains.camera.domain" in camera and "rewards.cam_score" in camera
    assert not [m for m in camera if m.startswith(("recam.domains.motion", "recam.domains.toy"))]
    # choosing a domain by name loads it and registers its rewards, and nothing of the others
    printed, motion = _loaded("from recam.domains import domain_class, known_domains",
                              "from rewards import known_rewards", "before = (known_domains(), known_rewards())",
                              "domain_class('motion')", "print(before, known_rewards())")
    assert printed == ["(['camera', 'motion', 'toy'], []) ['motion_alignment', 'motion_physics', 'motion_retrieval']"]
    assert "recam.domains.motion.rewards" in motion
    assert not [m for m in motion if m.startswith(("recam.domains.camera", "recam.domains.toy", "rewards.pose",
                                                   "rewards.cam_score", "pycolmap"))]


def test_first_conditions_is_the_splits_head_and_reads_through():
    class Split:
        kind = "world"

        def __init__(self):
            self.items = [f"caption {i}" for i in range(5)]

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            return self.items[i]

        def condition_id(self, i):
            return f"id{i}"

    head = FirstConditions(Split(), 3)
    assert len(head) == 3 and list(head) == ["caption 0", "caption 1", "caption 2"] and head[-1] == "caption 2"
    assert head.kind == "world" and head.condition_id(1) == "id1"
    with pytest.raises(IndexError):
        head[3]
    copied = copy.deepcopy(head)  # a copy is built without __init__: attribute lookup must not recurse
    assert list(copied) == list(head) and copied.condition_id(2) == "id2"
