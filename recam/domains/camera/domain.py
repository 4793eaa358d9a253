"""The ReCam domain: synthetic multi-camera world or ReCamMaster-layout footage, the ReCam / Wan transformer
as the policy, pixels or Wan VAE latents as the sampling space, camera and fidelity rewards."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from recam.domains.camera.checks import check_in_channels, validate_camera, validate_camera_files
from recam.domains.camera.codec import PixelCodec, WanVAECodec, encode_once
from recam.domains.camera.data import ReCamMasterDataset
from recam.domains.camera.loading import load_recammaster_checkpoint, load_wan_transformer
from recam.domains.camera.model import ReCamTransformer3DModel
from recam.domains.camera.services import CameraRewards, used_rewards
from recam.domains.camera.world import SyntheticWorld, collate_conditions
from recam.engine.containers import Batch
from recam.engine.domain import Splits, register_domain
from recam.engine.hooks import Hook
from recam.engine.scheduler import FlowMatchScheduler
from recam.infra import reports
from recam.infra.lora import adapter_disabled
from rewards import MultiReward


@dataclass
class CameraInputs:
    """raw: the collated conditions (videos and cameras in pixel space, recam.domains.camera.world.collate_conditions);
    model: the conditioning the transformer sees, in the codec's space."""

    raw: dict
    model: dict


@register_domain("camera")
class CameraDomain:
    sample_kind = "video"  # what decode returns, and so which registered rewards can score it
    # CamI2V's sums count a frame the estimator could not place at the worst value, so breaking the estimator
    # never shrinks them; the means over placed frames say how good the recovered poses are, beside the share
    # placed (rewards/cam_score.py)
    summary_rows = (("cam_score", "eval/cam_score"), ("RotErr sum (deg, CamI2V)", "eval/rot_err_sum"),
                    ("TransErr sum (CamI2V)", "eval/trans_err_sum"), ("CamMC sum (CamI2V)", "eval/cammc_sum"),
                    ("frames placed (fraction)", "eval/placed_fraction"),
                    ("RotErr per placed frame (deg)", "eval/rot_err_placed_mean"),
                    ("TransErr per placed frame", "eval/trans_err_placed_mean"),
                    ("CamMC per placed frame", "eval/cammc_placed_mean"),
                    ("parallax, still targets (focal lengths)", "eval/static_target_parallax"),
                    ("fidelity", "eval/fidelity"))
    examples_dir = "videos"

    @staticmethod
    def check_config(config, conditions_per_batch: int, require) -> None:
        """Run by config/validate.py before anything is built: sampler, rewards, data and model fields
        (recam/domains/camera/checks.py)."""
        validate_camera(config, conditions_per_batch)

    @staticmethod
    def check_files(config) -> None:
        """Paths and config.json headers (never weights), before the model is built."""
        validate_camera_files(config)

    def __init__(self, config, device, log):
        self.config, self.device, self.log = config, device, log
        # The space the policy samples in: pixels, or the frozen Wan VAE's latents (fp32, on the device).
        self.codec = WanVAECodec.from_pretrained(config.model.vae, device=device) if config.model.vae else PixelCodec()
        self._splits = None

    # ---- data ----
    def datasets(self) -> Splits:
        """Synthetic world splits, or ReCamMaster-layout folders (no validation split: the last epoch reports)."""
        if self._splits is not None:
            return self._splits
        cfg, d = self.config, self.config.data
        if d.source == "synthetic":
            def world(split, n):
                return SyntheticWorld(split, n, d.seed, d.num_frames, d.size, d.conditions_per_scene)
            self._splits = Splits(world("train", d.num_train_conditions), world("heldout", d.num_heldout_conditions),
                                  world("val", d.num_val_conditions) if cfg.eval.select_by else None)
        else:
            common = dict(num_frames=d.num_frames, height=d.height, width=d.width, frame_interval=d.frame_interval,
                          num_heldout_scenes=d.num_heldout_scenes, cache_size=d.cache_size, hfov_deg=d.hfov_deg,
                          source_cams=tuple(c.strip() for c in d.source_cams.split(",") if c.strip()))
            self._splits = Splits(ReCamMasterDataset(d.root, "train", max_conditions=d.num_train_conditions, **common),
                                  ReCamMasterDataset(d.root, "heldout", max_conditions=d.num_heldout_conditions,
                                                     **common), None)
        return self._splits

    def condition_id(self, dataset, i: int) -> str:
        """A condition's id; real data names it without decoding its videos."""
        return dataset.condition_id(i) if isinstance(dataset, ReCamMasterDataset) else dataset[i].condition_id

    def collate(self, dataset, indices, cache=None) -> Batch:
        raw = collate_conditions([dataset[int(i)] for i in indices])
        inputs = CameraInputs(raw, self._model_inputs(raw, cache))
        return Batch(torch.as_tensor(list(indices)), raw["conditions"], inputs)

    def _model_inputs(self, raw: dict, cache: dict | None) -> dict:
        """The source video in the codec's space and one camera per (latent) frame; with `cache`, each
        condition's source is encoded once however many copies and passes ask for it."""
        source = raw["source_video"].to(self.device)
        if cache is None or isinstance(self.codec, PixelCodec):
            source = self.codec.encode(source)
        else:
            source = encode_once(self.codec, source, raw["condition_ids"], cache)
        return {"source_video": source,
                "source_cams": self.codec.latent_cams(raw["source_cams"]).to(self.device),
                "target_cams": self.codec.latent_cams(raw["target_cams"]).to(self.device)}

    # ---- model ----
    def build_policy(self) -> torch.nn.Module:
        """The transformer from model.pretrained, read as model.format says, in model.dtype; its input channels
        checked against the codec's."""
        m = self.config.model
        dtype = getattr(torch, m.dtype)
        if m.format == "recam":
            model = ReCamTransformer3DModel.from_pretrained(m.pretrained, torch_dtype=dtype)
        else:
            loader = load_wan_transformer if m.format == "wan_diffusers" else load_recammaster_checkpoint
            model, report = loader(m.pretrained, dtype=dtype)
            self.log.detail(report.summary())
        check_in_channels(model.config.in_channels, self.config)
        return model

    def sample_shape(self) -> tuple[int, ...]:
        return self.codec.latent_shape(tuple(self.datasets().train[0].target_video.shape))

    def scheduler(self, device) -> FlowMatchScheduler:
        from recam.engine.plan import num_train_timesteps

        s = self.config.sample
        return FlowMatchScheduler(s.num_steps, s.shift, s.noise_level, s.sde_type,
                                  num_train_timesteps(s.num_steps, self.config.train.timestep_fraction), device)

    def denoiser(self, model, batch: Batch, autocast, adapter_off: bool = False):
        inputs = batch.inputs.model

        def velocity(x, sigma):
            with autocast(), (adapter_disabled(model) if adapter_off else contextlib.nullcontext()):
                return model(x, sigma, inputs["source_video"], inputs["source_cams"], inputs["target_cams"]).float()
        return velocity

    def decode(self, samples: torch.Tensor) -> torch.Tensor:
        return self.codec.decode(samples).cpu()  # rewards see pixels

    def references(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Clips the rewards are read against: the ground truth (a perfect re-render) and the source (the scene
        re-rendered from the source camera, i.e. a camera that did not follow the target)."""
        return {"target": batch.inputs.raw["target_video"], "source": batch.inputs.raw["source_video"]}

    # ---- rewards, hooks, examples ----
    def reward_fn(self, weights, report=()):
        # The trainer asks for its training and its evaluation rewards separately; both get the domain's one set
        # of reward objects, so one judge serves both and evaluation scores with the critic being trained.
        used = [*(n for n, w in weights.items() if w > 0), *report]
        return MultiReward(weights, report=report, rewards=self._rewards().get(used))

    def hooks(self) -> list:
        rewards = self._rewards()
        rewards.get(used_rewards(self.config))  # before any sampling: a down judge fails here at the latest
        if rewards.discriminator is None:
            return []
        return [DiscriminatorHook(rewards.discriminator, self.config.reward.discriminator.steps_per_epoch, self.log)]

    def _rewards(self) -> CameraRewards:
        """The domain's reward objects, made on first use (building the domain contacts no judge)."""
        if getattr(self, "_camera_rewards", None) is None:
            self._camera_rewards = CameraRewards(self.config, self.log, self.device)
        return self._camera_rewards

    def write_examples(self, out_dir: Path, batch: Batch, decoded: torch.Tensor, n: int) -> None:
        reports.write_comparison_videos(out_dir, batch.inputs.raw, decoded, n,
                                       scale=max(1, 128 // decoded.shape[-2]))  # 4x for 32 px, 1x at real size


class DiscriminatorHook(Hook):
    """Critic updates ranking ground-truth renders (teacher) above this epoch's samples (student), after the
    samples are scored and before the policy update."""

    needs_samples = True

    def __init__(self, disc, steps: int, log):
        self.disc, self.steps, self.log = disc, steps, log

    def epoch_record(self, rollouts, groups, dataset) -> dict:
        student = torch.cat(rollouts.decoded)
        teacher = torch.stack([dataset[int(i)].target_video for i in rollouts.index])
        metrics = {}
        for _ in range(self.steps):
            metrics = {f"discriminator/{k}": float(v) for k, v in self.disc.train_step(teacher, student).items()}
        for severity, message in self.disc.health({k.split("/", 1)[1]: v for k, v in metrics.items()}):
            self.log.info(f"discriminator health {severity}: {message}")
        return metrics
