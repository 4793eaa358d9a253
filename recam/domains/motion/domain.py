"""The motion domain: text-to-motion with an MDM-layout diffusion model, post-trained by the shared GRPO engine.

Data: the synthetic world (recam/domains/motion/world.py: MotionWorld's train / validation / held_out splits,
disjoint by motion parameters) or a HumanML3D folder (data.source "humanml3d": train / val / test). A condition
is one caption with its reference motion and length; its id is the world's or HumanML3D's, stable across runs.

Sampling space: MDM's layout [263, 1, 196] of normalised HumanML3D features, padded after each condition's length.
The model predicts x0 and is sampled with DDIM over a cosine DDPM schedule of motion.diffusion_steps (MDM: 1000):
the first T steps stochastic with eta motion.eta (eta 1 on evenly spaced steps is DDPM-like ancestral sampling),
the rest -- always including the last step, to t < 0 -- deterministic and never trained; evaluation uses eta 0.

Padding: the x0 prediction is zeroed at padded frames, so a final motion's padding is exactly 0, and each state's
padded frames hold what the forward process makes of zero data (the frames MDM was trained with); log-probs and KLs
average over the real frames only (element_mask), so a short motion's noise in padding counts for nothing.

Rewards (recam/domains/motion/rewards.py, generator-independent): motion_alignment (a retrieval evaluator's
caption/motion cosine) and motion_physics. Evaluation adds the field's protocol over the evaluated split
(R-precision top-1/2/3 in pools of 32, MM-Dist, FID, Diversity) in the embedding of a grader,
motion.metric_evaluator: a retrieval network trained apart from the reward's (by default another architecture, seed
and draw of the training data), because a policy optimised against one network can raise that network's scores
without becoming better; the papers that optimise a retrieval reward grade with a separate evaluator for this
reason. The same protocol in the reward's own network is reported beside it as reward_net/..., labelled as the
reward's.

Text: the generator's own text encoder, never the evaluator's text tower (the alignment reward would then share
weights with the policy's conditioning). For the tiny base it is a small word-level encoder (WordTextEncoder)
trained jointly with the model by scripts/pretrain/pretrain_motion_base.py and saved in the base folder; for MDM
checkpoints it is CLIP's text tower from a local folder, as MDM uses.

Config: the `motion` section of config/base.py; presets motion_tiny_cpu, motion_smoke, mdm_humanml3d_8npu.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from recam.domains.motion import evaluator as ev
from recam.domains.motion.features import features_to_joints
from recam.domains.motion.model import MotionDiffusionModel, from_mdm_layout, to_mdm_layout
from recam.domains.motion.rewards import finite_motions
from recam.domains.motion.skeleton import KINEMATIC_CHAINS, MAX_FRAMES, NUM_FEATURES
from recam.engine.containers import Batch
from recam.engine.domain import Splits, register_domain
from recam.engine.scheduler import DDIMScheduler
from recam.engine.sde import REDUCTIONS
from recam.infra.checkpoint import is_disk_full
from recam.infra.config_checks import ConfigError
from recam.infra.lora import adapter_disabled
from recam.infra.runlog import no_space
from rewards import MultiReward, build_rewards

DATA_SOURCES = ("synthetic", "humanml3d")
MODEL_FORMATS = ("base", "mdm")
TEXT_ENCODERS = ("base", "clip")
BASE_META = "motion_base.json"  # what a base folder was trained with (schedule, frame masking, text encoder)
TEXT_ENCODER_DIR = "text_encoder"
_TEXT_FORMAT = "recam.motion.word_text_encoder/1"


# ------------------------------------------------------------------------------------------------------------------
# The noise schedule


def cosine_alphas_cumprod(steps: int, max_beta: float = 0.999) -> torch.Tensor:
    """(steps,) float64 alpha-bar of the cosine schedule (Nichol & Dhariwal; MDM's "cosine"):
    beta_i = min(1 - f(i + 1) / f(i), max_beta), f(t) = cos((t / steps + 0.008) / 1.008 * pi / 2)^2."""
    t = torch.arange(steps + 1, dtype=torch.float64) / steps
    f = torch.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    betas = (1 - f[1:] / f[:-1]).clamp(max=max_beta)
    return torch.cumprod(1 - betas, dim=0)


# ------------------------------------------------------------------------------------------------------------------
# The tiny base's text encoder


@dataclass
class WordTextConfig:
    text_dim: int = 64
    word_dim: int = 64
    hidden: int = 64
    dropout: float = 0.1
    max_words: int = 32


class WordTextEncoder(nn.Module):
    """Captions -> (B, text_dim) for the generator: word embeddings, a bidirectional GRU and a small head (the
    architecture of the evaluator's text tower, with weights of its own, trained with the generator).

    Implements recam.domains.motion.model.TextEncoder: `encode` is frozen inference; `forward` keeps gradients for
    pretraining."""

    def __init__(self, vocab: ev.Vocabulary, config: WordTextConfig):
        super().__init__()
        self.vocab, self.settings = vocab, config
        self.text_dim = config.text_dim
        sizes = ev.EvaluatorConfig(vocab_size=len(vocab), word_dim=config.word_dim, text_hidden=config.hidden,
                                   embed_dim=config.text_dim, dropout=config.dropout, max_words=config.max_words)
        self.tower = ev.TextEncoder(sizes)

    @classmethod
    def from_captions(cls, captions, config: WordTextConfig | None = None) -> WordTextEncoder:
        return cls(ev.Vocabulary.build(captions), config or WordTextConfig())

    def forward(self, captions: Sequence[str]) -> torch.Tensor:
        ids, lengths = self.vocab.encode(list(captions), self.settings.max_words)
        device = self.tower.embedding.weight.device
        return self.tower(ids.to(device), lengths)

    @torch.no_grad()
    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        if isinstance(texts, str):
            raise TypeError("encode takes a list of captions, not a single string")
        was_training = self.training
        self.eval()
        try:
            return self(texts).float()
        finally:
            self.train(was_training)

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"format": _TEXT_FORMAT, **asdict(self.settings),
                                                        "words": self.vocab.words}, indent=1))
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()},
                  str(folder / "model.safetensors"))
        return folder

    @classmethod
    def load(cls, folder: str | Path, device: str | torch.device = "cpu") -> WordTextEncoder:
        folder = Path(folder)
        path = folder / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no word text encoder at {folder} (expected {path})")
        data = json.loads(path.read_text())
        if data.get("format") != _TEXT_FORMAT:
            raise ValueError(f"{path}: format {data.get('format')!r}, expected {_TEXT_FORMAT!r}")
        words = data.pop("words")
        data.pop("format")
        model = cls(ev.Vocabulary(words), WordTextConfig(**data))
        model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
        return model.to(device).eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------------------------
# Base folders (scripts/pretrain/pretrain_motion_base.py writes them; tests write untrained ones)


def save_base(folder: str | Path, model: MotionDiffusionModel, text_encoder: WordTextEncoder, meta: dict) -> Path:
    """model (config.json + diffusion_pytorch_model.safetensors), text_encoder/ and motion_base.json: the schedule
    and frame masking the model was trained with, which the domain checks against the run's config."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    text_encoder.save(folder / TEXT_ENCODER_DIR)
    required = {"diffusion_steps", "noise_schedule", "mask_frames", "prediction"}
    missing = sorted(required - set(meta))
    if missing:
        raise ValueError(f"base meta lacks {missing}")
    (folder / BASE_META).write_text(json.dumps(meta, indent=1) + "\n")
    return folder


def read_base_meta(folder: str | Path) -> dict:
    path = Path(folder) / BASE_META
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: motion.pretrained must be a folder written by "
                                "scripts/pretrain/pretrain_motion_base.py (motion.format='base')")
    return json.loads(path.read_text())


def no_dropout(model: nn.Module) -> nn.Module:
    """Dropout off for good: GRPO rescoring runs the policy in training mode, and the ratio of a sample to itself
    must be exactly 1, so the policy has to be deterministic in either mode."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        elif isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0
    return model


@contextlib.contextmanager
def one_attention_path(model: nn.Module):
    """Run the transformer layers on their training-mode kernels whatever mode the model is in.

    In eval mode without gradients PyTorch switches nn.TransformerEncoderLayer and nn.MultiheadAttention to fused
    kernels that round differently, so a sample drawn in eval mode would not score exactly its own log-prob when
    rescored with gradients (and the frozen reference would differ from the policy at step 0). With dropout at 0
    (no_dropout) the training-mode path is deterministic, so every call takes it."""
    layers = [m for m in model.modules() if isinstance(m, (nn.TransformerEncoderLayer, nn.MultiheadAttention))]
    modes = [m.training for m in layers]
    for m in layers:
        m.training = True
    try:
        yield
    finally:
        for m, mode in zip(layers, modes, strict=True):
            m.training = mode


def guided_x0(model, x: torch.Tensor, t: torch.Tensor, text_emb: torch.Tensor, scale: float,
              padding_mask: torch.Tensor | None) -> torch.Tensor:
    """MotionDiffusionModel.guided_forward (uncond + s (cond - uncond), both passes in one batch) through the module's
    own forward, so that a DDP-wrapped policy syncs its gradients; scale 1 is the conditional pass alone."""
    if scale == 1.0:
        return model(x, t, text_emb, padding_mask=padding_mask)
    b = x.shape[0]
    drop = torch.cat([torch.zeros(b, dtype=torch.bool), torch.ones(b, dtype=torch.bool)]).to(x.device)
    both = model(x.repeat(2, 1, 1, 1), t.repeat(2), text_emb.repeat(2, 1), drop_text=drop,
                 padding_mask=None if padding_mask is None else padding_mask.repeat(2, 1))
    cond, uncond = both[:b], both[b:]
    return uncond + scale * (cond - uncond)


# ------------------------------------------------------------------------------------------------------------------
# Data


class MotionSplit(Sequence):
    """A split of MotionWorld or HumanML3DDataset, all of it (n = 0) or n conditions evenly strided over it, with
    condition ids read without loading motions."""

    def __init__(self, dataset, n: int = 0):
        self.dataset = dataset
        total = len(dataset)
        n = total if n <= 0 or n >= total else n
        self.indices = [j * total // n for j in range(n)]
        self._ids = None

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.dataset[self.indices[i]]

    def condition_id(self, i: int) -> str:
        if self._ids is None:  # HumanML3D lists every id in one pass over its index (once: it rebuilds the list)
            self._ids = getattr(self.dataset, "condition_ids", None) or ()
        if not self._ids:  # the synthetic world builds (and keeps) the item
            return self.dataset[self.indices[i]].condition_id
        return self._ids[self.indices[i]]


@dataclass
class MotionInputs:
    """What a batch conditions on and is measured against. features: (b, 263, 1, 196) the reference motions,
    normalised, MDM layout (CPU); lengths (b,) CPU; padding_mask (b, 196) bool, True after the length (device);
    text_emb (b, text_dim) from the generator's text encoder (device)."""

    features: torch.Tensor
    lengths: torch.Tensor
    padding_mask: torch.Tensor
    text_emb: torch.Tensor
    captions: list


@dataclass
class MotionSamples:
    """What the motion rewards see: features (b, T, 263) in HumanML3D units, joints (b, T, 22, 3) in metres, both
    0 at or after each sample's length, and lengths (b,).

    Shaped like a batch tensor where the reward runner needs it (len, shape, detach, rows by index), so that
    rewards run on their thread, retry failed rows and merge them back as they do for videos."""

    features: torch.Tensor
    joints: torch.Tensor
    lengths: torch.Tensor

    def __len__(self) -> int:
        return self.features.shape[0]

    @property
    def shape(self) -> torch.Size:
        return self.features.shape

    def detach(self) -> MotionSamples:
        return MotionSamples(self.features.detach(), self.joints.detach(), self.lengths)

    def __getitem__(self, index) -> MotionSamples:
        return MotionSamples(self.features[index], self.joints[index], self.lengths[index])


def motion_samples(normalised: torch.Tensor, lengths: torch.Tensor, mean, std) -> MotionSamples:
    """Normalised features (b, T, 263) -> MotionSamples: de-normalised, joints by features_to_joints, cut at lengths."""
    x = normalised.detach().float().cpu()
    # copies: the world's statistics are read-only arrays, which torch will not wrap
    x = x * torch.tensor(np.array(std, dtype=np.float32)) + torch.tensor(np.array(mean, dtype=np.float32))
    lengths = torch.as_tensor(lengths).long().cpu()
    real = torch.arange(x.shape[1])[None, :] < lengths[:, None]
    zero = torch.zeros((), dtype=x.dtype)
    x = torch.where(real[:, :, None], x, zero)
    joints = torch.where(real[:, :, None, None], features_to_joints(x), zero)
    return MotionSamples(x, joints, lengths)


# ------------------------------------------------------------------------------------------------------------------
# Config checks


def check_config(config, conditions_per_batch: int, require) -> None:
    """The motion domain's checks (config/validate.py runs them for domain 'motion'): one line per problem, naming
    the field."""
    require("motion" in config, "domain='motion' needs the `motion` config section (config/base.py); start from a "
            "motion preset (--config config/grpo.py:motion_tiny_cpu)")
    m, d, s, e, mo = config.motion, config.data, config.sample, config.eval, config.model

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def is_num(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    weights = dict(config.reward.weights)
    report = [n.strip() for n in e.report_rewards.split(",") if n.strip()]
    scored = {k for k, w in weights.items() if w > 0} | set(report)
    for field in ("select_by", "select_guard"):
        require(e[field] == "" or e[field] in scored,
                f"eval.{field}={e[field]!r} must be '' or a motion reward scored at evaluation: {sorted(scored)}")
    require(d.source in DATA_SOURCES, f"data.source={d.source!r} unknown for the motion domain; use one of "
            f"{list(DATA_SOURCES)}")
    require(not e.select_by or d.num_val_conditions >= 1 or d.source == "humanml3d",
            f"eval.select_by={e.select_by!r} needs validation conditions: data.num_val_conditions must be >= 1, got "
            f"{d.num_val_conditions}")
    if d.source == "synthetic":
        require(d.num_train_conditions >= conditions_per_batch,
                f"data.num_train_conditions={d.num_train_conditions} is smaller than the {conditions_per_batch} "
                "unique conditions one sampling batch needs")
        require(d.num_heldout_conditions >= 2,
                f"data.num_heldout_conditions must be >= 2 (FID and diversity compare motions), got "
                f"{d.num_heldout_conditions}")
    else:
        require(isinstance(d.root, str) and d.root.strip() != "",
                "data.source='humanml3d' needs data.root, the HumanML3D folder (new_joint_vecs/, texts/, Mean.npy)")
        require(d.num_train_conditions == 0 or d.num_train_conditions >= conditions_per_batch,
                f"data.num_train_conditions={d.num_train_conditions} is smaller than the {conditions_per_batch} "
                "unique conditions one sampling batch needs (0 = every caption of the train split)")
        require(d.num_heldout_conditions != 1, "data.num_heldout_conditions must be 0 (all) or >= 2 (FID and "
                "diversity compare motions), got 1")
    require(m.format in MODEL_FORMATS, f"motion.format={m.format!r} unknown; use one of {list(MODEL_FORMATS)}")
    require(isinstance(m.pretrained, str) and m.pretrained.strip() != "",
            f"motion.pretrained must name the base folder (format 'base') or MDM checkpoint file ('mdm'), got "
            f"{m.pretrained!r}")
    require(isinstance(m.get("world_cache", ""), str), f"motion.world_cache must be a folder path or '' (no cache), "
            f"got {m.get('world_cache')!r}")
    require(isinstance(m.mdm_args, str), f"motion.mdm_args must be a string ('' = args.json beside the checkpoint), "
            f"got {m.mdm_args!r}")
    require(m.text_encoder in TEXT_ENCODERS,
            f"motion.text_encoder={m.text_encoder!r} unknown; use one of {list(TEXT_ENCODERS)}")
    require(m.format != "mdm" or m.text_encoder == "clip",
            "motion.format='mdm' needs motion.text_encoder='clip' (MDM was trained on CLIP text embeddings)")
    require(m.text_encoder != "clip" or (isinstance(m.clip_path, str) and m.clip_path.strip() != ""),
            "motion.text_encoder='clip' needs motion.clip_path, a local CLIP folder (nothing is downloaded)")
    for field in ("mask_frames", "mdm_use_ema"):
        require(isinstance(m[field], bool), f"motion.{field} must be True or False, got {m[field]!r}")
    require(is_int(s.num_steps) and s.num_steps >= 2,
            f"sample.num_steps must be >= 2 for the motion domain (the last DDIM step, to clean data, is "
            f"deterministic and never trained), got {s.num_steps!r}")
    require(is_int(m.diffusion_steps) and m.diffusion_steps >= max(s.num_steps, s.eval_num_steps),
            f"motion.diffusion_steps must be an integer >= sample.num_steps ({s.num_steps}) and "
            f"sample.eval_num_steps ({s.eval_num_steps}), got {m.diffusion_steps!r}")
    require(is_num(m.eta) and 0 < m.eta <= 1, f"motion.eta must be in (0, 1] (stochastic DDIM on the trained steps), "
            f"got {m.eta!r}")
    require(is_num(m.guidance_scale) and m.guidance_scale >= 0,
            f"motion.guidance_scale must be a finite number >= 0 (1 = no guidance), got {m.guidance_scale!r}")
    require(m.log_prob_reduction in REDUCTIONS,
            f"motion.log_prob_reduction={m.log_prob_reduction!r} unknown; use one of {list(REDUCTIONS)}")
    require(isinstance(m.metric_evaluator, str),
            f"motion.metric_evaluator must be a string ('' = motion.evaluator), got {m.metric_evaluator!r}")
    require(isinstance(m.evaluator, str) and (m.evaluator.strip() != "" or
                                              (not {"motion_alignment", "motion_retrieval"} & set(scored)
                                                   and m.metric_evaluator.strip() != "")),
            f"motion.evaluator must name a retrieval evaluator folder (scripts/pretrain/train_motion_evaluator.py): "
            f"motion_alignment and the evaluation metrics read it, got {m.evaluator!r}")
    require(is_int(m.eval_repetitions) and m.eval_repetitions >= 1,
            f"motion.eval_repetitions must be an integer >= 1, got {m.eval_repetitions!r}")
    require(is_num(m.retrieval_temperature) and m.retrieval_temperature > 0,
            f"motion.retrieval_temperature must be a finite number > 0, got {m.retrieval_temperature!r}")
    require(is_int(m.retrieval_negatives) and m.retrieval_negatives >= 2,
            f"motion.retrieval_negatives must be an integer >= 2 (training captions motion_retrieval compares "
            f"against), got {m.retrieval_negatives!r}")
    for field in ("physics_skating_scale", "physics_floating_scale", "physics_penetration_scale",
                  "physics_jitter_scale"):
        require(is_num(m[field]) and m[field] > 0, f"motion.{field} must be a finite number > 0, got {m[field]!r}")
    require(mo.lora_rank == 0 or mo.lora_targets.strip() != "",
            "model.lora_rank > 0 needs model.lora_targets naming the motion model's Linear layers (e.g. "
            "'linear1,linear2'); the default targets are the video transformer's attention projections")
    require(not mo.gradient_checkpointing, "model.gradient_checkpointing is not supported by the motion model; set "
            "it False")


def check_files(config) -> None:
    """Paths and the base's recorded training settings against the run's config, before anything is built."""

    def require(cond, msg):
        if not cond:
            raise ConfigError(msg)

    m, d = config.motion, config.data
    if d.source == "humanml3d":
        require(Path(d.root).is_dir(), f"data.root={d.root!r} is not a folder (data.source='humanml3d')")
    require(Path(m.pretrained).exists(), f"motion.pretrained={m.pretrained!r} does not exist (motion.format="
            f"{m.format!r})")
    if m.format == "base":
        folder = Path(m.pretrained)
        require((folder / "config.json").is_file() and (folder / BASE_META).is_file(),
                f"motion.pretrained={m.pretrained!r} is not a base folder (config.json and {BASE_META}, written by "
                "scripts/pretrain/pretrain_motion_base.py)")
        meta = read_base_meta(folder)
        require(meta.get("diffusion_steps") == m.diffusion_steps,
                f"motion.diffusion_steps={m.diffusion_steps} but the base in {m.pretrained!r} was trained with "
                f"{meta.get('diffusion_steps')} steps ({BASE_META})")
        require(meta.get("mask_frames") == m.mask_frames,
                f"motion.mask_frames={m.mask_frames} but the base in {m.pretrained!r} was trained with mask_frames="
                f"{meta.get('mask_frames')} ({BASE_META})")
        require(meta.get("noise_schedule") == "cosine" and meta.get("prediction") == "x0",
                f"the base in {m.pretrained!r} was trained with schedule {meta.get('noise_schedule')!r} and "
                f"prediction {meta.get('prediction')!r}; the motion domain samples a cosine schedule predicting x0")
        require(m.text_encoder != "base" or (folder / TEXT_ENCODER_DIR / "config.json").is_file(),
                f"motion.text_encoder='base' but {m.pretrained!r} has no {TEXT_ENCODER_DIR}/")
        if d.source == "synthetic":
            require(meta.get("data") in (None, "synthetic"),
                    f"the base in {m.pretrained!r} was trained on {meta.get('data')!r} data, the run uses the "
                    "synthetic world (normalisations differ)")
    if m.text_encoder == "clip":
        require(Path(m.clip_path).is_dir(), f"motion.clip_path={m.clip_path!r} is not a folder")
    for field in ("evaluator", "metric_evaluator"):
        if m[field]:
            require((Path(m[field]) / ev.CONFIG_FILE).is_file(),
                    f"motion.{field}={m[field]!r} holds no {ev.CONFIG_FILE} (train one with "
                    "scripts/pretrain/train_motion_evaluator.py)")
            # an evaluator reads raw features with its training data's normalisation and words: on the other
            # source its numbers would look plausible and mean nothing
            trained_on = _evaluator_data(Path(m[field]))
            require(trained_on is None or trained_on.split(":")[0] == d.source,
                    f"motion.{field}={m[field]!r} was trained on {trained_on!r} data (its provenance.json), the run "
                    f"uses data.source={d.source!r}; train one on this data with "
                    "scripts/pretrain/train_motion_evaluator.py")


def _evaluator_data(folder: Path) -> str | None:
    """The data an evaluator folder was trained on ("synthetic" or "humanml3d:<root>"), from the provenance.json
    scripts/pretrain/train_motion_evaluator.py writes; None without one."""
    try:
        data = json.loads((folder / "provenance.json").read_text()).get("data")
    except (OSError, ValueError, AttributeError):
        return None
    return data if isinstance(data, str) else None


# ------------------------------------------------------------------------------------------------------------------
# The domain


REWARD_NET = "reward_net/"  # prefix of the protocol metrics measured in the reward's own network


def same_network(a: nn.Module, b: nn.Module) -> bool:
    """Whether two evaluators compute the same function: one object, or the same configuration and equal tensors
    (a copy of the reward's folder under another name is still the reward's network)."""
    if a is b:
        return True
    if getattr(a, "config", None) != getattr(b, "config", None):
        return False
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


@register_domain("motion")
class MotionDomain:
    sample_kind = "motion"  # what decode returns (MotionSamples), and so which registered rewards can score it
    examples_dir = "motions"
    check_config = staticmethod(check_config)
    check_files = staticmethod(check_files)

    def __init__(self, config, device, log):
        self.config, self.device, self.log = config, device, log
        self._splits = None
        self._text_encoder = None
        self._built_rewards: dict = {}
        self._metric_evaluator = None
        self._reward_evaluator = None
        self._grader_is_reward_net = False
        self._small_pool_noted = False

    @property
    def summary_rows(self) -> tuple[tuple[str, str], ...]:
        """The summary's rows, labelled with what measured them: which network graded (the independent grader, or
        the reward's own network when motion.metric_evaluator names it), and a pool smaller than T2M's 32 by its
        size, since such an R-precision cannot be compared with published ones."""
        heldout = len(self._splits.heldout) if self._splits is not None else None
        pool = ev.R_PRECISION_POOL if heldout is None else min(ev.R_PRECISION_POOL, heldout)
        rp = "R-precision" if pool == ev.R_PRECISION_POOL else f"R-precision in one pool of {pool}, not 32,"
        self.metric_evaluator()  # which network grades decides the labels
        by = "reward's own network, not independent" if self._grader_is_reward_net else "grader"
        own = "reward's own network"
        return ((f"{rp} top-1 ({by})", "eval/r_precision_top1"), (f"{rp} top-3 ({by})", "eval/r_precision_top3"),
                (f"MM-Dist ({by})", "eval/mm_dist"), (f"FID ({by})", "eval/fid"),
                (f"diversity ({by})", "eval/diversity"), ("R-precision pool size", "eval/r_precision_pool"),
                (f"{rp} top-1 ({own})", f"eval/{REWARD_NET}r_precision_top1"),
                (f"{rp} top-3 ({own})", f"eval/{REWARD_NET}r_precision_top3"),
                (f"MM-Dist ({own})", f"eval/{REWARD_NET}mm_dist"), (f"FID ({own})", f"eval/{REWARD_NET}fid"),
                ("alignment (reward network's cosine in [0, 1])", "eval/motion_alignment"),
                ("retrieval probability (reward network, pool of 32)", "eval/motion_retrieval"),
                ("physics", "eval/motion_physics"), ("foot skating ratio", "eval/skating"),
                ("jitter (m/s^3)", "eval/jitter"))

    def _info(self, msg: str) -> None:
        """A setup detail, for the run's log file."""
        if self.log is not None:
            self.log.detail(msg)

    def _note(self, msg: str) -> None:
        """Something the user should see on the console."""
        if self.log is not None:
            self.log.info(msg)

    # ---- data ----
    def datasets(self) -> Splits:
        if self._splits is not None:
            return self._splits
        d, select = self.config.data, bool(self.config.eval.select_by)
        if d.source == "synthetic":
            from recam.domains.motion.world import MotionWorld

            def world(split, n):
                return MotionSplit(MotionWorld(split, n, d.seed, cache_dir=self.config.motion.get("world_cache")))
            self._splits = Splits(world("train", d.num_train_conditions), world("held_out", d.num_heldout_conditions),
                                  world("validation", d.num_val_conditions) if select else None)
            self.mean, self.std = self._splits.train.dataset.mean, self._splits.train.dataset.std
        else:
            from recam.domains.motion.humanml3d import HumanML3DDataset

            def real(split, n):
                return MotionSplit(HumanML3DDataset(d.root, split), n)
            # T2M's protocol measures on the test split; val chooses the reported checkpoint
            self._splits = Splits(real("train", d.num_train_conditions), real("test", d.num_heldout_conditions),
                                  real("val", d.num_val_conditions) if select else None)
            self.mean, self.std = self._splits.train.dataset.mean, self._splits.train.dataset.std
        return self._splits

    def condition_id(self, dataset, i: int) -> str:
        return dataset.condition_id(i)

    def principal_channels(self, n: int, max_motions: int = 256) -> torch.Tensor:
        """(263, n) float32 orthonormal: the n leading eigenvectors of the normalised features' second moment over
        the real frames of (up to max_motions, evenly strided) training motions: the directions a frame of this
        data varies in, most first (sample.noise_channels)."""
        train = self.datasets().train
        if not 1 <= n <= NUM_FEATURES:
            raise ValueError(f"sample.noise_channels must be in [1, {NUM_FEATURES}], got {n!r}")
        picks = range(0, len(train), max(1, len(train) // max_motions))
        frames = [torch.as_tensor(np.asarray(train[i].features)[:int(train[i].length)], dtype=torch.float64)
                  for i in picks]
        rows = torch.cat(frames)
        _, vectors = torch.linalg.eigh(rows.T @ rows / rows.shape[0])
        return vectors.flip(1)[:, :n].float()

    def collate(self, dataset, indices, cache=None) -> Batch:
        items = [dataset[int(i)] for i in indices]
        features = torch.stack([torch.as_tensor(np.asarray(it.features), dtype=torch.float32) for it in items])
        lengths = torch.tensor([int(it.length) for it in items], dtype=torch.long)
        padding = torch.arange(features.shape[1])[None, :] >= lengths[:, None]
        captions = [it.caption for it in items]
        inputs = MotionInputs(to_mdm_layout(features), lengths, padding.to(self.device),
                              self.text_embeddings(captions, cache), captions)
        return Batch(torch.as_tensor([int(i) for i in indices]), items, inputs)

    def text_embeddings(self, captions: list[str], cache: dict | None) -> torch.Tensor:
        """(b, text_dim) on the device. Each caption is encoded on its own: in a batch its padding would change the
        rounding, and a sample must be rescored with exactly the conditioning it was drawn with whatever batch it
        lands in. With the epoch's `cache`, a caption is encoded once per epoch."""
        store = {} if cache is None else cache.setdefault("motion_text", {})
        for caption in dict.fromkeys(captions):
            if caption not in store:
                store[caption] = self.text_encoder().encode([caption])[0].float()
        return torch.stack([store[c] for c in captions]).to(self.device)

    def text_encoder(self):
        """The generator's text encoder, frozen (built on first use)."""
        if self._text_encoder is None:
            m = self.config.motion
            if m.text_encoder == "base":
                self._text_encoder = WordTextEncoder.load(Path(m.pretrained) / TEXT_ENCODER_DIR, self.device)
            else:
                from recam.domains.motion.model import CLIPTextEncoder

                self._text_encoder = CLIPTextEncoder.from_folder(m.clip_path, device=self.device)
            self._info(f"motion text encoder: {m.text_encoder} ({self._text_encoder.text_dim}-d)")
        return self._text_encoder

    # ---- model ----
    def build_policy(self) -> nn.Module:
        m = self.config.motion
        if m.format == "base":
            model = MotionDiffusionModel.from_pretrained(m.pretrained)
            self._info(f"motion base: {m.pretrained} ({sum(p.numel() for p in model.parameters()):,} parameters)")
        else:
            from recam.domains.motion.loading import load_mdm_checkpoint

            model, report = load_mdm_checkpoint(m.pretrained, m.mdm_args or None, use_ema=m.mdm_use_ema)
            self._info(report.summary())
            if report.trained_with_frame_mask != m.mask_frames:
                self._note(f"note: motion.mask_frames={m.mask_frames} but the checkpoint was trained with "
                           f"mask_frames={report.trained_with_frame_mask}")
        text_dim = self.text_encoder().text_dim
        if model.config.text_dim != text_dim:
            raise ValueError(f"motion.pretrained={m.pretrained!r} takes {model.config.text_dim}-d text embeddings, "
                             f"motion.text_encoder={m.text_encoder!r} gives {text_dim}-d")
        return no_dropout(model.float().eval())

    def sample_shape(self) -> tuple[int, ...]:
        return (NUM_FEATURES, 1, MAX_FRAMES)

    def scheduler(self, device) -> DDIMScheduler:
        from recam.engine.plan import num_train_timesteps

        s, m = self.config.sample, self.config.motion
        return DDIMScheduler(cosine_alphas_cumprod(m.diffusion_steps), s.num_steps, m.eta, "sample",
                             num_train_timesteps(s.num_steps, self.config.train.timestep_fraction), device,
                             reduction=m.log_prob_reduction)

    def denoiser(self, model, batch: Batch, autocast, adapter_off: bool = False):
        inputs, m = batch.inputs, self.config.motion
        attention_mask = inputs.padding_mask if m.mask_frames else None
        real = (~inputs.padding_mask)[:, None, None, :]

        def predict(x, t):
            with autocast(), (adapter_disabled(model) if adapter_off else contextlib.nullcontext()), \
                    one_attention_path(model):
                out = guided_x0(model, x, t, inputs.text_emb, m.guidance_scale, attention_mask).float()
            # padded frames predicted as zero data: they never carry motion into the final sample. Contiguous: the
            # model returns a permuted view, and a transition computed in that layout sums its log-prob in another
            # order than the rescoring of the stored (contiguous) states, which would move the ratio off exactly 1.
            return torch.where(real, out, torch.zeros((), dtype=out.dtype, device=out.device)).contiguous()
        return predict

    def element_mask(self, batch: Batch) -> torch.Tensor:
        """(b, 1, 1, 196) bool: the real frames, the only elements log-probs and KLs average over."""
        return (~batch.inputs.padding_mask)[:, None, None, :]

    def decode(self, samples: torch.Tensor) -> MotionSamples:
        """Without a batch every frame counts as real; the trainer decodes with decode_batch."""
        self.datasets()
        full = torch.full((samples.shape[0],), samples.shape[-1], dtype=torch.long)
        return motion_samples(from_mdm_layout(samples), full, self.mean, self.std)

    def decode_batch(self, samples: torch.Tensor, batch: Batch) -> MotionSamples:
        self.datasets()
        return motion_samples(from_mdm_layout(samples), batch.inputs.lengths, self.mean, self.std)

    def references(self, batch: Batch) -> dict[str, MotionSamples]:
        """The conditions' ground-truth motions, decoded like samples: the rewards' and metrics' ceiling; and, in a
        batch of two or more, each condition given the next condition's ground truth ("shuffled": real motion under
        the wrong caption), the floor of what reads the caption (alignment, R-precision) where physics stays real."""
        self.datasets()
        features, lengths = batch.inputs.features, batch.inputs.lengths
        out = {"target": motion_samples(from_mdm_layout(features), lengths, self.mean, self.std)}
        if len(lengths) > 1:
            out["shuffled"] = motion_samples(from_mdm_layout(features.roll(-1, 0)), lengths.roll(-1, 0), self.mean,
                                             self.std)
        return out

    # ---- rewards, metrics, hooks, examples ----
    def reward_fn(self, weights, report=()):
        used = [*(n for n, w in weights.items() if w > 0), *report]
        return MultiReward(weights, report=report, rewards=self._rewards(used))

    def _rewards(self, names) -> dict:
        """Reward objects by name, built once per run and shared by training and evaluation (one evaluator)."""
        names = list(dict.fromkeys(names))
        new = build_rewards([n for n in names if n not in self._built_rewards], self.config, self.device)
        for name, reward in new.items():
            if hasattr(reward, "set_negative_captions"):
                reward.set_negative_captions(self.negative_captions(self.config.motion.retrieval_negatives))
            self._info(f"{name}: {reward.describe()}")
        self._built_rewards.update(new)
        return {n: self._built_rewards[n] for n in names}

    def negative_captions(self, n: int) -> list[str]:
        """Captions of n training conditions evenly strided over the training split (retrieval negatives: never
        held-out or validation text)."""
        train = self.datasets().train
        step = max(1, len(train) // max(1, n))
        return [train[i].caption for i in range(0, len(train), step)][:n]

    def reward_evaluator(self) -> ev.TextMotionEvaluator | None:
        """The network motion_alignment and motion_retrieval score with (motion.evaluator): the rewards' own object
        once they are built; None when the run names none."""
        if self._reward_evaluator is None:
            m = self.config.motion
            shared = self._built_rewards.get("motion_alignment") or self._built_rewards.get("motion_retrieval")
            if shared is not None:
                self._reward_evaluator = shared.evaluator
            elif m.evaluator:
                self._reward_evaluator = ev.TextMotionEvaluator.load(m.evaluator).requires_grad_(False)
        return self._reward_evaluator

    def metric_evaluator(self) -> ev.TextMotionEvaluator:
        """The grader of the protocol metrics: motion.metric_evaluator, or ('') the reward's own network, which is
        then labelled as such in the metrics (grader_is_reward_net) and the summary."""
        if self._metric_evaluator is None:
            m = self.config.motion
            reward_net = self.reward_evaluator()
            if m.metric_evaluator:
                grader = ev.TextMotionEvaluator.load(m.metric_evaluator).requires_grad_(False)
            else:
                grader = reward_net
            self._grader_is_reward_net = reward_net is not None and same_network(grader, reward_net)
            if self._grader_is_reward_net:
                grader = reward_net  # one copy of the network
                self._note(f"motion metrics are graded by the reward's own network (motion.metric_evaluator="
                           f"{m.metric_evaluator!r}, motion.evaluator={m.evaluator!r}): R-precision, MM-Dist and FID "
                           "share weights with motion_alignment; the summary labels them so")
            else:
                self._info(f"motion metrics graded by {m.metric_evaluator} ({grader.config.architecture}); the "
                           f"reward's network {m.evaluator or '(none)'} is reported beside it as {REWARD_NET}...")
            self._metric_evaluator = grader
        return self._metric_evaluator

    def _protocol_networks(self) -> dict[str, ev.TextMotionEvaluator]:
        """{metric prefix: network}: the grader unprefixed, and the reward's network under REWARD_NET when it is
        another network."""
        nets = {"": self.metric_evaluator()}
        reward_net = self.reward_evaluator()
        if reward_net is not None and not self._grader_is_reward_net:
            nets[REWARD_NET] = reward_net
        return nets

    @torch.no_grad()
    def evaluation_items(self, decoded: MotionSamples, batch: Batch) -> list[dict]:
        """Per condition: its caption's, its motion's and its reference motion's embeddings (numpy float32) in the
        grader (text, motion, real) and in the reward's network (reward_net/text, ...), and whether the motion is
        finite."""
        reference = self.references(batch)["target"]
        finite = finite_motions(decoded.features, decoded.lengths)
        features = torch.where(finite[:, None, None], decoded.features, torch.zeros(()))
        items = [{"finite": bool(f)} for f in finite]
        for prefix, net in self._protocol_networks().items():
            embeddings = {"text": net.encode_text(batch.inputs.captions),
                          "motion": net.encode_motion(features, decoded.lengths),
                          "real": net.encode_motion(reference.features, reference.lengths)}
            for key, emb in embeddings.items():
                emb = emb.cpu().numpy()
                for i, item in enumerate(items):
                    item[prefix + key] = emb[i]
        return items

    def evaluation_metrics(self, items: list[dict]) -> dict[str, float]:
        """The T2M protocol over the split, in the grader and (prefixed reward_net/) in the reward's own network:
        R-precision top-1/2/3 in pools of 32, MM-Dist, FID against the split's reference motions, Diversity over
        min(300, n) pairs; means over motion.eval_repetitions shuffles from eval.seed, the same shuffles, hence the
        same pools, for both networks, so two evaluations of the same weights agree. With fewer than 32 finite
        motions R-precision is measured in one pool of all of them, whose size r_precision_pool reports (a smaller
        pool is an easier test, not T2M's). Non-finite motions are left out and counted. rows/r_precision_top3: each
        condition's top-3 hit rate over the shuffles, in the items' order."""
        kept = [it for it in items if it["finite"]]
        out = {"nonfinite_motions": float(len(items) - len(kept))}
        if len(kept) < 2:
            return out
        pool = min(ev.R_PRECISION_POOL, len(kept))
        if pool < ev.R_PRECISION_POOL and not self._small_pool_noted:
            self._small_pool_noted = True
            self._note(f"R-precision is measured in one pool of {pool} motions, not T2M's 32 (fewer finite motions "
                       "than 32): it is not comparable with published R-precision")
        for prefix in [p for p in ("", REWARD_NET) if f"{p}text" in kept[0]]:
            text, motion, real = (np.stack([it[prefix + k] for it in kept]).astype(np.float64)
                                  for k in ("text", "motion", "real"))
            rng = np.random.default_rng(self.config.eval.seed)
            reps = [ev.protocol_repetition(text, motion, real, rng, pool_size=pool,
                                           diversity_pairs=min(ev.DIVERSITY_PAIRS, len(kept)))
                    for _ in range(self.config.motion.eval_repetitions)]
            out.update({prefix + k: v[0] for k, v in ev.summarize_repetitions(reps).items()})
            # per condition (None: a non-finite motion, left out), so two evaluations pair condition by condition
            rate = iter(ev.per_pair_rate(reps))
            out[f"rows/{prefix}r_precision_top3"] = [float(next(rate)) if it["finite"] else None for it in items]
        out["r_precision_pool"] = float(pool)
        self.metric_evaluator()  # sets whether the grader is the reward's network
        out["grader_is_reward_net"] = float(self._grader_is_reward_net)
        return out

    def hooks(self) -> list:
        return []

    def write_examples(self, out_dir: Path, batch: Batch, decoded: MotionSamples, n: int) -> None:
        """One GIF per condition for the first n: the reference motion beside the generated one, as stick figures
        (every other frame, oblique orthographic view), captioned."""
        reference = self.references(batch)["target"]
        out_dir.mkdir(parents=True, exist_ok=True)
        for i in range(min(n, len(decoded))):
            length = int(decoded.lengths[i])
            name = batch.conditions[i].condition_id.replace("/", "_").replace(":", "_")
            stick_figure_gif(out_dir / f"{name}.gif", [reference.joints[i, :length], decoded.joints[i, :length]],
                             ["reference", "generated"], batch.inputs.captions[i])


def _project(joints: torch.Tensor, azimuth_deg: float = 35.0) -> tuple[np.ndarray, np.ndarray]:
    """Oblique orthographic view: horizontal = x and z mixed (the body's side and forward motion both show), y up."""
    a = math.radians(azimuth_deg)
    j = joints.detach().double().cpu().numpy()
    return -j[..., 0] * math.cos(a) + j[..., 2] * math.sin(a), j[..., 1]


def stick_figure_gif(path: Path, motions: list[torch.Tensor], titles: list[str], caption: str, step: int = 2,
                     fps: float = 10.0) -> Path:
    """Stick figures of (T, 22, 3) motions side by side, one panel each, as an animated GIF; a non-finite motion
    is drawn clamped (NaN at 0), never skipped."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt
    from matplotlib.animation import FuncAnimation, PillowWriter

    # non-finite or runaway joints are clamped for drawing only: the panel stays readable and the GIF is written
    views = [_project(torch.nan_to_num(j.float(), nan=0.0).clamp(-10.0, 10.0)) for j in motions]
    frames = max(1, max(h.shape[0] for h, _ in views))
    # one scale for every panel, so a generated motion is read against its reference
    width = max(float(np.ptp(h)) if h.size else 1.0 for h, _ in views) + 0.6
    top = max(max(float(v.max()) if v.size else 0.0 for _, v in views) + 0.2, 2.0)
    fig, axes = plt.subplots(1, len(views), figsize=(2.6 * len(views), 3.0), dpi=64)
    axes = np.atleast_1d(axes)
    lines = []
    for ax, (h, _), title in zip(axes, views, titles, strict=True):
        centre = 0.5 * (float(h.min()) + float(h.max())) if h.size else 0.0
        ax.set(xlim=(centre - width / 2, centre + width / 2), ylim=(-0.1, top), aspect="equal", xticks=[], yticks=[])
        ax.set_title(title, fontsize=8)
        ax.axhline(0.0, color="0.6", lw=0.8)
        lines.append([ax.plot([], [], lw=2, color=f"C{c}")[0] for c in range(len(KINEMATIC_CHAINS))])
    fig.suptitle(caption if len(caption) <= 70 else caption[:67] + "...", fontsize=8)
    fig.subplots_adjust(top=0.84, bottom=0.02, left=0.02, right=0.98, wspace=0.05)

    def draw(t):
        for (h, v), chain_lines in zip(views, lines, strict=True):
            f = min(t * step, h.shape[0] - 1)
            for line, chain in zip(chain_lines, KINEMATIC_CHAINS, strict=True):
                if f >= 0:
                    line.set_data(h[f, list(chain)], v[f, list(chain)])
        return [line for chain_lines in lines for line in chain_lines]

    animation = FuncAnimation(fig, draw, frames=math.ceil(frames / step), blit=False)
    # written beside it and renamed over it (the name keeps .gif: Pillow picks the format by it), so a full disk
    # leaves no half-written GIF
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        animation.save(str(tmp), writer=PillowWriter(fps=fps))
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if is_disk_full(e):
            raise no_space(path, e) from e
        raise
    finally:
        plt.close(fig)
    return path
