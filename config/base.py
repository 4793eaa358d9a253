"""Every default of a recam run, one commented line per field.

Presets in config/grpo.py start from `get_config()` and change only what differs. The built-in policy losses'
settings take their defaults from the loss that reads them (recam.engine.losses.ClipSettings,
recam.engine.extensions.variants.VariantSettings, where each default's reason is), so a loss's defaults are stated once.
"""

import ml_collections

from recam.engine.extensions.variants import (
    CLIP_RATIO_NEG_SCALE,
    CLIP_RATIO_POS_SCALE,
    PTRW_SIGMA_SCALE,
    VariantSettings,
)
from recam.engine.losses import ClipSettings


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    # ---- run ----
    c.run_name = "tiny_cpu"  # name shown in logs and wandb
    c.domain = "camera"  # what is generated: a registered domain (recam.engine.domain.DOMAINS)
    c.run_dir = "runs/tiny_cpu"  # where checkpoints, metrics.jsonl, videos and reports go
    c.seed = 0  # global seed: sampler order, noise, model init of anything not loaded
    c.num_epochs = 12  # GRPO epochs (one epoch = sample, score, train); camera gain peaks and fades (docs/results.md)
    c.expected_num_processes = 0  # processes the preset was designed for; 0 = accept whatever is launched
    c.mixed_precision = "no"  # "no" | "fp16" | "bf16"; log-prob math stays fp32 regardless
    c.resume = True  # resume from <run_dir>/checkpoints/latest when it exists
    # Read a checkpoint written before checkpoints were pickle-free (it holds trainer.pt). A pickle can run code, so
    # only for a run folder holding checkpoints you wrote; it is converted on resume, after which this is not needed.
    c.trust_legacy_checkpoint = False
    c.save_freq = 1  # save a checkpoint every N epochs (the last epoch is always saved)
    c.keep_checkpoints = 2  # how many epoch checkpoints to keep besides `latest`; 0 = keep every one
    c.num_threads = 0  # torch CPU threads per process; 0 = torch's default
    # wall-clock budget: stop after the epoch during which the cumulative training time (epoch_seconds summed:
    # sampling, rewards and updates, never evaluations) reaches this many seconds, then evaluate and report; 0 = off
    c.max_train_seconds = 0.0
    # comma-separated modules of your own (e.g. "my_package.my_rewards"), imported before validation so that what
    # they register (rewards) can be named in this config without editing the project (docs/extending.md)
    c.plugins = ""

    # ---- data: the embedded synthetic multi-camera world ----
    c.data = ml_collections.ConfigDict()
    c.data.num_train_conditions = 256  # training conditions (scenes x target trajectories)
    # held-out conditions, from scenes never trained on (32 scenes of conditions_per_scene 4). 128, not 32: a camera
    # gain is a few hundredths of cam_score, and 32 conditions resolved about +-0.02 (issue 61, item 6). One held-out
    # evaluation of tiny_cpu's base on one thread: 29.5 s at 128, 6.9 s at 32 (docs/results.md, "Held-out conditions
    # for the camera"); the validation split (num_val_conditions) is evaluated beside it at its own count.
    c.data.num_heldout_conditions = 128
    c.data.num_val_conditions = 32  # validation conditions (scenes in neither split) that choose eval.select_by's
    c.data.num_frames = 8  # frames per video (source and target each)
    c.data.size = 32  # frame height = width in pixels
    c.data.conditions_per_scene = 4  # target trajectories per scene
    c.data.seed = 0  # seed of the world (scene layouts, trajectories)
    # ---- data: or ReCamMaster-layout scene folders (recam/domains/camera/data.py). There num_frames is the frames
    # read per clip,
    # num_train_conditions / num_heldout_conditions cap the splits (0 = all), size/conditions_per_scene/seed unused.
    c.data.source = "synthetic"  # "synthetic" (the world above) | "recammaster" (scene folders under data.root)
    c.data.root = ""  # recammaster: folder searched for scenes (videos/camNN.mp4 + cameras/camera_extrinsics.json)
    c.data.height = 480  # recammaster: frames are resized to cover height x width, then centre-cropped
    c.data.width = 832  # recammaster: see data.height
    c.data.frame_interval = 1  # recammaster: read frames 0, interval, 2 x interval, ... of each clip
    c.data.num_heldout_scenes = 1  # recammaster: scenes held out for evaluation (first by SHA-1 of their path)
    c.data.source_cams = ""  # recammaster: comma-separated cameras allowed as source ("cam01"); "" = every camera
    # recammaster: horizontal field of view (degrees) of scenes without cameras/intrinsics.json; 0 = fx = W (53.1).
    # cam_score's SfM holds the intrinsics fixed, so set it when the footage's lens is known.
    c.data.hfov_deg = 0.0
    c.data.cache_size = 8  # recammaster: decoded conditions kept in memory per process (LRU)

    # ---- model ----
    c.model = ml_collections.ConfigDict()
    # folder with config.json + safetensors (diffusers layout). The embedded base is recam_tiny_base continued for
    # 2,000 steps with a detail-weighted loss (its provenance.json): on the plain base GRPO could not be told from
    # its placebo over seeds, on this one it can (docs/results.md, issue 62). The plain base is one override away:
    # --config.model.pretrained=checkpoints/recam_tiny_base
    c.model.pretrained = "checkpoints/recam_tiny_base_detail3"
    # How model.pretrained is read. "recam": from_pretrained of a ReCam folder (as above); "wan_diffusers": a Wan2.1
    # transformer (or pipeline) folder in diffusers layout, camera modules initialised (load_wan_transformer);
    # "recammaster_diffsynth": ReCamMaster's DiffSynth-layout checkpoint file, e.g. step20000.ckpt
    # (load_recammaster_checkpoint); both loaders are in recam/domains/camera/loading.py
    c.model.format = "recam"
    c.model.vae = ""  # "" = sample in pixel space; a Wan VAE folder (or a -Diffusers pipeline folder) = its latents
    c.model.dtype = "float32"  # "float32" | "bfloat16" (frozen bf16 base; needs LoRA, whose adapter stays fp32)
    c.model.gradient_checkpointing = False  # recompute each block's activations in the backward pass
    c.model.lora_rank = 0  # 0 = full fine-tuning; > 0 = LoRA adapter, reference = same network with it disabled
    c.model.lora_alpha = 16.0  # LoRA alpha (update scaled by alpha / rank)
    c.model.lora_targets = ""  # comma-separated module suffixes; "" = self-attention q/k/v/out (recam.infra.lora)

    # ---- sampling (rollouts) ----
    c.sample = ml_collections.ConfigDict()
    c.sample.batch_size = 8  # samples per process per sampling batch
    c.sample.num_batches_per_epoch = 16  # sampling batches per epoch (128 samples = 32 conditions x k 4 here)
    c.sample.k = 4  # copies per condition (GRPO group size)
    c.sample.num_steps = 10  # denoising steps of a rollout
    c.sample.shift = 1.0  # sigma schedule time shift (1 = linear sigmas)
    c.sample.sde_type = "sde"  # "sde" (Flow-GRPO) | "cps" (coefficients-preserving)
    c.sample.noise_level = 0.7  # SDE noise scale a in sigma_t = a * sqrt(t / (1 - t)); > 0, and <= 1 for "cps"
    c.sample.eval_num_steps = 10  # ODE steps for held-out evaluation (always Euler / DDIM: comparable across runs)
    # ---- stochastic window (Flow-GRPO-Fast, MixGRPO): deterministic steps before and after w stochastic ones ----
    # w stochastic steps, the only ones stored and trained; 0 = the first round(train.timestep_fraction x num_steps)
    # steps (start 0); > 0: train.timestep_fraction is ignored. Must end before the last step. Objectives without
    # log-probs (train.objective "nft", "awm") sample no stochastic step at all and ignore the window.
    c.sample.window_size = 0
    # where the window starts each epoch (one start per epoch, shared by every sample): "fixed" (window_start),
    # "random" (uniform in [0, window_max_start], drawn from (seed, epoch)), "progressive" (window_start + one step
    # every window_shift_every epochs, back to window_start after window_max_start, as MixGRPO's --roll_back)
    c.sample.window_mode = "fixed"
    c.sample.window_start = 0  # the fixed start, or where a progressive window starts
    # the latest start ("random", "progressive"); start + window_size <= num_steps - 1; -1 = the latest that fits
    c.sample.window_max_start = 0
    c.sample.window_shift_every = 1  # "progressive": epochs per one-step shift
    # deterministic steps of a rollout: "euler" (the scheduler's ODE / DDIM eta 0 step) | "dpm2" (DPM-Solver++(2M)
    # on the x0 prediction, MixGRPO-Flash; flow-matching domains only; first order at the start, its history kept
    # through the window) | "sa_solver" (first-order stochastic SA-Solver, below; no trained steps, flow only) |
    # "sa_solver_pc" (AWM's sampler as its pipeline runs it: SA-Solver's order-2 predictor-corrector on the grid with
    # its first point at 1 - 1e-3 and its next-to-last at half the one before; same tau window; flow only)
    c.sample.ode_solver = "euler"
    c.sample.ode_solver_scope = "all"  # "all" deterministic steps | "after_window" (Euler before it: MixGRPO-Flash)
    # < 1: the steps after the window run on the rest of the grid compressed to this fraction of its points (uniform
    # in unshifted time; MixGRPO-Flash's dpm_post_compress_ratio, 0.4): fewer evaluations where nothing is trained
    c.sample.post_window_compress = 1.0
    # "sa_solver" / "sa_solver_pc" (AWM's sampler, objectives without log-probs): tau = sa_eta on the steps that end
    # at a sigma in [sa_min_sigma, sa_max_sigma], 0 elsewhere (Euler for "sa_solver"); AWM's presets: 0.4 on [0.3, 0.9]
    c.sample.sa_eta = 0.0
    c.sample.sa_min_sigma = 0.3
    c.sample.sa_max_sigma = 0.9
    # the k copies of a condition start from one initial noise (drawn per condition and epoch), so that their
    # rewards differ only by the noise of the steps that are trained: a reward difference that the initial noise
    # made would enter the advantage while no trained step is responsible for it (DanceGRPO's shared noise)
    c.sample.same_initial_noise = False
    # 0: the stochastic steps draw noise in every element; m > 0: only in the m lowest-frequency cosine components
    # along the sample's last axis (a motion's frames; recam.engine.extensions.noise_subspace). Meant to lower the
    # policy gradient's variance; on the motion job it did not (docs/results.md)
    c.sample.noise_frequencies = 0
    # 0: in every channel (the axes between the batch and the last); c > 0: only in the c principal directions of the
    # domain's training data over its channels (needs sample.noise_frequencies > 0 and a domain that gives them)
    c.sample.noise_channels = 0

    # ---- training ----
    c.train = ml_collections.ConfigDict()
    c.train.batch_size = 8  # samples per process per optimizer micro-batch
    # AdamW learning rate (full fine-tuning of the tiny model, one step per epoch). 1e-4 of 1e-4 / 2e-4 / 4e-4: the one
    # that gained held-out cam_score without costing fidelity (2e-4 paid 0.006-0.018 of it, 4e-4 0.03; docs/results.md)
    c.train.learning_rate = 1e-4
    c.train.adam_beta1 = 0.9  # AdamW beta1
    c.train.adam_beta2 = 0.999  # AdamW beta2
    c.train.adam_weight_decay = 1e-4  # AdamW weight decay
    c.train.adam_epsilon = 1e-8  # AdamW epsilon
    c.train.max_grad_norm = 1.0  # gradient clipping norm
    # log grad_cosine_prev, the cosine between consecutive optimizer steps' gradients (costs one fp32 copy of the
    # trainable parameters): its mean over a run is the share of an update that is signal, not sampling noise
    # (scripts/diagnose.py reports it as `update_noise`)
    c.train.log_gradient_cosine = True
    # log each epoch's gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018) and the update's
    # signal share 1 / (1 + B_simple / B), estimated from the micro-batches' gradients of whole groups against the
    # step's (recam.engine.noise_scale): how many samples an update needs before its direction is mostly signal. Costs
    # one fp32 copy of the trainable gradients and a squared norm per micro-batch (scripts/bench/bench_noise_scale.py)
    c.train.noise_scale = True
    c.train.num_inner_epochs = 1  # passes over the epoch's samples
    c.train.gradient_accumulation_steps = 16  # micro-batches per optimizer step; 16 = the whole epoch in one step
    c.train.timestep_fraction = 0.5  # fraction of denoising steps trained: the noisiest, where layout and camera form
    # "uniform" | "score_balanced": each trained step's loss x std_j / |d mean_j / d output| (mean 1), so the
    # low-noise steps' log-prob gradients, ~1/std_j, do not drown the noisy ones (recam.engine.objective)
    c.train.step_weighting = "uniform"
    # how stored samples become a loss (recam.engine.objective.OBJECTIVES): "grpo" (clipped ratio per trained step),
    # "grpo_guard" (GRPO-Guard: ratio normalisation and |dt| weighting; flow SDE only), "nft" (DiffusionNFT) and
    # "awm" (advantage weighted matching) train on re-noised final samples without log-probs
    # (recam/engine/extensions/fast_objectives.py)
    c.train.objective = "grpo"
    c.train.policy_loss = "grpo_clip"  # registered policy loss (recam.engine.losses.POLICY_LOSSES)
    # PPO clip epsilon on r = exp(logp - logp_old), logp the exact Gaussian log-density averaged over elements, as in
    # Flow-GRPO's SDE step, so SDE clip ranges carry over. Flow-GRPO's CPS logp is -mean((x' - mean)^2), lacking the
    # 1/(2 std_j^2), std_j = sigma_(j+1) sin(a pi / 2), so its log-ratios are 2 std_j^2 times ours
    # (recam.engine.sde.cps_step):
    # its eps_F at step j means our bounds (1 - eps_F)^k and (1 + eps_F)^k, k = 1 / (2 std_j^2), ~ 1 -+ k eps_F;
    # at a = 0.7, k runs from 0.78 (sigma_(j+1) = 0.9) to 63 (0.1), so no single clip_range reproduces it.
    clip = ClipSettings()
    c.train.clip_range = clip.clip_range  # diffusion ratios sit close to 1
    c.train.adv_clip_max = clip.adv_clip_max  # advantages are clamped to +-this
    c.train.log_ratio_clamp = clip.log_ratio_clamp  # log-ratio clamped to +-this before exp
    c.train.beta = clip.beta  # KL coefficient toward the frozen reference (0 disables the reference)
    # MixGRPO's "KL": + this x 0.5 mean((log p - log p_old)^2) against the sampling log-probs (no reference model);
    # train.objective "grpo" with policy loss "grpo_clip" only. Its public scripts run it at 0
    c.train.sampling_kl_coeff = clip.sampling_kl_coeff
    # recam.engine.losses.KL_ESTIMATORS: "gaussian_mean" (closed form, exact) | "k1" | "k2" | "k3" (sampled); all
    # return the
    # per-element KL of the transition to the reference (averaged over elements, the closed form's units)
    c.train.kl_type = "gaussian_mean"
    c.train.ema = False  # keep an EMA of the policy weights, used for evaluation
    c.train.ema_decay = 0.95  # EMA decay per optimizer step

    # ---- forward-process and guarded objectives (recam/engine/extensions/fast_objectives.py) ----
    # the old policy ("nft" samples with it, "awm" keeps it as a KL anchor): after each epoch's update
    # old = d x old + (1 - d) x policy, d = min(old_policy_decay_ramp x optimizer steps so far, old_policy_decay), as
    # DiffusionNFT's and AWM's scripts ramp it (0.001 per step; caps 0.5 and 0.3): early on, old = policy.
    # old_policy_decay in [0, 1); ramp 0 = d is old_policy_decay from the first epoch
    c.train.old_policy_decay = 0.5
    c.train.old_policy_decay_ramp = 0.001
    # d = 0 for this many optimizer steps first, then the ramp from 0 (DiffusionNFT's decay_type 2: 75, ramp 0.0075,
    # cap 0.999, its ocr preset); 0: the ramp starts at once (decay_type 1)
    c.train.old_policy_decay_flat = 0
    # re-noised timesteps per final sample per optimizer pass; with "grid", 0 = int(fp_grid_fraction x num_steps)
    c.train.fp_num_timesteps = 2
    # noise levels: "stratified" (one per equal bin of [fp_min_noise, fp_max_noise]) | "uniform" (iid there) |
    # "grid" (distinct sampling-grid levels at random, DiffusionNFT) | "grid_stratified" (grid indices stratified
    # over [1, int(fp_grid_fraction x num_steps)), AWM's discrete_wo_init)
    c.train.fp_timestep_sampling = "stratified"
    c.train.fp_grid_fraction = 0.99  # the grid modes' fraction: NFT's timestep_fraction 0.99, AWM's 0.9
    c.train.fp_min_noise = 0.05  # lowest noise level u in (0, 1) a final sample is re-noised to
    c.train.fp_max_noise = 0.95  # highest noise level u, above fp_min_noise
    c.train.nft_beta = 1.0  # DiffusionNFT's beta: v+- = policy and old velocities mixed by it; > 0
    c.train.awm_adv_scale = 5.0  # AWM: the advantage is divided by this
    c.train.awm_clip_range = 0.2  # AWM: PPO clip epsilon on exp(-(loss - old loss))
    c.train.awm_old_kl_weight = 0.1  # AWM: weight of the velocity MSE to the old policy (>= 0)
    # AWM: how a re-noised sample's matching loss l enters the ratio: "uniform" (l) | "ghuber" (((l + 1e-10)^p -
    # 1e-10^p) u / p, p = awm_ghuber_power, u the noise level: the public presets' weighting)
    c.train.awm_weighting = "uniform"
    c.train.awm_ghuber_power = 0.25
    c.train.guard_dt_weighting = True  # GRPO-Guard: divide each step's loss by its |dt|

    # ---- policy-optimization variants (recam/engine/extensions/variants.py; train.policy_loss = "grpo_variants") ----
    v = VariantSettings()
    c.train.use_ema_smoothing = v.use_ema_smoothing  # 2.1 EMA of per-trajectory importance weights across updates
    c.train.ema_beta = v.ema_beta  # 2.1 weight of the fresh importance weight (1 = no smoothing)
    # 2.1 keep each sample id's EMA state into later epochs (one process only); off: it ends with the epoch, and
    # smoothing needs two off-policy visits within it (validation says which train.num_inner_epochs gives them)
    c.train.ema_across_epochs = v.ema_across_epochs
    # 2.2 per-timestep weights from each step's ||grad_theta log p||
    c.train.use_gradient_adaptive_weighting = v.use_gradient_adaptive_weighting
    # 2.2 w_t = m_t^(1/tau) / mean_s m_s^(1/tau) per trajectory (mean 1); inf = neutral, every weight exactly 1
    c.train.gradient_weighting_temperature = v.gradient_weighting_temperature
    # 2.2 how m is computed: 0 = exact, one backward per sample (about one batch forward + backward per step);
    # P > 0 = P Gaussian parameter probes (unbiased m^2, relative spread sqrt(2 / P); slower on ReCam-Tiny)
    c.train.gradient_weighting_num_probes = v.gradient_weighting_num_probes
    c.train.use_amic = v.use_amic  # 2.3 arithmetic-mean sequence importance weight, clipped at sequence level
    c.train.use_gspo = v.use_gspo  # 2.3 alternative: GSPO's geometric-mean sequence weight (exclusive with AMIC)
    c.train.use_ptrw = v.use_ptrw  # 2.4 Gaussian trust-region gate in place of hard clipping
    # 2.4 gate width: 2 x train.clip_range unless set (a reference: it follows the preset's or command line's
    # clip_range), so the gate is 0.88 where the hard clip would start to cut and 0.14 at four clip ranges
    c.train.ptrw_sigma = c.train.get_ref("clip_range") * PTRW_SIGMA_SCALE
    c.train.use_temporal_decay = v.use_temporal_decay  # 2.5 advantage weight gamma^t over trained steps, t = 0 noisiest
    c.train.temporal_decay_gamma = v.temporal_decay_gamma  # 2.5 decay per trained step
    c.train.temporal_decay_normalize = v.temporal_decay_normalize  # 2.5 rescale the decay weights to mean 1
    # 2.6 separate clip ranges for positive / negative advantages
    c.train.use_asymmetric_clipping = v.use_asymmetric_clipping
    # 2.6 bounds as multiples of train.clip_range unless set (references, like ptrw_sigma): upper 1.4 x for A > 0
    # (DAPO's clip-higher 0.28 / 0.2), lower 1 x for A < 0
    c.train.clip_ratio_pos = c.train.get_ref("clip_range") * CLIP_RATIO_POS_SCALE
    c.train.clip_ratio_neg = c.train.get_ref("clip_range") * CLIP_RATIO_NEG_SCALE

    # ---- advantages ----
    c.advantage = ml_collections.ConfigDict()
    c.advantage.std_mode = "group"  # "group" | "global" | "none": what the centred reward is divided by
    c.advantage.eps = 1e-4  # > 0, added to the std (population std, as Flow-GRPO); < 0 would flip advantages
    # the std with Bessel's correction (n - 1), as MixGRPO's script (torch's .std()); False: the population std
    c.advantage.unbiased_std = False
    c.advantage.filter_zero_std = False  # drop groups whose rewards are all equal (advantage 0) from training
    # the control run: each group's advantages are permuted among its own samples (a seeded draw per epoch), so
    # they keep their distribution and lose their link to the samples; everything else is the same loop. What a
    # placebo run gains is what selection and a random walk of the weights gain without reward information
    c.advantage.placebo = False

    # ---- rewards ----
    c.reward = ml_collections.ConfigDict()
    # name -> weight in `avg`; weight 0 means not computed at all. Any registered reward of the domain's sample kind
    # can be weighted from the command line, listed here or not (--config.reward.weights.discriminator=0.5).
    c.reward.weights = ml_collections.ConfigDict({"cam_score": 1.0, "fidelity": 1.5, "unifiedscore": 0.0,
                                                  "discriminator": 0.0})
    # "" or a weighted reward kept as a constraint rather than maximised: its weight becomes a Lagrange multiplier
    # (recam/engine/constraint.py) that starts at its reward.weights entry and moves each epoch by constraint_lr
    # times how
    # far the epoch's mean of it is below the floor (the first epoch's mean, i.e. the base's, minus constraint_slack)
    c.reward.constraint = "fidelity"
    c.reward.constraint_slack = 0.01  # how far below the base's mean the constrained reward may go
    c.reward.constraint_lr = 10.0  # multiplier change per epoch per unit of violation
    c.reward.constraint_max_weight = 6.0  # the multiplier is kept in [0, this]
    c.reward.async_workers = 1  # reward jobs run on this many threads while the next batch samples
    c.reward.failure_policy = "wait"  # failed samples: "wait" (retry, then exclude), "drop_group", "stop"
    c.reward.max_retries = 2  # re-scoring rounds of failed samples under "wait"
    c.reward.retry_backoff_s = 1.0  # first retry delay, doubled each round
    c.reward.unified = ml_collections.ConfigDict()  # UnifiedReward judge (reward "unifiedscore")
    c.reward.unified.base_url = "http://127.0.0.1:30000"  # OpenAI-compatible server root (sglang / vLLM)
    c.reward.unified.model = "UnifiedReward"  # model name sent with each request
    c.reward.unified.api_key_env = "UNIFIED_API_KEY"  # environment variable holding the API key (optional)
    c.reward.unified.prompt_format = "final_score"  # "final_score" | "alignment_physics_style"
    c.reward.unified.num_frames = 4  # frames sent per video
    c.reward.unified.frame_size = 64  # longer side of each frame sent, in pixels
    c.reward.unified.max_concurrency = 8  # requests in flight
    c.reward.unified.timeout_s = 30.0  # one attempt as a whole: connect, send, the whole answer (not per read)
    c.reward.unified.max_retries = 3  # retries per request (timeouts, 5xx, 429, dropped connections)
    c.reward.unified.check_model = False  # also require the model name in /v1/models at start
    c.reward.cam = ml_collections.ConfigDict()  # camera accuracy (reward "cam_score", rewards/cam_score.py)
    # How poses are estimated on the generated frames: "landmarks" (PnP on the synthetic world's coloured spheres),
    # "sfm" (pycolmap structure-from-motion: real footage, textured worlds), "served" (a learned estimator over HTTP)
    c.reward.cam.estimator = "landmarks"
    # How "landmarks" solves PnP: "torch", every frame of a batch at once where the samples are (the device);
    # "opencv", OpenCV's SQPnP frame by frame on the host (the reference; rewards/pose/landmarks.py)
    c.reward.cam.pnp = "torch"
    c.reward.cam.max_frames = 16  # frames scored per video, evenly spaced, first and last included
    c.reward.cam.rot_scale_deg = 10.0  # per-frame score exp(-RotErr / this) * exp(-TransErr / trans_scale)
    c.reward.cam.trans_scale = 0.25  # TransErr is between centres normalised by the trajectory's largest, in [0, 2]
    c.reward.cam.min_target_translation = 0.05  # targets moving less than this (data units) stand still: ...
    # ... their TransErr is undefined, and the video's parallax (scene points' shift that its rotations leave
    # unexplained, in focal lengths, about translation / scene depth) judges its translation instead, since
    # monocular poses have no scale to hold it against. This much parallax costs a frame as much as a TransErr of
    # trans_scale (e^-1): a camera that stayed put measures under 1e-3, a truck of 0.8 units about 0.03
    # (docs/results.md, "A camera asked to stand still")
    c.reward.cam.static_parallax = 0.02
    c.reward.cam.sfm = ml_collections.ConfigDict()  # estimator "sfm" (rewards/pose/sfm.py)
    c.reward.cam.sfm.workers = 2  # videos solved at once, one process each
    c.reward.cam.sfm.timeout_s = 120.0  # a video not solved by then is not judged (NaN, retried, then excluded)
    c.reward.cam.sfm.threads_per_worker = 1
    c.reward.cam.sfm.min_registered_fraction = 0.75  # the full solve must place this share of the frames ...
    c.reward.cam.sfm.min_points3d = 50  # ... triangulate this many points ...
    c.reward.cam.sfm.max_reproj_px = 2.0  # ... fit them this well ...
    c.reward.cam.sfm.max_disagreement_deg = 30.0  # ... and not flip frames against the rotation-only solve
    c.reward.cam.sfm.parallax_px = 1.5  # matches explained by rotation alone within this: the camera did not move
    c.reward.cam.sfm.max_features = 4096  # SIFT features per frame
    c.reward.cam.served = ml_collections.ConfigDict()  # estimator "served" (rewards/pose/served.py: the protocol)
    c.reward.cam.served.base_url = "http://127.0.0.1:30100"
    c.reward.cam.served.timeout_s = 60.0  # one attempt as a whole: connect, send, the whole answer
    c.reward.cam.served.max_retries = 3  # timeouts, 5xx, 429 and dropped connections, with exponential backoff
    c.reward.cam.served.backoff_s = 1.0
    c.reward.cam.served.max_concurrency = 4  # requests in flight
    c.reward.cam.served.max_frames = 16  # frames sent per video (others are not scored)
    c.reward.cam.served.image_format = "png"  # "png" | "jpeg"
    c.reward.cam.served.api_key_env = "POSE_API_KEY"  # environment variable holding a bearer token (optional)
    c.reward.cam.served.check_health = True  # GET /health when the run starts
    c.reward.discriminator = ml_collections.ConfigDict()  # learned critic (reward "discriminator")
    c.reward.discriminator.lr = 1e-3  # critic learning rate
    c.reward.discriminator.width = 8  # critic channels (capacity: ~18k parameters at 8)
    c.reward.discriminator.temperature = 1.0  # T in -log sigmoid((s_teacher - s_student) / T); the adaptive T's start
    c.reward.discriminator.adaptive_temperature = False  # track the spread of score differences instead
    # adaptive T <- momentum T + (1 - momentum) std(differences), kept in [min_temperature, max_temperature]: the
    # margins / T stay of order 1, so the sigmoid neither saturates nor stays linear
    c.reward.discriminator.temperature_momentum = 0.9
    c.reward.discriminator.min_temperature = 0.05
    c.reward.discriminator.max_temperature = 10.0
    # standardise each batch's scores before the ranking term: a margin cannot grow by scaling the scores up
    c.reward.discriminator.normalize_scores = False
    c.reward.discriminator.reg_threshold = 3.0  # scores beyond +-this are penalised
    c.reward.discriminator.reg_weight = 0.1  # weight of that penalty
    c.reward.discriminator.warmup_steps = 50  # critic updates before "learns nothing" (d_acc < 0.6) is judged
    c.reward.discriminator.steps_per_epoch = 4  # critic updates per epoch (teacher = ground-truth renders)

    # ---- motion domain (recam/domains/motion; presets motion_tiny_cpu, motion_smoke, mdm_humanml3d_8npu) ----
    # Data: data.source "synthetic" (MotionWorld's train / validation / held_out splits from data.seed) or "humanml3d"
    # (data.root a HumanML3D folder: train / val / test, data.num_*_conditions evenly strided over each, 0 = all).
    # Batches are the engine's: samples per epoch = processes x sample.batch_size x sample.num_batches_per_epoch and
    # conditions per epoch = samples / sample.k (motion_tiny_cpu: 1 x 8 x 8 = 64 samples = 16 conditions x k 4).
    c.motion = ml_collections.ConfigDict()
    # "base": a scripts/pretrain/pretrain_motion_base.py folder | "mdm": an MDM release's model*.pt
    c.motion.format = "base"
    c.motion.pretrained = "checkpoints/motion_tiny_base"  # the base folder, or the MDM .pt file (format "mdm")
    c.motion.mdm_args = ""  # mdm: path of args.json; "" = the args.json beside the .pt
    c.motion.mdm_use_ema = True  # mdm: an EMA checkpoint's averaged weights (model_avg), as MDM's own loaders take
    c.motion.text_encoder = "base"  # "base": the word-level encoder in <pretrained>/text_encoder | "clip": clip_path
    # the synthetic world's items (and its Mean/Std) read from / written to this folder, built once per machine
    # and builder instead of in every process's first epoch (recam/domains/motion/world.py); "" = built in memory
    c.motion.world_cache = ""
    c.motion.clip_path = ""  # text_encoder "clip": a local CLIP folder (e.g. clip-vit-base-patch32), never downloaded
    c.motion.mask_frames = True  # padded frames get no attention (MDM's released checkpoints: trained without, False)
    c.motion.diffusion_steps = 1000  # DDPM steps of the cosine schedule the model was trained on (MDM: 1000)
    c.motion.eta = 1.0  # DDIM eta of the trained steps (1: DDPM-like ancestral); the untrained tail and evaluation: 0
    c.motion.guidance_scale = 2.5  # classifier-free guidance on x0 (MDM: 2.5); 1 = the conditional pass alone
    c.motion.log_prob_reduction = "mean"  # log-probs over the real frames: "mean" | "sum" (to reproduce summing runs)
    c.motion.evaluator = "checkpoints/motion_evaluator"  # motion_alignment's evaluator (train_motion_evaluator.py)
    # The grader of R-precision, MM-Dist, FID and Diversity: a network trained apart from motion.evaluator (another
    # architecture, seed and data draw), so a policy cannot raise its grade by fitting its reward's network; the
    # reward's network is reported beside it (eval/reward_net/...). "" = motion.evaluator, labelled as the reward's.
    c.motion.metric_evaluator = "checkpoints/motion_grader"
    # motion_retrieval: temperature of the own caption's retrieval probability, and how many training captions
    # (evenly strided over the training split) form its fixed pool of negatives
    c.motion.retrieval_temperature = 0.1
    c.motion.retrieval_negatives = 256
    c.motion.eval_repetitions = 10  # shuffles of the evaluated pairs the protocol metrics average over
    # motion_physics = exp(-skating ratio / skating_scale - floating (m) / floating_scale - penetration (m) /
    # penetration_scale - jitter (m/s^3) / jitter_scale). Skating and jitter scales put the synthetic world's
    # ground truth near 0.9 and the tiny base's samples (skating ~0.5, jitter ~1400) near 0.27: at 0.1 / 200 the
    # base scored ~0.05, where a term's relative drop between epochs is noise that the guard took for a collapse
    c.motion.physics_skating_scale = 0.5
    c.motion.physics_floating_scale = 0.05
    c.motion.physics_penetration_scale = 0.05
    c.motion.physics_jitter_scale = 1500.0  # not calibrated on real clips

    # ---- evaluation ----
    c.eval = ml_collections.ConfigDict()
    c.eval.freq = 2  # evaluate every N epochs (plus start and end); each evaluation is a candidate for eval.select_by
    # also evaluate (tag time_NNNNNs) after the epoch in which the cumulative training time (max_train_seconds)
    # crosses the next multiple of this many seconds, for reward-versus-time curves; 0 = off
    c.eval.every_seconds = 0.0
    c.eval.seed = 1234  # fixed noise seed for evaluation
    c.eval.batch_size = 16  # conditions per evaluation forward
    c.eval.num_videos = 4  # held-out conditions written as source | ground truth | generated videos
    # also evaluate the first N training conditions (metrics train_eval/...): does the policy improve on what it
    # trains on? 0 = off
    c.eval.num_train_conditions = 0
    c.eval.report_rewards = "cam_score,fidelity"  # also scored at evaluation, whatever their weight (never in avg)
    # Which evaluated checkpoint (base, every eval.freq epochs, last) the run reports: "" = the last; a reward name =
    # the one with the best validation value of it (validation conditions, never the held-out ones that measure it).
    # Synthetic world only: real data (data.source "recammaster") has no validation split and reports the last.
    c.eval.select_by = "cam_score"
    c.eval.select_guard = "fidelity"  # "" or a reward whose validation value may not fall below the base's by more
    c.eval.select_max_drop = 0.01  # than this for a checkpoint to be chosen (the base is always a candidate)
    # The claim a run set is judged on, named before the runs (scripts/seed_gains.py reads it from config.json): the
    # primary held-out endpoint at its time point ("last": the last epoch's evaluation; "reported": the checkpoint
    # eval.select_by chose) is tested without adjustment; every other look (the secondary endpoints, the other time
    # point, each point of a curve) is Holm-adjusted as one family. Fixed for a run's life: an endpoint moved after
    # the results is not pre-registered.
    c.eval.primary_endpoint = "eval/cam_score"  # the camera reward
    c.eval.primary_time = "last"
    c.eval.secondary_endpoints = "eval/fidelity"  # comma-separated

    # ---- health guard (recam/engine/health.py rules, evaluated every optimizer step) ----
    c.health = ml_collections.ConfigDict()
    c.health.action = "rollback"  # on a critical finding: "warn" (log, never checkpoint it), "stop", "rollback"
    c.health.rollback_lr_factor = 0.5  # learning rate multiplier applied at each rollback
    c.health.max_rollbacks = 3  # rollbacks allowed before the run stops

    # ---- fault injection, for tests of the guard and of resume (negative = off) ----
    c.debug = ml_collections.ConfigDict()
    c.debug.inject_blowup_at_step = -1  # before this global step, add large noise to the policy weights
    c.debug.sigkill_at_step = -1  # SIGKILL this process right after this global step
    c.debug.fail_reward_slots = ""  # e.g. "5,6": those slots (rank * batch_size + i) of every batch fail scoring

    # ---- logging ----
    c.logging = ml_collections.ConfigDict()
    # "offline" | "online" | "disabled"; offline needs no account, online refuses to start without one (exit 2)
    c.logging.wandb_mode = "offline"
    c.logging.wandb_project = "recam"  # wandb project name
    return c
