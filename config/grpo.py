"""GRPO presets, selected as `--config config/grpo.py:NAME` (default: tiny_cpu).

Each preset is a function over the commented base config in config/base.py.
"""

import ml_collections

from config.base import get_config as base_config
from config.methods import apply_method


def tiny_cpu():
    """The embedded default: ReCam-Tiny (checkpoints/recam_tiny_base_detail3, config/base.py) on the synthetic world,
    one CPU process. Its sampler is already a fixed window: the 5 noisiest of 10 steps stochastic and trained, ODE
    after them (train.timestep_fraction). Measured against Flow-GRPO's recipe and the faster methods in
    docs/time_to_reward.md and docs/results.md ("The main job"); `tiny_cpu+<method>` runs any of them
    (config/methods.py). It evaluates 128 held-out conditions (config/base.py): 29.5 s per evaluation on one thread
    where 32 took 6.9 s, about 2.6 minutes more over a run's 7 evaluations."""
    return base_config()


def smoke():
    """tiny_cpu cut down to finish in about two minutes; used by tests and CI. A check that the loop runs, not a
    measurement: its 8 held-out conditions (the measuring presets evaluate 128) keep it fast and resolve nothing."""
    c = tiny_cpu()
    c.run_name = "smoke"
    c.run_dir = "runs/smoke"
    c.num_epochs = 2
    c.data.num_train_conditions = 16
    c.data.num_heldout_conditions = 8
    c.data.num_val_conditions = 8
    c.sample.num_batches_per_epoch = 1
    c.train.gradient_accumulation_steps = 1
    c.sample.num_steps = 6
    c.sample.eval_num_steps = 6
    c.eval.freq = 2
    c.eval.batch_size = 8
    c.eval.num_videos = 2
    return c


def recam_8npu():
    """8 NPUs x 2 samples per device, k = 4, 4 batches per epoch: 64 samples, 16 conditions per epoch."""
    c = tiny_cpu()
    c.run_name = "recam_8npu"
    c.run_dir = "runs/recam_8npu"
    c.expected_num_processes = 8
    c.mixed_precision = "bf16"
    c.sample.batch_size = 2
    c.train.batch_size = 2
    c.sample.k = 4
    c.sample.num_batches_per_epoch = 4
    c.train.gradient_accumulation_steps = 2  # 4 micro-batches of 2 per process: two optimizer steps per epoch
    c.train.learning_rate = 1e-4
    c.num_epochs = 100
    return c


def recam_wan_1_3b_8npu():
    """ReCamMaster (Wan2.1-T2V-1.3B) on real multi-camera data, 8 devices x 2 samples per device, k = 4, 4 batches
    per epoch: 64 samples, 16 conditions per epoch (recam_8npu's arithmetic).

    81 x 480 x 832 clips sampled in the Wan VAE's latent space, LoRA on a frozen bf16 base, gradient checkpointing,
    cam_score from structure-from-motion plus fidelity. Nothing is downloaded; it expects these local paths
    (docs/real_scale.md, "Real data and latent space"): models/ReCamMaster/step20000.ckpt (ReCamMaster's released
    DiffSynth-layout checkpoint), models/Wan2.1-T2V-1.3B-Diffusers (the -Diffusers release; only its vae/ is read)
    and the MultiCamVideo scenes + metadata.csv under data/MultiCamVideo-Dataset/train.
    """
    c = recam_8npu()
    c.run_name = "recam_wan_1_3b_8npu"
    c.run_dir = "runs/recam_wan_1_3b_8npu"
    c.data.source = "recammaster"
    c.data.root = "data/MultiCamVideo-Dataset/train"
    c.data.num_frames = 81  # ReCamMaster's clip: 81 frames -> 21 latent frames
    c.data.height = 480
    c.data.width = 832
    c.data.frame_interval = 1
    c.data.num_train_conditions = 0  # every (scene, source cam, target cam) of the training scenes
    c.data.num_heldout_scenes = 16
    c.data.num_heldout_conditions = 16  # evenly strided over the held-out scenes' conditions
    c.data.cache_size = 4  # a decoded condition (source + target, 81 x 480 x 832 fp32) takes 0.78 GB
    c.model.format = "recammaster_diffsynth"
    c.model.pretrained = "models/ReCamMaster/step20000.ckpt"
    c.model.vae = "models/Wan2.1-T2V-1.3B-Diffusers"
    c.model.dtype = "bfloat16"
    c.model.gradient_checkpointing = True
    c.model.lora_rank = 32  # Flow-GRPO's Wan2.1 LoRA: r 32, alpha 64
    c.model.lora_alpha = 64.0
    c.sample.num_steps = 20
    c.sample.eval_num_steps = 20
    c.sample.shift = 3.0  # Wan2.1's flow shift at 480p
    c.eval.freq = 10
    c.eval.batch_size = 2
    c.eval.num_videos = 2
    # Camera accuracy from structure-from-motion on the generated frames (16 of the 81, pycolmap in worker processes
    # beside sampling; a learned estimator behind an endpoint instead: reward.cam.estimator=served and
    # reward.cam.served.base_url), plus quality: fidelity to the ground-truth target clip. With a UnifiedReward
    # server up, add --config.reward.weights.unifiedscore=1.0 (and reward.unified.base_url).
    c.reward.weights.cam_score = 1.0
    c.reward.weights.fidelity = 1.0
    c.reward.cam.estimator = "sfm"
    c.reward.cam.sfm.workers = 4  # a rank's 8 videos per epoch, 4 at a time on the node's CPUs
    c.reward.async_workers = 2  # two sampling batches scored at once: SfM must not hold sampling back
    c.eval.report_rewards = "cam_score,fidelity"
    c.eval.select_by = ""  # real data has no validation split: the run reports its last epoch
    c.reward.constraint = ""  # cam_score and fidelity are both maximised
    return c


def recam_wan_14b_multinode():
    """Wan2.1-T2V-14B on real multi-camera data, 2 nodes x 8 devices = 16 processes x 1 sample per device (one sample
    per backward: two do not fit at 14B), k = 4, 4 batches per epoch: 64 samples, 16 conditions per epoch, as
    recam_wan_1_3b_8npu; two micro-batches per optimizer step keep its 32 samples per step.

    Expects models/Wan2.1-T2V-14B-Diffusers (transformer/ and vae/ of the -Diffusers release) and the data under
    data/MultiCamVideo-Dataset/train. No ReCamMaster 14B checkpoint is released, so the camera modules start as
    no-ops (cam_encoder 0, projector I); to post-train a camera-trained 14B, point model.pretrained at it with
    model.format "recam" or "recammaster_diffsynth". Launch lines (npu_multinode.yaml for DDP, fsdp.yaml with
    --config.model.dtype=float32 for sharded weights): docs/real_scale.md, section 5.
    """
    c = recam_wan_1_3b_8npu()
    c.run_name = "recam_wan_14b_multinode"
    c.run_dir = "runs/recam_wan_14b_multinode"
    c.expected_num_processes = 16
    c.sample.batch_size = 1
    c.train.batch_size = 1
    c.train.gradient_accumulation_steps = 2
    c.model.format = "wan_diffusers"
    c.model.pretrained = "models/Wan2.1-T2V-14B-Diffusers"
    c.model.vae = "models/Wan2.1-T2V-14B-Diffusers"
    return c


def toy():
    """The toy domain (recam/domains/toy): 2-D points around a target, a small MLP pretrained in process with DDPM,
    sampled with DDIM (eta 1 on the trained steps), reward exp(-|x - target|^2 / width^2). Full fine-tuning with a
    frozen reference copy; runs in well under a minute on a CPU. Used by tests/test_toy_domain.py."""
    c = base_config()
    c.run_name = "toy"
    c.run_dir = "runs/toy"
    c.domain = "toy"
    c.num_epochs = 20
    c.num_threads = 1  # tiny tensors: a second thread only contends
    c.logging.wandb_mode = "disabled"
    c.data.num_train_conditions = 64
    c.data.num_heldout_conditions = 64
    c.data.num_val_conditions = 32
    c.model.lora_rank = 0
    c.sample.batch_size = 32
    c.sample.k = 8
    c.sample.num_batches_per_epoch = 4  # 128 samples = 16 conditions x k 8 per epoch
    c.sample.num_steps = 10
    c.sample.eval_num_steps = 10
    c.train.batch_size = 32
    c.train.gradient_accumulation_steps = 2  # two optimizer steps per epoch
    c.train.learning_rate = 1e-3
    c.train.clip_range = 0.05
    c.train.beta = 0.01
    c.train.timestep_fraction = 0.5
    c.reward.weights = ml_collections.ConfigDict({"target": 1.0})
    c.reward.constraint = ""  # one reward: nothing to hold as a constraint
    c.eval.report_rewards = "near"
    c.eval.freq = 5
    c.eval.batch_size = 64
    c.eval.num_videos = 8  # points drawn in points.png
    c.eval.select_by = "target"
    c.eval.select_guard = ""
    c.eval.primary_endpoint = "eval/target"
    c.eval.secondary_endpoints = "eval/near"
    c.keep_checkpoints = 1
    # ---- the toy domain's own settings (recam/domains/toy) ----
    c.toy = ml_collections.ConfigDict()
    c.toy.num_train_timesteps = 100  # DDPM training steps of the base (DDIM samples sample.num_steps of them)
    c.toy.beta_schedule = "squaredcos_cap_v2"  # diffusers DDPMScheduler beta schedule; cosine reaches pure noise
    c.toy.prediction_type = "epsilon"  # what the MLP predicts: "epsilon" (the noise) or "sample" (x0)
    c.toy.eta = 1.0  # DDIM eta of the trained (stochastic) steps; evaluation samples with eta 0
    c.toy.hidden = 128  # MLP width
    c.toy.depth = 3  # hidden layers
    c.toy.time_features = 16  # sinusoidal timestep features (sin and cos pairs)
    c.toy.pretrain_steps = 800  # DDPM steps that make the base (in process, about a second)
    c.toy.pretrain_batch_size = 256  # (target, point) pairs per pretraining step
    c.toy.pretrain_lr = 1e-2  # AdamW learning rate of pretraining, cosine-decayed to 0
    c.toy.model_seed = 0  # seed of the base's init and pretraining data: the same base whatever config.seed is
    c.toy.target_radius = 1.0  # targets are uniform in the disk of this radius
    c.toy.num_side_modes = 4  # base data: a mode at the target plus this many on a ring around it, equal weights
    c.toy.mode_offset = 0.6  # ring radius of the side modes
    c.toy.mode_std = 0.12  # std of every mode
    c.toy.reward_width = 0.2  # the reward's length scale (and the `near` radius)
    return c


def motion_tiny_cpu():
    """The motion domain's embedded job: a tiny MDM (latent 64, 3 layers, 147k parameters) with its word-level text
    encoder, pretrained on the synthetic text-to-motion world by scripts/pretrain/pretrain_motion_base.py into
    checkpoints/motion_tiny_base, post-trained on that world's captions on one CPU process.

    Per epoch 1 process x 8 samples x 8 batches = 64 samples = 16 conditions x k 4; 20 DDIM steps over the cosine
    1000-step schedule, the 6 noisiest stochastic (eta 1) and trained, two optimizer steps. Rewards: motion_alignment
    (checkpoints/motion_evaluator, from scripts/pretrain/train_motion_evaluator.py) plus half-weighted motion_physics;
    motion_retrieval reported; evaluation on 128 held-out captions (four pools of 32 for R-precision), graded by
    checkpoints/motion_grader (a transformer evaluator trained apart from the reward's GRU one) with the reward
    network's own numbers beside it, and 32 validation captions that choose the reported checkpoint. What these
    settings gain, and the settings tried (learning rates, trained steps, rewards), are in docs/results.md: over
    three seeds the grader's held-out R@3 gains +0.031, at most +- 0.043 once the seeds' shared captions are counted
    (issue 61; issue 44 said +- 0.024), inside one run's noise at 128 captions.
    Sized for well under 15 minutes on 2 CPU cores (one torch thread: these small ops gain
    nothing from a second one, and lose much when the machine is shared)."""
    c = base_config()
    c.run_name = "motion_tiny_cpu"
    c.run_dir = "runs/motion_tiny_cpu"
    c.domain = "motion"
    c.num_epochs = 30
    c.num_threads = 1
    c.keep_checkpoints = 2
    c.data.num_train_conditions = 512
    c.data.num_heldout_conditions = 128  # R-precision over 64 captions moved +-0.03 between equal checkpoints
    c.data.num_val_conditions = 32
    c.model.lora_rank = 0  # full fine-tuning; the reference is a frozen copy
    c.sample.batch_size = 8
    c.sample.k = 4
    c.sample.num_batches_per_epoch = 8  # 64 samples = 16 conditions x k 4 per epoch
    c.sample.num_steps = 20
    c.sample.eval_num_steps = 20
    c.train.batch_size = 8
    c.train.gradient_accumulation_steps = 4  # 8 micro-batches of 8: two optimizer steps per epoch
    c.train.timestep_fraction = 0.3  # 6 of the 20 steps trained: the noisiest, where a motion's content forms
    c.train.learning_rate = 5e-5  # of 5e-5 / 1e-4 / 2e-4: validation alignment still rising at the end (results.md)
    c.train.beta = 0.01
    c.reward.weights = ml_collections.ConfigDict({"motion_alignment": 1.0, "motion_physics": 0.5})
    c.reward.constraint = ""
    c.reward.max_retries = 0  # local, deterministic rewards: a NaN motion scores NaN again, so it is excluded at once
    # a group's reward std is often ~1e-3 here: the default eps 1e-4 would shrink those groups' advantages by ~10%
    c.advantage.eps = 1e-6
    c.eval.freq = 5
    c.eval.batch_size = 32
    c.eval.num_videos = 2  # stick-figure GIFs (reference | generated) of the first held-out captions
    c.eval.report_rewards = "motion_alignment,motion_retrieval,motion_physics"
    c.eval.select_by = "motion_alignment"
    c.eval.select_guard = "motion_physics"
    c.eval.select_max_drop = 0.02
    # grader R@3: scored by a network the reward never saw (the reward's own alignment is secondary)
    c.eval.primary_endpoint = "eval/r_precision_top3"
    c.eval.secondary_endpoints = "eval/motion_alignment,eval/skating,eval/motion_physics"
    c.motion.format = "base"
    c.motion.pretrained = "checkpoints/motion_tiny_base"
    c.motion.text_encoder = "base"
    c.motion.evaluator = "checkpoints/motion_evaluator"
    c.motion.metric_evaluator = "checkpoints/motion_grader"
    return c


def motion_smoke():
    """motion_tiny_cpu cut down to a minute or two (tests): 2 epochs of one batch (2 conditions x k 4), 6 DDIM
    steps, 32 held-out captions (one full R-precision pool) and 4 validation captions."""
    c = motion_tiny_cpu()
    c.run_name = "motion_smoke"
    c.run_dir = "runs/motion_smoke"
    c.num_epochs = 2
    c.logging.wandb_mode = "disabled"
    c.data.num_train_conditions = 16
    c.data.num_heldout_conditions = 32  # one pool of T2M's 32: fewer would be an easier R-precision
    c.data.num_val_conditions = 4
    c.sample.num_batches_per_epoch = 1
    c.sample.num_steps = 6
    c.sample.eval_num_steps = 6
    c.train.gradient_accumulation_steps = 1
    c.train.timestep_fraction = 0.5  # 3 of the 6 steps
    c.eval.freq = 2
    c.eval.batch_size = 8
    c.eval.num_videos = 1
    c.motion.eval_repetitions = 2
    # The guard's reward rules compare epoch means, and two conditions per epoch make those means mostly a matter
    # of which captions were drawn (a jump floats, a walk does not): at this size a drop is reported, not acted on.
    c.health.action = "warn"
    return c


def mdm_humanml3d_8npu():
    """MDM (trans_enc, latent 512, 8 layers, 17.9M parameters, CLIP ViT-B/32 text) on HumanML3D, 8 processes x 2
    samples per device, k = 4, 4 batches per epoch: 64 samples, 16 conditions per epoch (recam_8npu's arithmetic);
    50 DDIM steps over MDM's 1000-step cosine schedule, the 25 noisiest trained; guidance 2.5 as MDM samples.

    Nothing is downloaded; it expects MDM's HumanML3D release (models/MDM/humanml_trans_enc_512/model000475000.pt
    with its args.json), a local CLIP folder (models/clip-vit-base-patch32), the HumanML3D folder (data/HumanML3D:
    new_joint_vecs/, texts/, Mean.npy, Std.npy, train/val/test.txt) and a retrieval evaluator trained on it
    (scripts/pretrain/train_motion_evaluator.py --source humanml3d --root data/HumanML3D --out
    checkpoints/motion_evaluator_humanml3d) and a grader trained apart from it
    (scripts/pretrain/train_motion_evaluator.py --source humanml3d --root data/HumanML3D --arch transformer --seed 1
    --out checkpoints/motion_grader_humanml3d).
    Held-out metrics on 512 test captions (16 pools of 32); 256 val captions choose the reported checkpoint."""
    c = motion_tiny_cpu()
    c.run_name = "mdm_humanml3d_8npu"
    c.run_dir = "runs/mdm_humanml3d_8npu"
    c.expected_num_processes = 8
    c.num_epochs = 100
    c.num_threads = 0
    c.logging.wandb_mode = "offline"
    c.data.source = "humanml3d"
    c.data.root = "data/HumanML3D"
    c.data.num_train_conditions = 0  # every caption of the train split
    c.data.num_heldout_conditions = 512
    c.data.num_val_conditions = 256
    c.sample.batch_size = 2
    c.sample.k = 4
    c.sample.num_batches_per_epoch = 4  # 8 x 2 x 4 = 64 samples = 16 conditions x k 4
    c.sample.num_steps = 50
    c.sample.eval_num_steps = 50
    c.train.batch_size = 2
    c.train.gradient_accumulation_steps = 2  # 4 micro-batches of 2 per process: two optimizer steps per epoch
    c.train.timestep_fraction = 0.5
    c.train.learning_rate = 1e-5
    c.eval.freq = 10
    c.eval.batch_size = 32
    c.eval.num_videos = 4
    c.motion.format = "mdm"
    c.motion.pretrained = "models/MDM/humanml_trans_enc_512/model000475000.pt"
    c.motion.text_encoder = "clip"
    c.motion.clip_path = "models/clip-vit-base-patch32"
    c.motion.mask_frames = False  # MDM's release was trained attending to every frame
    c.motion.diffusion_steps = 1000
    c.motion.guidance_scale = 2.5
    c.motion.evaluator = "checkpoints/motion_evaluator_humanml3d"
    c.motion.metric_evaluator = "checkpoints/motion_grader_humanml3d"  # the synthetic world's grader cannot read it
    c.motion.eval_repetitions = 20  # T2M's protocol
    return c


def ema_passes(c) -> int:
    """The fewest passes over an epoch's samples (train.num_inner_epochs) at which the EMA of importance weights smooths
    anything: a sample needs two off-policy visits, and its first pass is on-policy until the epoch's first optimizer
    step. 3 when a pass is one optimizer step (tiny_cpu's 16 micro-batches of one step: pass 1 on-policy, pass 2
    starts each sample's average, pass 3 smooths every sample), 2 when a pass takes two or more (config/validate.py
    refuses fewer)."""
    from recam.engine.extensions.variants import optimizer_steps_per_pass

    s, t = c.sample, c.train
    steps = optimizer_steps_per_pass(s.batch_size * s.num_batches_per_epoch, t.batch_size,
                                     t.gradient_accumulation_steps)
    return max(t.num_inner_epochs, 3 if steps == 1 else 2)


def _variants(c, name, **flags):
    """tiny_cpu with policy-optimization variants switched on (config/base.py, recam/engine/extensions/variants.py)."""
    c.run_name = name
    c.run_dir = f"runs/{name}"
    c.train.policy_loss = "grpo_variants"
    # smoothing across passes needs two off-policy visits of each sample
    c.train.num_inner_epochs = ema_passes(c) if flags.get("use_ema_smoothing") else c.train.num_inner_epochs
    for k, v in flags.items():
        c.train[k] = v
    return c


def ema():
    """2.1 temporally smoothed (EMA) importance weights, over ema_passes passes per epoch (3 here): it differs from
    tiny_cpu in the EMA and in its extra passes, and ema_control has the passes without the EMA."""
    return _variants(tiny_cpu(), "ema", use_ema_smoothing=True)


def ema_control():
    """The GRPO control of ema, conservative and balanced: their passes per epoch (ema_passes) and every variant off,
    so that what the EMA does is the difference to this preset, and what the extra passes do the difference between
    this one and tiny_cpu."""
    c = _variants(tiny_cpu(), "ema_control")
    c.train.num_inner_epochs = ema_passes(c)
    return c


def gradient_adaptive():
    """2.2 gradient-adaptive importance weighting over timesteps."""
    return _variants(tiny_cpu(), "gradient_adaptive", use_gradient_adaptive_weighting=True)


def amic():
    """2.3 arithmetic-mean importance correction, clipped at sequence level."""
    return _variants(tiny_cpu(), "amic", use_amic=True)


def ptrw():
    """2.4 probabilistic trust-region weighting (Gaussian gate instead of hard clipping)."""
    return _variants(tiny_cpu(), "ptrw", use_ptrw=True)


def temporal_decay():
    """2.5 temporal-decay advantage shaping (noisiest steps weigh most)."""
    return _variants(tiny_cpu(), "temporal_decay", use_temporal_decay=True)


def asymmetric():
    """2.6 asymmetric clipping for positive and negative advantages."""
    return _variants(tiny_cpu(), "asymmetric", use_asymmetric_clipping=True)


def conservative():
    """Plan combination: EMA + temporal decay."""
    return _variants(tiny_cpu(), "conservative", use_ema_smoothing=True, use_temporal_decay=True)


def aggressive():
    """Plan combination: AMIC + gradient-adaptive + PTRW."""
    return _variants(tiny_cpu(), "aggressive", use_amic=True, use_gradient_adaptive_weighting=True, use_ptrw=True)


def balanced():
    """Plan combination: EMA + gradient-adaptive + asymmetric clipping."""
    return _variants(tiny_cpu(), "balanced", use_ema_smoothing=True, use_gradient_adaptive_weighting=True,
                     use_asymmetric_clipping=True)


VARIANT_PRESETS = (ema, gradient_adaptive, amic, ptrw, temporal_decay, asymmetric, conservative, aggressive,
                   balanced, ema_control)
def tiny_gpu():
    """tiny_cpu at the batch sizes one GPU affords: 2,048 samples per update (2 sampling batches of 1,024 = 512
    conditions x k 4, one optimizer step of 4 micro-batches of 512), because a camera update's signal share measured
    about 6% at 128 samples and needs on the order of 2,000 for a cosine of 1/2 between updates (docs/results.md,
    issue 44). The batches are sized for an 80 GB GPU: a trained step keeps 24 MB per sample for its backward (the
    tiny transformer's attention at 8 x 32 x 32), so a micro-batch of 512 holds about 12 GB, and sampling holds no
    graph. Learning rate and recipe are tiny_cpu's, its detail-weighted base included (config/base.py, issue 62): no
    setting's signal share at 128 samples stood apart from another's; `python scripts/measure/noise_sweep.py camera
    --preset tiny_gpu --out OUT` ranks them at 2,048 by their noise scale. scripts/device_check.py runs it under a
    time cap (max_train_seconds)."""
    c = tiny_cpu()
    c.run_name = "tiny_gpu"
    c.run_dir = "runs/tiny_gpu"
    c.data.num_train_conditions = 1024
    c.sample.batch_size = 1024
    c.sample.num_batches_per_epoch = 2
    c.train.batch_size = 512
    c.train.gradient_accumulation_steps = 4  # the epoch's 4 micro-batches in one optimizer step
    c.eval.batch_size = 256
    return c


def motion_tiny_gpu():
    """motion_tiny_cpu at the batch sizes one GPU affords: 16,384 samples per update (4 sampling batches of 4,096 =
    4,096 captions x k 4, one optimizer step of 8 micro-batches of 2,048), because a motion update's signal share
    measured 1-6% at 64 samples, so half of an update is signal only at 8,400 to 42,000 samples (docs/results.md,
    issue 44). Sized for an 80 GB GPU: a trained step keeps 4.5 MB per sample for its backward (a micro-batch of
    2,048 holds about 9 GB), and the epoch's stored states (7 per sample, 0.2 MB each) stay on the device, about
    24 GB. The synthetic world draws as many captions as asked, so every group of an update is a caption of its
    own. Learning rate and recipe are motion_tiny_cpu's (no setting's share at 64 samples stood apart; `python
    scripts/measure/noise_sweep.py motion --preset motion_tiny_gpu --out OUT` ranks them at this size)."""
    c = motion_tiny_cpu()
    c.run_name = "motion_tiny_gpu"
    c.run_dir = "runs/motion_tiny_gpu"
    c.num_threads = 0  # the device's own
    c.data.num_train_conditions = 4096
    c.motion.world_cache = "runs/cache/motion_world"  # 4,096 motions built once per machine, not per process
    c.sample.batch_size = 4096
    c.sample.num_batches_per_epoch = 4
    c.train.batch_size = 2048
    c.train.gradient_accumulation_steps = 8
    c.eval.batch_size = 512
    return c


def tiny_cpu_long():
    """tiny_cpu run long enough to tell GRPO from its placebo: 64 epochs of 128 = 8,192 samples (the default job has
    1,536), evaluated every 8 epochs, a held-out grid of 1,024 samples. 1,024 training conditions (tiny_cpu's 256
    would be seen 8 times each; here each twice), and the setting item 4 of issue 53 ranked: tiny_cpu's own, as no
    setting's noise scale separated from the default's (docs/results.md). Run beside its placebo, one core each,
    resumable: `python scripts/placebo_runs.py --preset tiny_cpu_long --seeds 0 --out runs/long_camera --metric
    eval/cam_score --metric eval/fidelity --train-reward cam_score` (held-out: tiny_cpu's 128 conditions, about
    ±0.011 cam_score where 32 resolved ±0.02; the training reward, compared epoch by epoch in blocks of 21, about
    ±0.008: docs/results.md). Its 9 held-out evaluations cost about 3.5 minutes more on one thread at 128 than at 32
    (23 s each)."""
    c = tiny_cpu()
    c.run_name = "tiny_cpu_long"
    c.run_dir = "runs/tiny_cpu_long"
    c.num_epochs = 64
    c.eval.freq = 8
    c.data.num_train_conditions = 1024
    return c


def motion_tiny_cpu_long():
    """motion_tiny_cpu run long enough to tell GRPO from its placebo: 250 epochs of 64 = 16,000 samples (the default
    job has 1,920), evaluated every 32 epochs, a held-out grid of 2,048 samples. 2,048 training captions (the
    default's 512 would be seen 31 times each; here about 8), and motion_tiny_cpu's own setting (no setting's noise
    scale separated from the default's, docs/results.md). Run beside its placebo, one core each, resumable:
    `python scripts/placebo_runs.py --preset motion_tiny_cpu_long --seeds 0 --out runs/long_motion --metric
    eval/r_precision_top3 --metric eval/motion_alignment --metric eval/skating --train-reward motion_alignment`."""
    c = motion_tiny_cpu()
    c.run_name = "motion_tiny_cpu_long"
    c.run_dir = "runs/motion_tiny_cpu_long"
    c.num_epochs = 250
    c.eval.freq = 32
    c.data.num_train_conditions = 2048
    return c


REAL_SCALE_PRESETS = (recam_wan_1_3b_8npu, recam_wan_14b_multinode)
MOTION_PRESETS = (motion_tiny_cpu, motion_smoke, mdm_humanml3d_8npu)
LONG_PRESETS = (tiny_cpu_long, motion_tiny_cpu_long)
GPU_PRESETS = (tiny_gpu, motion_tiny_gpu)
PRESETS = {f.__name__: f for f in (tiny_cpu, smoke, recam_8npu, toy, *VARIANT_PRESETS, *REAL_SCALE_PRESETS,
                                     *MOTION_PRESETS, *GPU_PRESETS, *LONG_PRESETS)}


def get_config(name: str = "tiny_cpu"):
    """A preset by name; "<preset>+<method>" applies a policy-optimisation method of config/methods.py to it."""
    name = name or "tiny_cpu"
    name, _, method = name.partition("+")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} in config/grpo.py; known presets: {sorted(PRESETS)}")
    c = PRESETS[name]()
    return apply_method(c, method) if method else c
