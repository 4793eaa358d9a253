"""GRPO post-training of a camera-controlled video generator (ReCam), top to bottom.

    accelerate launch scripts/train_recam.py --config config/grpo.py:tiny_cpu [--config.train.beta=0.01]

Per epoch: sample k copies of each condition with SDE log-probs -> score with the rewards -> gather across
processes -> group-relative advantages broadcast over the trained timesteps -> clipped-ratio policy updates
with a KL pull toward the frozen base -> log, checkpoint, evaluate held-out conditions with ODE sampling.

Data: the synthetic world (data.source = "synthetic") or ReCamMaster-layout scene folders ("recammaster").
Space: pixels (model.vae = "") or the Wan VAE's latents: the source video is encoded once per batch, rollouts
and training run on latents, and samples are decoded before the rewards and the written videos.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from absl import app, flags  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import gather_object  # noqa: E402
from ml_collections import config_flags  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from config.validate import check_in_channels, eval_report_rewards, validate, validate_files  # noqa: E402
from recam import runlog  # noqa: E402
from recam.advantages import broadcast_over_timesteps, nonzero_group_mask  # noqa: E402
from recam.checkpoint import (  # noqa: E402
    SELECTED,
    checkpoint_before,
    latest_checkpoint,
    load_trainer_state,
    point,
    point_latest,
    read_model_into,
    save_checkpoint,
    set_rng_state,
)
from recam.codec import PixelCodec, WanVAECodec, encode_once  # noqa: E402
from recam.constraint import dual_step  # noqa: E402
from recam.data import ReCamMasterDataset  # noqa: E402
from recam.distributed import local_slice, use_cpu_if_no_accelerator  # noqa: E402
from recam.health import SAMPLE_RULES, diagnose_step  # noqa: E402
from recam.loading import load_recammaster_checkpoint, load_wan_transformer  # noqa: E402
from recam.lora import adapter_disabled, add_lora  # noqa: E402
from recam.losses import get_kl_estimator, get_policy_loss  # noqa: E402
from recam.model import ReCamTransformer3DModel  # noqa: E402
from recam.pipeline import STEP_FNS, ode_sample, per_sample_noise, rescore, rollout  # noqa: E402
from recam.sampler import KRepeatBatchSampler  # noqa: E402
from recam.sde import flow_sigmas, gaussian_kl_between_means  # noqa: E402
from recam.selection import select_checkpoint  # noqa: E402
from recam.variants import (  # noqa: E402
    EMAImportanceState,
    gradient_adaptive_weights,
    importance_weights,
    output_gradient_norm,
)
from recam.world import SyntheticWorld, collate_conditions  # noqa: E402
from rewards import MultiReward, weighted_mean  # noqa: E402
from rewards.async_pipeline import (  # noqa: E402
    AsyncRewardRunner,
    RewardServerDown,
    concat_results,
    exclusion_mask,
    masked_group_advantages,
)

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", "config/grpo.py:tiny_cpu", "Preset file:name plus overrides.")


def velocity_fn_for(model, batch: dict, autocast, adapter_off: bool = False):
    """Close the conditioning of a batch over the model: v(x, sigma) for the pipeline functions.

    adapter_off: run the base network under a LoRA policy (the reference), never building a graph.
    """
    def velocity(x, sigma):
        with autocast(), (adapter_disabled(model) if adapter_off else contextlib.nullcontext()):
            return model(x, sigma, batch["source_video"], batch["source_cams"], batch["target_cams"]).float()
    return velocity


def model_inputs(batch: dict, codec, device, source_cache: dict | None = None) -> dict:
    """The conditioning the model sees, in the codec's space: the source video and one camera per (latent) frame.
    In pixel space this is the batch's own tensors; in latent space, with `source_cache`, each condition's source is
    encoded once however many copies and passes ask for it."""
    source = batch["source_video"].to(device)
    if source_cache is None or isinstance(codec, PixelCodec):
        source = codec.encode(source)
    else:
        source = encode_once(codec, source, batch["condition_ids"], source_cache)
    return {"source_video": source,
            "source_cams": codec.latent_cams(batch["source_cams"]).to(device),
            "target_cams": codec.latent_cams(batch["target_cams"]).to(device)}


def evaluate(model, world, codec, config, sigmas, reward_fn, accelerator, autocast, tag: str, run_dir: Path,
             prefix: str = "eval", videos_dir: Path | None = None) -> dict:
    """Evaluation with deterministic ODE sampling from fixed per-condition noise; rank-sharded.

    Metrics come back as <prefix>/<name>; comparison videos of the first conditions go to videos_dir/tag."""
    idx = list(range(accelerator.process_index, len(world), accelerator.num_processes))
    results = []
    shape = codec.latent_shape(tuple(world[0].target_video.shape))
    for start in range(0, len(idx), config.eval.batch_size):
        chunk = idx[start:start + config.eval.batch_size]
        batch = collate_conditions([world[i] for i in chunk])
        noise = per_sample_noise([(config.eval.seed, i) for i in chunk], 1, shape)[:, 0]
        latents = ode_sample(velocity_fn_for(model, model_inputs(batch, codec, accelerator.device), autocast),
                             noise.to(accelerator.device), sigmas)
        videos = codec.decode(latents).cpu()
        scores, details = reward_fn(videos, batch["conditions"])
        for n, i in enumerate(chunk):
            row = {"index": i, **{f"reward_{k}": float(v[n]) for k, v in scores.items()}}
            row.update({k: float(v[n]) for k, v in details.items() if torch.is_tensor(v) and v.ndim == 1})
            results.append(row)
        if accelerator.is_main_process and start == 0 and config.eval.num_videos > 0 and videos_dir is not None:
            runlog.write_comparison_videos(videos_dir / tag, batch, videos, config.eval.num_videos,
                                           scale=max(1, 128 // videos.shape[-2]))  # 4x for 32 px, 1x at real size
    rows = sorted(gather_object(results), key=lambda r: r["index"])
    return runlog.summarise_eval(rows, prefix)


def main(_):
    config = FLAGS.config
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    use_cpu_if_no_accelerator()
    accelerator = Accelerator(mixed_precision=config.mixed_precision)
    derived = validate(config, accelerator.num_processes)  # before any model is built
    validate_files(config)  # paths, and in_channels against the codec's channels, from config.json headers
    run_dir = Path(config.run_dir)
    rank, world_size = accelerator.process_index, accelerator.num_processes
    log = runlog.RunLog(run_dir, config, enabled=accelerator.is_main_process)
    log.info(f"derived numbers: {json.dumps(derived)}")
    torch.manual_seed(config.seed)
    np.random.seed(config.seed)

    # ---- data, models, optimizer, rewards ----
    train_world, heldout, val_world = build_datasets(config)
    log.info(f"data: {config.data.source}, {len(train_world)} training / {len(heldout)} held-out"
             + (f" / {len(val_world)} validation conditions" if val_world is not None else " conditions"))
    if config.eval.select_by and val_world is None:
        log.info(f"eval.select_by={config.eval.select_by!r} is ignored: {config.data.source} data has no validation "
                 "split, so the run reports its last epoch")
    policy = load_policy(config, log)
    check_in_channels(policy.config.in_channels, config)
    # The space the policy samples in: pixels, or the frozen Wan VAE's latents (fp32, on the device).
    codec = WanVAECodec.from_pretrained(config.model.vae, device=accelerator.device) if config.model.vae else \
        PixelCodec()
    use_lora = config.model.lora_rank > 0
    reference = None
    if use_lora:  # the reference is the same network with the adapter disabled: no second copy in memory
        add_lora(policy, config.model.lora_rank, config.model.lora_alpha,
                 [m.strip() for m in config.model.lora_targets.split(",") if m.strip()] or None)
    elif config.train.beta > 0:
        reference = copy.deepcopy(policy).requires_grad_(False).eval().to(accelerator.device)
    if config.model.gradient_checkpointing:  # recompute block activations in the backward: memory for time
        policy.enable_gradient_checkpointing()
    t = config.train
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=t.learning_rate,
                                  betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.adam_weight_decay,
                                  eps=t.adam_epsilon)
    ema = None
    if t.ema:
        from diffusers.training_utils import EMAModel
        ema = EMAModel(policy.parameters(), decay=t.ema_decay)
    reward_fn = MultiReward(dict(config.reward.weights))
    eval_reward_fn = MultiReward(dict(config.reward.weights), report=eval_report_rewards(config))
    discriminator = setup_reward_services(config, log)  # before any sampling: a down judge fails here
    runner = AsyncRewardRunner(reward_fn, config.reward.async_workers, config.reward.failure_policy,
                               config.reward.max_retries, config.reward.retry_backoff_s)
    policy_loss_fn = get_policy_loss(t.policy_loss)
    kl_estimator = None if t.kl_type == "gaussian_mean" else get_kl_estimator(t.kl_type)
    variants = VariantInputs(config.train) if t.policy_loss == "grpo_variants" else None

    r_cfg = config.reward
    dual = {"weight": float(r_cfg.weights[r_cfg.constraint]), "threshold": None} if r_cfg.constraint else None

    # ---- resume (or start from the base, saved once as the first healthy checkpoint) ----
    policy, optimizer = accelerator.prepare(policy, optimizer)
    unwrapped = accelerator.unwrap_model(policy)
    autocast = accelerator.autocast if config.mixed_precision != "no" else contextlib.nullcontext
    ckpt_root = run_dir / "checkpoints"
    start_epoch, global_step = 0, 0
    ckpt = latest_checkpoint(ckpt_root) if config.resume else None
    if ckpt is not None:
        start_epoch, global_step = load_into(ckpt, unwrapped, optimizer, ema, dual=dual)
        log.truncate_after(start_epoch)
        log.info(f"resumed from {ckpt} at epoch {start_epoch}, global step {global_step}")
    elif accelerator.is_main_process:
        save(ckpt_root, 0, 0, unwrapped, optimizer, ema, config, dual=dual)
    accelerator.wait_for_everyone()

    s = config.sample
    sigmas = flow_sigmas(s.num_steps, s.shift).to(accelerator.device)
    eval_sigmas = flow_sigmas(s.eval_num_steps, s.shift).to(accelerator.device)
    T = derived["num_train_timesteps"]
    sampler = KRepeatBatchSampler(len(train_world), s.batch_size, s.k, world_size, rank, config.seed,
                                  s.num_batches_per_epoch)
    latent_shape = codec.latent_shape(tuple(train_world[0].target_video.shape))  # noise and rollout states

    def run_eval(tag, checkpoint):
        """Held-out metrics (eval/...) and, when a checkpoint is to be selected, validation metrics (val/...) of the
        weights in memory, which are those of checkpoint folder `checkpoint` (epoch_NNNN)."""
        with ema_weights(ema, unwrapped):
            unwrapped.eval()
            out = evaluate(unwrapped, heldout, codec, config, eval_sigmas, eval_reward_fn, accelerator, autocast, tag,
                           run_dir, "eval", run_dir / "videos")
            if val_world is not None:
                out.update(evaluate(unwrapped, val_world, codec, config, eval_sigmas, eval_reward_fn, accelerator,
                                    autocast, tag, run_dir, "val"))
        # epoch = the last trained epoch, so resuming or rolling back to a checkpoint keeps exactly its evaluations
        trained_epochs = int(checkpoint.removeprefix("epoch_"))
        log.eval_record(tag, global_step, out, epoch=trained_epochs - 1, checkpoint=checkpoint)
        return out

    def selected_eval() -> dict | None:
        """The evaluation record the run reports (eval.select_by on val/...), or None when it reports its end."""
        if val_world is None or not accelerator.is_main_process:  # only the main process saves and reports
            return None
        evals = log.read_evals()
        index = select_checkpoint(evals, f"val/{config.eval.select_by}",
                                  f"val/{config.eval.select_guard}" if config.eval.select_guard else "",
                                  config.eval.select_max_drop)
        return evals[index]

    eval_before = log.read_eval("start") or run_eval("start", "epoch_0000")
    if ckpt is not None and 0 < start_epoch < config.num_epochs and start_epoch % config.eval.freq == 0 \
            and log.read_eval(f"epoch_{start_epoch:04d}") is None:
        run_eval(f"epoch_{start_epoch:04d}", ckpt.name)  # the run died between this checkpoint and its evaluation
    selected = selected_eval()  # its checkpoint is never pruned
    history: list[dict] = []  # recent step metrics, for the health rules
    rollbacks, stopped_by, injected = 0, None, False

    epoch = start_epoch
    while epoch < config.num_epochs:
        epoch_t0 = time.time()
        # ---- 1. sample k copies per condition, storing only what training needs ----
        unwrapped.eval()
        local = {"states": [], "log_probs": [], "index": [], "videos": []}
        source_cache = {}  # this epoch's encoded source videos (latent space only), shared by sampling and training
        for b in tqdm(range(s.num_batches_per_epoch), desc=f"epoch {epoch} sampling", disable=not log.enabled,
                      leave=False):
            position = epoch * s.num_batches_per_epoch + b
            indices = sampler.batch_at(position)
            batch = collate_conditions([train_world[i] for i in indices])
            keys = [(config.seed, position, rank * s.batch_size + n) for n in range(len(indices))]
            noise = per_sample_noise(keys, s.num_steps + 1, latent_shape).to(accelerator.device)
            out = rollout(velocity_fn_for(unwrapped, model_inputs(batch, codec, accelerator.device, source_cache),
                                          autocast),
                          noise, sigmas, T, s.noise_level, s.sde_type)
            videos = codec.decode(out.videos).cpu()  # rewards see pixels
            runner.submit(position, videos, batch["conditions"])  # scored while the next batch samples
            local["states"].append(out.states.cpu())
            local["log_probs"].append(out.log_probs.cpu())
            local["index"].append(torch.tensor(indices))
            if discriminator is not None:  # its student videos; kept only when it trains
                local["videos"].append(videos)
        try:
            results = runner.collect()
        except RewardServerDown as e:
            stopped_by = f"reward server down at epoch {epoch}: {e}"
            log.info(f"{stopped_by}; the last checkpoint {latest_checkpoint(ckpt_root)} is intact")
            break
        scores, valid = concat_results(results)
        reward_seconds = sum(sum(r.call_seconds) for r in results)
        states = torch.cat(local["states"])
        old_log_probs = torch.cat(local["log_probs"])
        cond_index = torch.cat(local["index"])
        rewards = {k: v.float() for k, v in scores.items()}

        # ---- 2. gather across processes (rank order), advantages per condition, take back our slice ----
        g_index = accelerator.gather(cond_index.to(accelerator.device)).cpu()
        g_rewards = {k: accelerator.gather(v.to(accelerator.device)).cpu() for k, v in rewards.items()}
        g_valid = accelerator.gather(valid.to(accelerator.device)).cpu().bool()
        # A failed reward is excluded from its group's statistics, never counted as a 0.
        keep, exclusion = exclusion_mask(g_valid, g_index, runner.exclusion_policy)
        if dual is not None:  # a constrained reward enters avg with this epoch's multiplier as its weight
            if dual["threshold"] is None:  # the first epoch's samples are the base's: they set the floor
                dual["threshold"] = float(g_rewards[r_cfg.constraint].nanmean()) - r_cfg.constraint_slack
            g_rewards["avg"] = weighted_mean(g_rewards, {**dict(r_cfg.weights), r_cfg.constraint: dual["weight"]})
        advantages, _, adv_stats = masked_group_advantages(g_rewards["avg"], g_index, keep,
                                                           config.advantage.std_mode, config.advantage.eps)
        g_adv_t = broadcast_over_timesteps(advantages, T)  # (N, T)
        if config.advantage.filter_zero_std:
            keep &= nonzero_group_mask(advantages, g_index)
        adv_local = local_slice(g_adv_t, rank, world_size)
        g_traj = trajectory_ids(g_index)
        traj_ids = local_slice(g_traj, rank, world_size)
        keep_local = local_slice(keep, rank, world_size)
        record = runlog.epoch_record(epoch, global_step, derived,
                                     [condition_id(train_world, int(i)) for i in g_index], g_index,
                                     g_rewards, g_adv_t, adv_stats, reward_seconds)
        record["trajectory_ids"] = [f"{c}#{k}" for c, k in g_traj.tolist()]
        if dual is not None:
            record["constraint_weight"], record["constraint_threshold"] = dual["weight"], dual["threshold"]
        record["excluded"] = (~keep).tolist()
        record.update(exclusion)
        if discriminator is not None:
            record.update(train_discriminator(discriminator, local["videos"], cond_index, train_world,
                                              config.reward.discriminator.steps_per_epoch, log))
        # reward_avg and every reward_<key>: the reward rules compare them across epochs
        epoch_signal = {"zero_std_ratio": record["zero_std_ratio"],
                        **{k: v for k, v in record.items() if k.startswith("reward_") and isinstance(v, float)}}

        # ---- 3. policy updates: clipped ratio + KL to the frozen base, accumulating over timesteps ----
        unwrapped.train()
        order = torch.randperm(len(states), generator=torch.Generator().manual_seed(config.seed * 7919 + epoch))
        order = order[keep_local[order]]
        step_metrics, critical = [], []
        for _inner in range(t.num_inner_epochs):
            micro = [order[i:i + t.batch_size] for i in range(0, len(order), t.batch_size)]
            for first in range(0, len(micro), t.gradient_accumulation_steps):
                chunk = micro[first:first + t.gradient_accumulation_steps]
                if global_step == config.debug.inject_blowup_at_step and not injected:
                    inject_blowup(unwrapped)
                    injected = True  # one-shot, so a rollback replaying this step sees a healthy model
                acc = []
                for c, sel in enumerate(chunk):
                    mb_batch = model_inputs(collate_conditions([train_world[int(i)] for i in cond_index[sel]]),
                                            codec, accelerator.device, source_cache)
                    mb_states = states[sel].to(accelerator.device)
                    policy_v = velocity_fn_for(policy, mb_batch, autocast)
                    ref_v = None
                    if use_lora and t.beta > 0:
                        ref_v = velocity_fn_for(unwrapped, mb_batch, autocast, adapter_off=True)
                    elif reference is not None:
                        ref_v = velocity_fn_for(reference, mb_batch, autocast)
                    prepared = variants.prepare(policy_v, mb_states, sigmas, old_log_probs[sel], traj_ids[sel], _inner,
                                                s.noise_level, s.sde_type) if variants else None
                    for j in range(T):
                        cur = rescore(policy_v, mb_states, sigmas, j, s.noise_level, s.sde_type)
                        kl = None
                        if ref_v is not None:
                            with torch.no_grad():
                                ref = rescore(ref_v, mb_states, sigmas, j, s.noise_level, s.sde_type)
                            kl = (gaussian_kl_between_means(cur.mean, ref.mean, cur.std) if kl_estimator is None
                                  else kl_estimator(cur.log_prob, ref.log_prob))
                        loss, metrics = policy_loss_fn(
                            cur.log_prob, old_log_probs[sel, j].to(accelerator.device),
                            adv_local[sel, j].to(accelerator.device), clip_range=t.clip_range,
                            adv_clip_max=t.adv_clip_max, log_ratio_clamp=t.log_ratio_clamp, kl=kl, beta=t.beta,
                            **(variants.loss_kwargs(prepared, j, T) if variants else {}))
                        if prepared:
                            metrics.update(prepared["metrics"])
                        if ref_v is not None:
                            metrics["mean_log_prob_ref"] = ref.log_prob.mean()
                        metrics["importance_weight_var"] = (cur.log_prob.detach() - old_log_probs[sel, j].to(
                            accelerator.device)).clamp(-t.log_ratio_clamp, t.log_ratio_clamp).exp().var(unbiased=False)
                        last = c == len(chunk) - 1 and j == T - 1
                        # gradients accumulate over timesteps and micro-batches; processes sync once per step
                        with accelerator.no_sync(policy) if not last else contextlib.nullcontext():
                            accelerator.backward(loss / (T * len(chunk)))
                        acc.append({k: v.detach() for k, v in metrics.items()})
                grad_norm = accelerator.clip_grad_norm_(policy.parameters(), t.max_grad_norm)
                m = {k: float(torch.stack([a[k] for a in acc]).mean()) for k in acc[0]}  # one sync per step
                m["ratio_max"] = max(float(a["ratio_max"]) for a in acc)
                m["ratio_min"] = min(float(a["ratio_min"]) for a in acc)
                m["grad_norm"] = float(grad_norm)
                m["learning_rate"] = optimizer.param_groups[0]["lr"]
                m = runlog.mean_over_processes(m, accelerator)
                # The guard looks before the update is applied: a broken step never reaches the weights.
                findings = diagnose_step({**m, **epoch_signal}, history, run_dir=str(run_dir))
                critical = [f for f in findings if f.severity == "critical"]
                if not critical:
                    optimizer.step()
                    if ema is not None:
                        ema.step(unwrapped.parameters())
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
                log.step_record(global_step, epoch, m)
                history.append({**m, **epoch_signal})  # the reward rules compare epochs, so keep their signal
                step_metrics.append(m)
                if findings:
                    log.health_record(global_step, epoch, findings)
                if global_step == config.debug.sigkill_at_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                if critical:
                    break
            if critical:
                break
        if variants:
            variants.retire_epoch()  # this epoch's samples are retired with it
        record["optimizer_steps"] = step_metrics
        record["first_step_ratio_deviation"] = abs(step_metrics[0]["mean_ratio"] - 1.0) if step_metrics else None
        record["epoch_seconds"] = time.time() - epoch_t0
        log.epoch_record(record)
        log.info(runlog.epoch_line(record))

        # ---- 4. health: a broken epoch is never checkpointed; stop or roll back as configured ----
        if critical:
            log.info("health guard: " + "; ".join(f"{f.rule} ({f.severity})" for f in critical))
            healthy_ckpt = latest_checkpoint(ckpt_root)
            if any(f.rule in SAMPLE_RULES for f in critical):
                # the collapsed samples were drawn by the weights in `latest`: restore the checkpoint before them
                older = checkpoint_before(ckpt_root, epoch)
                if older is None:
                    log.info(f"no checkpoint older than epoch {epoch} is kept (config.keep_checkpoints); "
                             f"restoring {healthy_ckpt}, whose weights drew the collapsed samples")
                else:
                    healthy_ckpt = older
                    if accelerator.is_main_process:
                        point_latest(ckpt_root, older.name)  # a crash from here on resumes from the good one
                    accelerator.wait_for_everyone()
            if config.health.action == "stop" or (config.health.action == "rollback"
                                                   and rollbacks >= config.health.max_rollbacks):
                stopped_by = f"health guard, {critical[0].rule} at step {global_step}"
                load_into(healthy_ckpt, unwrapped, optimizer, ema, dual=dual)
                log.info(f"stopped; weights restored from the last healthy checkpoint {healthy_ckpt}")
                break
            if config.health.action == "rollback":
                rollbacks += 1
                epoch, global_step = load_into(healthy_ckpt, unwrapped, optimizer, ema, dual=dual,
                                               lr_factor=config.health.rollback_lr_factor ** rollbacks)
                log.archive_after(epoch, reason=f"rollback {rollbacks}: {critical[0].rule}")
                selected = selected_eval()  # the rolled-back evaluations are no longer candidates
                history.clear()
                log.info(f"rolled back to {healthy_ckpt} (epoch {epoch}, step {global_step}), "
                         f"learning rate now {optimizer.param_groups[0]['lr']:.3g}")
                continue
            epoch += 1  # action "warn": keep going, but this state is never saved as a checkpoint
            continue

        # ---- 5. the constrained reward's multiplier for the next epoch, checkpoint, evaluate ----
        if dual is not None:
            dual["weight"] = dual_step(dual["weight"], float(g_rewards[r_cfg.constraint].nanmean()),
                                       dual["threshold"], r_cfg.constraint_lr, r_cfg.constraint_max_weight)
        epoch += 1
        accelerator.wait_for_everyone()
        if accelerator.is_main_process and (epoch % config.save_freq == 0 or epoch == config.num_epochs):
            save(ckpt_root, epoch, global_step, unwrapped, optimizer, ema, config, dual=dual,
                 protect=(selected["checkpoint"],) if selected else ())
        accelerator.wait_for_everyone()
        if epoch % config.eval.freq == 0 and epoch != config.num_epochs:
            run_eval(f"epoch_{epoch:04d}", f"epoch_{epoch:04d}")
            selected = selected_eval()

    runner.close()
    eval_after = run_eval("final", latest_checkpoint(ckpt_root).name)  # a stopped run holds the weights of `latest`
    selected = selected_eval()
    if accelerator.is_main_process:
        if selected is not None:
            point(ckpt_root, SELECTED, selected["checkpoint"])
        reports = runlog.write_reports(run_dir)
        log.summary(eval_before, eval_after, extra_paths=reports, note=stopped_by and f"stopped early: "
                    f"{stopped_by}", rollbacks=rollbacks, selected=selected,
                    selection=selection_rule(config) if selected is not None else None)
    log.close()
    # The DDP reducer must die before its process group, or gloo's teardown deadlocks on the GIL at exit.
    accelerator.free_memory()
    policy = unwrapped = optimizer = reference = None
    gc.collect()
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if stopped_by:
        sys.exit(3)


def build_datasets(config):
    """(train, held-out, validation or None) datasets of recam.world.Condition: the synthetic world, or
    ReCamMaster-layout folders (no validation split: there eval.select_by is ignored and the last epoch reports)."""
    d = config.data
    if d.source == "synthetic":
        def world(split, n):
            return SyntheticWorld(split, n, d.seed, d.num_frames, d.size, d.conditions_per_scene)
        return (world("train", d.num_train_conditions), world("heldout", d.num_heldout_conditions),
                world("val", d.num_val_conditions) if config.eval.select_by else None)
    common = dict(num_frames=d.num_frames, height=d.height, width=d.width, frame_interval=d.frame_interval,
                  num_heldout_scenes=d.num_heldout_scenes, cache_size=d.cache_size,
                  source_cams=tuple(c.strip() for c in d.source_cams.split(",") if c.strip()))
    return (ReCamMasterDataset(d.root, "train", max_conditions=d.num_train_conditions, **common),
            ReCamMasterDataset(d.root, "heldout", max_conditions=d.num_heldout_conditions, **common), None)


def selection_rule(config) -> str:
    """The checkpoint selection rule in words, for the summary."""
    e = config.eval
    guard = (f", {e.select_guard} at most {e.select_max_drop:g} below the base's" if e.select_guard else "")
    return f"best validation {e.select_by} over {config.data.num_val_conditions} validation conditions{guard}"


def condition_id(dataset, i: int) -> str:
    """A condition's id; real data names it without decoding its videos."""
    return dataset.condition_id(i) if isinstance(dataset, ReCamMasterDataset) else dataset[i].condition_id


def load_policy(config, log):
    """The transformer from model.pretrained, read as model.format says, in model.dtype."""
    m = config.model
    dtype = getattr(torch, m.dtype)
    if m.format == "recam":
        return ReCamTransformer3DModel.from_pretrained(m.pretrained, torch_dtype=dtype)
    loader = load_wan_transformer if m.format == "wan_diffusers" else load_recammaster_checkpoint
    model, report = loader(m.pretrained, dtype=dtype)
    log.info(report.summary())
    return model


def setup_reward_services(config, log):
    """Configure rewards that need a service or state; a judge that is down fails here, before sampling."""
    weights = {k: w for k, w in config.reward.weights.items() if w > 0}
    if "unifiedscore" in weights:
        from rewards.unified import UnifiedConfig, health_check, set_unified_config

        u = config.reward.unified
        ucfg = UnifiedConfig(base_url=u.base_url, model=u.model, api_key_env=u.api_key_env,
                             prompt_format=u.prompt_format, num_frames=u.num_frames, frame_size=u.frame_size,
                             max_concurrency=u.max_concurrency, timeout_s=u.timeout_s, max_retries=u.max_retries)
        health_check(ucfg, check_model=u.check_model)
        set_unified_config(ucfg)
        log.info(f"UnifiedReward judge at {u.base_url} is up")
    if "discriminator" in weights:
        from rewards.discriminator import Discriminator, DiscriminatorConfig, set_active_discriminator

        d = config.reward.discriminator
        disc = Discriminator(DiscriminatorConfig(lr=d.lr, temperature=d.temperature,
                                                 adaptive_temperature=d.adaptive_temperature,
                                                 reg_threshold=d.reg_threshold, reg_weight=d.reg_weight,
                                                 seed=config.seed))
        set_active_discriminator(disc)
        return disc
    return None


def train_discriminator(disc, videos: list, cond_index, world, steps: int, log) -> dict:
    """Critic updates ranking ground-truth renders (teacher) above this epoch's samples (student)."""
    student = torch.cat(videos)
    teacher = torch.stack([world[int(i)].target_video for i in cond_index])
    metrics = {}
    for _ in range(steps):
        metrics = {f"discriminator/{k}": float(v) for k, v in disc.train_step(teacher, student).items()}
    for severity, message in disc.health({k.split("/", 1)[1]: v for k, v in metrics.items()}):
        log.info(f"discriminator health {severity}: {message}")
    return metrics


def trajectory_ids(g_index: torch.Tensor) -> torch.Tensor:
    """(N, 2) int64 [dataset index, copy number]: a key per trajectory that survives shuffles and splits."""
    seen: dict[int, int] = {}
    copies = []
    for i in g_index.tolist():
        copies.append(seen.get(i, 0))
        seen[i] = copies[-1] + 1
    return torch.stack([g_index.long(), torch.tensor(copies, dtype=torch.long)], 1)


class VariantInputs:
    """Glue between the loop and recam.variants: the no-grad all-timestep pass and per-timestep kwargs."""

    FLAGS = ("use_amic", "use_gspo", "use_ptrw", "ptrw_sigma", "use_temporal_decay", "temporal_decay_gamma",
             "temporal_decay_normalize", "use_asymmetric_clipping", "clip_ratio_pos", "clip_ratio_neg")

    def __init__(self, train_config):
        self.t = train_config
        self.static = {k: train_config[k] for k in self.FLAGS}
        self.ema = EMAImportanceState(train_config.ema_beta) if train_config.use_ema_smoothing else None
        self.needs_pass = (train_config.use_ema_smoothing or train_config.use_gradient_adaptive_weighting
                           or train_config.use_amic or train_config.use_gspo)

    @torch.no_grad()
    def prepare(self, policy_v, states, sigmas, old_log_probs, ids, inner_epoch, noise_level, sde_type) -> dict:
        out = {"metrics": {}}
        if not self.needs_pass:
            return out
        T = old_log_probs.shape[1]
        steps = [rescore(policy_v, states, sigmas, j, noise_level, sde_type) for j in range(T)]
        seq = torch.stack([o.log_prob for o in steps], 1)
        out["seq_log_prob"], out["seq_old_log_prob"] = seq, old_log_probs.to(seq.device)
        keys = [tuple(r) for r in ids.tolist()]
        if self.ema is not None:
            raw = importance_weights(seq, out["seq_old_log_prob"], self.t.log_ratio_clamp)
            out["ema"] = self.ema.update(keys, raw, expect_state=inner_epoch > 0)
            out["metrics"].update(self.ema.metrics(raw, out["ema"]))
        if self.t.use_gradient_adaptive_weighting:
            norms = torch.stack([output_gradient_norm(states[:, j + 1], o.mean, o.std,
                                                      velocity_coefficient(sigmas, j, noise_level, sde_type))
                                 for j, o in enumerate(steps)], 1)
            out["grad"], metrics = gradient_adaptive_weights(norms, self.t.gradient_weighting_temperature)
            out["metrics"].update(metrics)
        return out

    def loss_kwargs(self, prepared: dict, j: int, T: int) -> dict:
        kw = {**self.static, "timestep_index": j, "num_timesteps": T}
        if self.t.use_amic or self.t.use_gspo:
            kw["seq_log_prob"], kw["seq_old_log_prob"] = prepared["seq_log_prob"], prepared["seq_old_log_prob"]
        if "ema" in prepared:
            kw["ema_weight"] = prepared["ema"][:, j]
        if "grad" in prepared:
            kw["grad_weight"] = prepared["grad"][:, j]
        return kw

    def retire_epoch(self) -> None:
        if self.ema is not None:
            self.ema.retire_all()


def velocity_coefficient(sigmas, j, noise_level, sde_type) -> float:
    """|d mean / d velocity| of step j (the step is affine in v), read off the step function itself."""
    one = torch.ones(1, 1)
    zero = torch.zeros(1, 1)
    step = STEP_FNS[sde_type]
    a = step(one, sigmas[j].cpu(), sigmas[j + 1].cpu(), zero, noise_level, prev_sample=zero).mean
    b = step(zero, sigmas[j].cpu(), sigmas[j + 1].cpu(), zero, noise_level, prev_sample=zero).mean
    return float((a - b).abs())


def save(ckpt_root, epoch, global_step, model, optimizer, ema, config, dual: dict | None = None,
         protect: tuple[str, ...] = ()):
    """Checkpoint at an epoch boundary: only healthy states get here. `protect`: checkpoints never pruned;
    `dual`: the constrained reward's multiplier and floor (reward.constraint), restored with the weights."""
    save_checkpoint(ckpt_root, f"epoch_{epoch:04d}", model, optimizer, ema,
                    {"epoch": epoch, "global_step": global_step,
                     "sampler_position": epoch * config.sample.num_batches_per_epoch,
                     "learning_rate": optimizer.param_groups[0]["lr"], "healthy": True,
                     **({"reward_constraint": dict(dual)} if dual is not None else {})},
                    keep=config.keep_checkpoints, protect=protect)


def load_into(ckpt, model, optimizer, ema, lr_factor: float = 1.0, dual: dict | None = None) -> tuple[int, int]:
    """Restore weights, optimizer, EMA, RNG and the constraint multiplier (into `dual`) from a checkpoint in place;
    returns (epoch, global step)."""
    state, trainer = load_trainer_state(ckpt)
    if dual is not None and "reward_constraint" in state:
        dual.update(state["reward_constraint"])
    read_model_into(model, ckpt / "model")
    optimizer.load_state_dict(trainer["optimizer"])
    for group in optimizer.param_groups:
        group["lr"] = state["learning_rate"] * lr_factor
    if ema is not None and trainer["ema"] is not None:
        ema.load_state_dict(trainer["ema"])
    set_rng_state(trainer["rng"])
    return state["epoch"], state["global_step"]


@torch.no_grad()
def inject_blowup(model) -> None:
    """Fault injection for tests: a destructive perturbation of the weights, like a diverged update."""
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g).to(p) * 5.0)


@contextlib.contextmanager
def ema_weights(ema, model):
    """Evaluate with the EMA weights when EMA is on, restoring the live weights afterwards."""
    if ema is None:
        yield
        return
    ema.store(model.parameters())
    ema.copy_to(model.parameters())
    try:
        yield
    finally:
        ema.restore(model.parameters())


if __name__ == "__main__":
    app.run(main)
