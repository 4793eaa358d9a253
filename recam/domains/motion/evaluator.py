"""Text/motion retrieval: a small contrastive evaluator, the T2M evaluation protocol, and a loader for the original
T2M evaluator checkpoint.

Three parts:

1. `TextMotionEvaluator` plays, on our data, the role the T2M evaluator (Guo et al. 2022) and TMR play on HumanML3D:
   a word-level text encoder and a motion encoder over HumanML3D features (foot contacts dropped as T2M does) map
   into one embedding space, trained with a symmetric InfoNCE loss. Two architectures (EvaluatorConfig.architecture):
   "gru", T2M's layout (text: embedding + bidirectional GRU; motion: two stride-2 temporal convolutions +
   bidirectional GRU), and "transformer" (each tower a pre-norm transformer encoder, mean-pooled over the real words
   or frames), so that the network that grades a policy can differ in kind, not only in weights, from the one that
   rewards it. Training is a loop over batches of (captions, features, lengths) calling
   `contrastive_loss(model, captions, features, lengths)`. Small enough to train on CPU in minutes.

2. The T2M protocol as pure functions of embeddings: R-precision over pools of 32 pairs, MM-Dist, FID, Diversity,
   repeated with mean and 95% interval. Numbers are only comparable with published ones when the embeddings come
   from the original T2M evaluator; with our evaluator they measure the same things on a different scale.

3. `load_t2m_evaluator`: the original evaluator (text_mot_match/model/finest.tar). Its layout, established from
   the public text-to-motion code that every HumanML3D benchmark loads it with, is documented on the loader.
"""

from __future__ import annotations

import json
import math
import pickle
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import scipy.linalg
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from recam.domains.motion.skeleton import NUM_FEATURES

PAD, UNK = "<pad>", "<unk>"
CONTACT_FEATURES = 4  # the last 4 of the 263 features are foot contacts, which T2M's evaluator does not read
UNIT_LENGTH = 4  # frames per motion-encoder step: two stride-2 convolutions

CONFIG_FILE = "evaluator.json"
VOCAB_FILE = "vocab.json"
WEIGHTS_FILE = "evaluator.safetensors"
_FORMAT = "recam.motion.evaluator/1"
ARCHITECTURES = ("gru", "transformer")


# ================================================================================================================
# Vocabulary


def tokenize(caption: str) -> list[str]:
    """Lower-cased words of a caption; punctuation separates words and is dropped (so "walks," is "walks")."""
    return re.findall(r"[a-z0-9]+(?:'[a-z]+)?", caption.lower())


class Vocabulary:
    """Words seen in training captions; index 0 is <pad>, 1 is <unk> (every unseen word)."""

    def __init__(self, words: Sequence[str]):
        words = list(words)
        if words[:2] != [PAD, UNK]:
            raise ValueError(f"a vocabulary starts with {PAD!r}, {UNK!r}; got {words[:2]}")
        if len(set(words)) != len(words):
            raise ValueError("a vocabulary cannot hold a word twice")
        self.words = words
        self.index = {w: i for i, w in enumerate(words)}

    @classmethod
    def build(cls, captions: Iterable[str], min_count: int = 1, max_size: int | None = None) -> Vocabulary:
        """Words occurring at least min_count times, most frequent first (ties alphabetical, so the same captions
        always give the same indices); max_size caps the total including <pad> and <unk>."""
        counts = Counter(w for caption in captions for w in tokenize(caption))
        kept = sorted(
            (w for w, c in counts.items() if c >= min_count and w not in (PAD, UNK)), key=lambda w: (-counts[w], w)
        )
        if max_size is not None:
            kept = kept[: max(max_size - 2, 0)]
        return cls([PAD, UNK, *kept])

    def __len__(self) -> int:
        return len(self.words)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def unk_id(self) -> int:
        return 1

    def ids(self, caption: str) -> list[int]:
        return [self.index.get(w, self.unk_id) for w in tokenize(caption)]

    def encode(self, captions: Sequence[str], max_words: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (B, L) long padded with <pad>, lengths (B,)). A caption without any word becomes a single <unk>,
        because a recurrent encoder needs at least one step."""
        rows = [self.ids(c)[:max_words] if max_words else self.ids(c) for c in captions]
        rows = [r if r else [self.unk_id] for r in rows]
        width = max((len(r) for r in rows), default=1)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        return ids, torch.tensor([len(r) for r in rows], dtype=torch.long)

    def to_json(self) -> dict:
        return {"words": self.words}

    @classmethod
    def from_json(cls, data: Mapping) -> Vocabulary:
        return cls(data["words"])


# ================================================================================================================
# Our evaluator


@dataclass
class EvaluatorConfig:
    """Architecture and sizes of TextMotionEvaluator. "gru": embed_dim 512 with text_hidden 512 and motion_hidden 1024
    mirrors T2M; the defaults are a CPU-sized model. "transformer": word_dim and motion_channels are the widths of
    the text and motion encoders, text_hidden and motion_hidden those of their heads."""

    vocab_size: int
    word_dim: int = 128
    text_hidden: int = 128
    feature_dim: int = NUM_FEATURES
    drop_contacts: bool = True
    motion_channels: int = 128
    motion_hidden: int = 128
    embed_dim: int = 128
    dropout: float = 0.1
    temperature: float = 0.1
    max_words: int = 32
    normalize: bool = True  # L2-normalised embeddings: Euclidean distances are then monotone in cosine similarity
    # Folders saved before this field existed hold GRU weights, so a missing field reads as "gru".
    architecture: str = "gru"
    layers: int = 2  # transformer: encoder layers per tower
    heads: int = 4  # transformer: attention heads; divides word_dim and motion_channels
    patch_frames: int = 4  # transformer: consecutive frames per motion token (one per frame costs 5x the time)

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r} unknown; use one of {list(ARCHITECTURES)}")
        if self.architecture == "transformer":
            for name in ("layers", "heads", "patch_frames"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            for name in ("word_dim", "motion_channels"):
                if getattr(self, name) % self.heads:
                    raise ValueError(f"{name}={getattr(self, name)} is not divisible by heads={self.heads}")

    @property
    def motion_inputs(self) -> int:
        return self.feature_dim - (CONTACT_FEATURES if self.drop_contacts else 0)


def _head(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.LayerNorm(hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, outputs))


def _last_states(gru: nn.GRU, inputs: torch.Tensor, lengths: torch.Tensor, h0: torch.Tensor | None = None):
    """Concatenated final states (B, 2H) of a bidirectional GRU over the first lengths[b] steps of each row: packing
    makes the backward direction start at a row's last valid step instead of its padding."""
    packed = pack_padded_sequence(inputs, lengths.cpu().long(), batch_first=True, enforce_sorted=False)
    _, last = gru(packed, h0)
    return torch.cat([last[0], last[1]], dim=-1)


class TextEncoder(nn.Module):
    def __init__(self, config: EvaluatorConfig):
        super().__init__()
        self.embedding = nn.Embedding(config.vocab_size, config.word_dim, padding_idx=0)
        self.dropout = nn.Dropout(config.dropout)
        self.gru = nn.GRU(config.word_dim, config.text_hidden, batch_first=True, bidirectional=True)
        self.head = _head(2 * config.text_hidden, config.text_hidden, config.embed_dim)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.head(_last_states(self.gru, self.dropout(self.embedding(ids)), lengths))


def _zero_after(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """x (B, T, C) with the steps t >= lengths[b] set to 0."""
    keep = torch.arange(x.shape[1], device=x.device)[None, :] < lengths.to(x.device)[:, None]
    # where, not a multiply: NaN or inf in the padding times 0 would still reach the embedding
    return torch.where(keep[:, :, None], x, torch.zeros((), dtype=x.dtype, device=x.device))


class MotionEncoder(nn.Module):
    """Features (B, T, F) -> (B, D). Padding is zeroed before each convolution, so a clip's embedding is the same
    whatever its padding holds and however much of it there is."""

    def __init__(self, config: EvaluatorConfig):
        super().__init__()
        self.inputs = config.motion_inputs
        c = config.motion_channels
        self.conv1 = nn.Conv1d(self.inputs, c, kernel_size=4, stride=2, padding=1)
        self.conv2 = nn.Conv1d(c, c, kernel_size=4, stride=2, padding=1)
        self.dropout = nn.Dropout(config.dropout)
        self.gru = nn.GRU(c, config.motion_hidden, batch_first=True, bidirectional=True)
        self.head = _head(2 * config.motion_hidden, config.motion_hidden, config.embed_dim)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = _zero_after(features[..., : self.inputs], lengths)
        # A stride-2 convolution with kernel 4 and padding 1 maps n frames to n // 2, so the valid prefix of each
        # layer's output is lengths // 2, then lengths // 4; beyond it stand the zeros an unpadded clip would see.
        x = F.leaky_relu(self.conv1(x.transpose(1, 2)), 0.2).transpose(1, 2)
        x = _zero_after(x, lengths // 2)
        x = F.leaky_relu(self.conv2(x.transpose(1, 2)), 0.2).transpose(1, 2)
        x = self.dropout(_zero_after(x, lengths // UNIT_LENGTH))
        return self.head(_last_states(self.gru, x, lengths // UNIT_LENGTH))


def _transformer(width: int, config: EvaluatorConfig) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(width, config.heads, dim_feedforward=2 * width, dropout=config.dropout,
                                       activation="gelu", batch_first=True, norm_first=True)
    # no nested tensors: eval and training then run the same masked computation
    return nn.TransformerEncoder(layer, config.layers, norm=nn.LayerNorm(width), enable_nested_tensor=False)


def _real(lengths: torch.Tensor, steps: int, device) -> torch.Tensor:
    """(B, steps) bool: True at the first lengths[b] steps."""
    return torch.arange(steps, device=device)[None, :] < lengths.to(device)[:, None]


def _mean_over(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Mean of x (B, T, C) over the steps where real (B, T) holds; where, not a product, so padding never counts."""
    kept = torch.where(real[:, :, None], x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum(1) / real.sum(1, keepdim=True).to(x.dtype)


def _sinusoid(steps: int, width: int, device) -> torch.Tensor:
    """(steps, width) fixed sinusoidal positions: defined for any clip length, so a motion longer than any seen in
    training still has positions."""
    pos = torch.arange(steps, dtype=torch.float32, device=device)[:, None]
    freq = torch.exp(torch.arange(0, width, 2, dtype=torch.float32, device=device) * (-math.log(10000.0) / width))
    out = torch.zeros(steps, width, device=device)
    out[:, 0::2] = torch.sin(pos * freq)
    out[:, 1::2] = torch.cos(pos * freq)[:, : width // 2]
    return out


class TransformerTextEncoder(nn.Module):
    """ids (B, L) -> (B, D): word embeddings plus learnt positions, a transformer encoder that attends to the real
    words only, the mean over those words, and a head."""

    def __init__(self, config: EvaluatorConfig):
        super().__init__()
        self.embedding = nn.Embedding(config.vocab_size, config.word_dim, padding_idx=0)
        self.position = nn.Embedding(config.max_words, config.word_dim)
        self.dropout = nn.Dropout(config.dropout)
        self.encoder = _transformer(config.word_dim, config)
        self.head = _head(config.word_dim, config.text_hidden, config.embed_dim)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        real = _real(lengths, ids.shape[1], ids.device)
        x = self.embedding(ids) + self.position(torch.arange(ids.shape[1], device=ids.device))[None]
        x = self.encoder(self.dropout(x), src_key_padding_mask=~real)
        return self.head(_mean_over(x, real))


class TransformerMotionEncoder(nn.Module):
    """Features (B, T, F) -> (B, D): one token per patch_frames consecutive frames (a linear map of their features
    plus a sinusoidal position), a transformer encoder whose attention never reaches a token without a real frame,
    the mean over those tokens, and a head. Padding is zeroed before anything reads it, and a clip is padded to
    whole patches with zeros, so a clip's embedding does not depend on what its padding holds or how long it is;
    a last patch that is partly padding reads the zeros an unpadded clip would."""

    def __init__(self, config: EvaluatorConfig):
        super().__init__()
        self.inputs, self.patch = config.motion_inputs, config.patch_frames
        self.frames = nn.Linear(self.patch * self.inputs, config.motion_channels)
        self.dropout = nn.Dropout(config.dropout)
        self.encoder = _transformer(config.motion_channels, config)
        self.head = _head(config.motion_channels, config.motion_hidden, config.embed_dim)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = _zero_after(features[..., : self.inputs], lengths)
        b, t, _ = x.shape
        tokens = -(-t // self.patch)
        x = F.pad(x, (0, 0, 0, tokens * self.patch - t)).reshape(b, tokens, self.patch * self.inputs)
        real = _real(-(-lengths // self.patch), tokens, x.device)
        x = self.frames(x) + _sinusoid(tokens, self.frames.out_features, x.device)[None]
        x = self.encoder(self.dropout(x), src_key_padding_mask=~real)
        return self.head(_mean_over(x, real))


TOWERS = {"gru": (TextEncoder, MotionEncoder), "transformer": (TransformerTextEncoder, TransformerMotionEncoder)}


def _check_motion(features: torch.Tensor, lengths, feature_dim: int) -> torch.Tensor:
    if features.ndim != 3 or features.shape[-1] != feature_dim:
        raise ValueError(f"features must have shape (B, T, {feature_dim}), got {tuple(features.shape)}")
    lengths = torch.as_tensor(lengths).long().cpu()
    if lengths.shape != (features.shape[0],):
        raise ValueError(f"lengths must have shape ({features.shape[0]},), got {tuple(lengths.shape)}")
    if bool((lengths < UNIT_LENGTH).any()) or bool((lengths > features.shape[1]).any()):
        raise ValueError(
            f"lengths must lie in [{UNIT_LENGTH}, {features.shape[1]}] (the encoder steps every {UNIT_LENGTH} "
            f"frames), got {lengths.tolist()}"
        )
    return lengths


class TextMotionEvaluator(nn.Module):
    """Contrastive text/motion model. encode_motion takes raw HumanML3D features and normalises them with the
    stored feature statistics (set_feature_stats; identity until set), so a saved evaluator carries the
    normalisation it was trained with."""

    def __init__(self, config: EvaluatorConfig, vocab: Vocabulary):
        super().__init__()
        if config.vocab_size != len(vocab):
            raise ValueError(f"config.vocab_size {config.vocab_size} != vocabulary size {len(vocab)}")
        self.config = config
        self.vocab = vocab
        text_tower, motion_tower = TOWERS[config.architecture]
        self.text_encoder = text_tower(config)
        self.motion_encoder = motion_tower(config)
        self.register_buffer("feature_mean", torch.zeros(config.feature_dim))
        self.register_buffer("feature_std", torch.ones(config.feature_dim))

    @classmethod
    def from_captions(cls, captions: Iterable[str], min_count: int = 1, **sizes) -> TextMotionEvaluator:
        vocab = Vocabulary.build(captions, min_count=min_count)
        return cls(EvaluatorConfig(vocab_size=len(vocab), **sizes), vocab)

    def set_feature_stats(self, mean, std) -> None:
        mean = torch.as_tensor(np.asarray(mean), dtype=torch.float32)
        std = torch.as_tensor(np.asarray(std), dtype=torch.float32)
        if mean.shape != (self.config.feature_dim,) or std.shape != (self.config.feature_dim,):
            raise ValueError(f"feature statistics must have shape ({self.config.feature_dim},)")
        if not bool((std > 0).all()):
            raise ValueError("feature std must be positive")
        self.feature_mean.copy_(mean)
        self.feature_std.copy_(std)

    @property
    def device(self) -> torch.device:
        return self.feature_mean.device

    def _finish(self, emb: torch.Tensor) -> torch.Tensor:
        return F.normalize(emb, dim=-1) if self.config.normalize else emb

    def tokenize(self, captions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.vocab.encode(captions, self.config.max_words)

    def encode_tokens(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self._finish(self.text_encoder(ids.to(self.device), lengths))

    def encode_text(self, captions: Sequence[str]) -> torch.Tensor:
        """Embeddings (B, D) of captions (plain text)."""
        return self.encode_tokens(*self.tokenize(list(captions)))

    def encode_motion(self, features: torch.Tensor, lengths) -> torch.Tensor:
        """Embeddings (B, D) of raw features (B, T, 263); frames at or after lengths[b] are padding."""
        lengths = _check_motion(features, lengths, self.config.feature_dim)
        x = (features.to(self.device, torch.float32) - self.feature_mean) / self.feature_std
        return self._finish(self.motion_encoder(x, lengths))

    def forward(self, captions: Sequence[str], features: torch.Tensor, lengths) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encode_text(captions), self.encode_motion(features, lengths)

    # --------------------------------------------------------------------------------------------------------
    # Persistence: a folder with the config (json), the vocabulary (json) and the weights (safetensors).

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_FILE).write_text(json.dumps({"format": _FORMAT, **asdict(self.config)}, indent=1))
        (folder / VOCAB_FILE).write_text(json.dumps(self.vocab.to_json()))
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_FILE))
        return folder

    @classmethod
    def load(cls, folder: str | Path, device: str | torch.device = "cpu") -> TextMotionEvaluator:
        folder = Path(folder)
        data = _read_json(folder / CONFIG_FILE)
        if data.get("format") != _FORMAT:
            raise ValueError(f"{folder / CONFIG_FILE}: format {data.get('format')!r}, expected {_FORMAT!r}")
        known = {f.name for f in fields(EvaluatorConfig)}
        unknown = sorted(set(data) - known - {"format"})
        if unknown:
            raise ValueError(f"{folder / CONFIG_FILE}: unknown settings {unknown}")
        try:
            config = EvaluatorConfig(**{k: v for k, v in data.items() if k in known})
        except (TypeError, ValueError) as err:
            raise ValueError(f"{folder / CONFIG_FILE}: {err}") from err
        try:
            vocab = Vocabulary.from_json(_read_json(folder / VOCAB_FILE))
        except (KeyError, TypeError) as err:
            raise ValueError(f"{folder / VOCAB_FILE}: not a vocabulary ({err!r})") from err
        model = cls(config, vocab)
        weights = folder / WEIGHTS_FILE
        if not weights.is_file():
            raise FileNotFoundError(f"evaluator weights not found: {weights}")
        try:
            state = load_file(str(weights))
        except Exception as err:
            raise ValueError(f"{weights}: unreadable safetensors file ({err})") from err
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ValueError(f"{weights} does not match {folder / CONFIG_FILE}: {err}") from err
        return model.to(device).eval()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"evaluator file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid json ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a json object")
    return data


def load_evaluator(folder: str | Path, device: str | torch.device = "cpu") -> TextMotionEvaluator:
    return TextMotionEvaluator.load(folder, device)


# ================================================================================================================
# Loss and similarity


def info_nce(
    text_emb: torch.Tensor, motion_emb: torch.Tensor, temperature: float, exclude: torch.Tensor | None = None
) -> torch.Tensor:
    """Symmetric InfoNCE over a batch of matching (text_i, motion_i): the mean of the text->motion and
    motion->text cross-entropies of cosine similarities / temperature, the diagonal being the positives.
    exclude (B, B) bool removes pairs from the negatives (the diagonal is never removed): a caption repeated
    within a batch describes the other motions too, and pushing them apart would teach the model noise."""
    logits = F.normalize(text_emb, dim=-1) @ F.normalize(motion_emb, dim=-1).T / temperature
    if exclude is not None:
        eye = torch.eye(len(logits), dtype=torch.bool, device=logits.device)
        logits = logits.masked_fill(exclude.to(logits.device) & ~eye, -math.inf)
    target = torch.arange(len(logits), device=logits.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))


def same_tokens(ids: torch.Tensor) -> torch.Tensor:
    """(B, B) bool: rows i != j whose token ids (B, L) are identical, i.e. the same caption to the encoder."""
    same = (ids[:, None, :] == ids[None, :, :]).all(dim=-1)
    return same & ~torch.eye(len(ids), dtype=torch.bool, device=ids.device)


def contrastive_loss(model: TextMotionEvaluator, captions: Sequence[str], features: torch.Tensor, lengths):
    """The training objective on one batch of (captions, raw features (B, T, 263), lengths (B,)): info_nce at the
    model's temperature, with repeated captions excluded from each other's negatives."""
    ids, word_lengths = model.tokenize(list(captions))
    text_emb = model.encode_tokens(ids, word_lengths)
    motion_emb = model.encode_motion(features, lengths)
    return info_nce(text_emb, motion_emb, model.config.temperature, same_tokens(ids).to(text_emb.device))


def similarity(text_emb: torch.Tensor, motion_emb: torch.Tensor) -> torch.Tensor:
    """Cosine similarity (B,) in [-1, 1] of matching rows: the retrieval reward of a (caption, motion) pair."""
    cos = F.cosine_similarity(text_emb, motion_emb, dim=-1, eps=1e-8)
    return cos.clamp(-1.0, 1.0)


# ================================================================================================================
# The T2M evaluation protocol, on embeddings (numpy float64)

R_PRECISION_POOL = 32
DIVERSITY_PAIRS = 300
REPETITIONS = 20


def _as_array(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"embeddings must be (N, D), got shape {x.shape}")
    return x


def euclidean_distances(a, b) -> np.ndarray:
    """(N, M) distances between rows, from the differences themselves (the |a|^2 - 2ab + |b|^2 expansion loses
    the small distances to cancellation)."""
    a, b = _as_array(a), _as_array(b)
    return np.linalg.norm(a[:, None, :] - b[None, :, :], axis=-1)


def r_precision_hits(text_emb, motion_emb, pool_size: int = R_PRECISION_POOL, top_k: int = 3) -> np.ndarray:
    """Per pair (N, top_k): 1 where text i finds its own motion among the k nearest of its pool, 0 where not, NaN
    for the pairs of a last incomplete pool (dropped, as T2M's loader drops it). Pairs are taken in order in pools
    of pool_size and ranked by Euclidean distance; a motion at exactly the true distance ranks ahead of the true
    one: ties count against the evaluator, so identical embeddings score 0, not 1."""
    text, motion = _as_array(text_emb), _as_array(motion_emb)
    if text.shape != motion.shape:
        raise ValueError(f"text and motion embeddings differ in shape: {text.shape} vs {motion.shape}")
    pools = len(text) // pool_size
    if pools == 0:
        raise ValueError(f"R-precision needs at least {pool_size} pairs, got {len(text)}")
    hits = np.full((len(text), top_k), np.nan)
    for p in range(pools):
        sl = slice(p * pool_size, (p + 1) * pool_size)
        dist = euclidean_distances(text[sl], motion[sl])
        rank = (dist <= np.diag(dist)[:, None]).sum(axis=1) - 1
        hits[sl] = rank[:, None] < np.arange(1, top_k + 1)[None, :]
    return hits


def r_precision(text_emb, motion_emb, pool_size: int = R_PRECISION_POOL, top_k: int = 3) -> np.ndarray:
    """Top-1..top_k retrieval rates (top_k,) over the complete pools: the mean of r_precision_hits."""
    hits = r_precision_hits(text_emb, motion_emb, pool_size, top_k)
    return hits[: len(hits) // pool_size * pool_size].mean(axis=0)


def matching_score(text_emb, motion_emb) -> float:
    """MM-Dist: the mean Euclidean distance between each text and its own motion (over every pair given)."""
    text, motion = _as_array(text_emb), _as_array(motion_emb)
    if text.shape != motion.shape:
        raise ValueError(f"text and motion embeddings differ in shape: {text.shape} vs {motion.shape}")
    return float(np.linalg.norm(text - motion, axis=1).mean())


def activation_statistics(emb) -> tuple[np.ndarray, np.ndarray]:
    """Mean (D,) and unbiased covariance (D, D) of embeddings (N, D)."""
    x = _as_array(emb)
    if len(x) < 2:
        raise ValueError(f"a covariance needs at least 2 embeddings, got {len(x)}")
    return x.mean(axis=0), np.cov(x, rowvar=False)


def frechet_distance(mu1, cov1, mu2, cov2, eps: float = 1e-6) -> float:
    """|mu1 - mu2|^2 + Tr(cov1 + cov2 - 2 (cov1 cov2)^(1/2)): the Fréchet distance of two Gaussians.

    Numerical care: when the product is singular (fewer samples than dimensions) sqrtm can fail to give a finite
    result, and then eps is added to both diagonals; round-off gives the square root a small imaginary part, which
    is dropped when negligible and is an error otherwise; the result is clamped at 0."""
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    cov1, cov2 = np.atleast_2d(np.asarray(cov1, np.float64)), np.atleast_2d(np.asarray(cov2, np.float64))
    if mu1.shape != mu2.shape or cov1.shape != cov2.shape or cov1.shape != (len(mu1), len(mu1)):
        raise ValueError("means and covariances do not match in shape")
    if not all(np.isfinite(x).all() for x in (mu1, mu2, cov1, cov2)):
        return math.nan
    diff = mu1 - mu2
    covmean = scipy.linalg.sqrtm(cov1 @ cov2)
    if not np.isfinite(covmean).all():
        offset = np.eye(len(mu1)) * eps
        covmean = scipy.linalg.sqrtm((cov1 + offset) @ (cov2 + offset))
    if np.iscomplexobj(covmean):
        imag = np.abs(np.diagonal(covmean).imag).max()
        if imag > 1e-3:
            raise ValueError(f"sqrtm of the covariance product has an imaginary part {imag:.3g}")
        covmean = covmean.real
    value = diff @ diff + np.trace(cov1) + np.trace(cov2) - 2.0 * np.trace(covmean)
    return float(max(value, 0.0))


def fid(emb1, emb2) -> float:
    """Fréchet distance between the Gaussians fitted to two embedding sets."""
    return frechet_distance(*activation_statistics(emb1), *activation_statistics(emb2))


def diversity_of_pairs(emb, first: Sequence[int], second: Sequence[int]) -> float:
    """Mean distance between emb[first[i]] and emb[second[i]]."""
    x = _as_array(emb)
    first, second = np.asarray(first), np.asarray(second)
    return float(np.linalg.norm(x[first] - x[second], axis=1).mean())


def diversity(emb, n_pairs: int = DIVERSITY_PAIRS, rng: np.random.Generator | None = None) -> float:
    """Diversity: the mean distance of n_pairs random pairs, each side drawn without replacement (as in T2M: two
    independent draws, so a pair may join an embedding with itself)."""
    x = _as_array(emb)
    if len(x) < n_pairs:
        raise ValueError(f"diversity over {n_pairs} pairs needs at least {n_pairs} embeddings, got {len(x)}")
    rng = np.random.default_rng() if rng is None else rng
    return diversity_of_pairs(x, rng.choice(len(x), n_pairs, replace=False), rng.choice(len(x), n_pairs, replace=False))


# protocol_repetition's key for its per-pair top-3 hits (an array, not a metric)
PER_PAIR_TOP3 = "per_pair_top3"


def protocol_repetition(
    text_emb,
    motion_emb,
    real_motion_emb,
    rng: np.random.Generator,
    pool_size: int = R_PRECISION_POOL,
    diversity_pairs: int = DIVERSITY_PAIRS,
) -> dict[str, float | np.ndarray]:
    """One repetition of the T2M protocol: text_emb[i] describes motion_emb[i] (the motions judged, e.g. generated
    from text i); real_motion_emb are ground-truth motions (FID's reference). The pairs are shuffled before pooling,
    as T2M's shuffled loader does, so each repetition sees different pools. Under PER_PAIR_TOP3, each pair's top-3
    hit in its original order (NaN where its pool was incomplete and dropped): what makes R-precision comparable
    condition by condition between two sets of motions judged with the same shuffles."""
    text, motion = _as_array(text_emb), _as_array(motion_emb)
    order = rng.permutation(len(text))
    hits = np.empty((len(text), 3))
    hits[order] = r_precision_hits(text[order], motion[order], pool_size, top_k=3)
    top = hits[order[: len(text) // pool_size * pool_size]].mean(axis=0)
    return {
        "r_precision_top1": float(top[0]),
        "r_precision_top2": float(top[1]),
        "r_precision_top3": float(top[2]),
        "mm_dist": matching_score(text, motion),
        "fid": fid(real_motion_emb, motion),
        "diversity": diversity(motion, diversity_pairs, rng),
        PER_PAIR_TOP3: hits[:, 2],
    }


def mean_and_interval(values: Sequence[float]) -> tuple[float, float]:
    """(mean, 95% half-interval 1.96 std / sqrt(R)) of R repetitions, std with ddof 0 as T2M computes it."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or len(v) == 0:
        raise ValueError("need a non-empty sequence of values")
    return float(v.mean()), float(1.96 * v.std() / math.sqrt(len(v)))


def summarize_repetitions(repetitions: Sequence[Mapping[str, float]]) -> dict[str, tuple[float, float]]:
    """{metric: (mean, 95% half-interval)} over repetitions, each a protocol_repetition result (its per-pair
    entry left out: per_pair_rate averages that)."""
    if not repetitions:
        raise ValueError("no repetitions to summarize")
    return {name: mean_and_interval([r[name] for r in repetitions]) for name in repetitions[0]
            if name != PER_PAIR_TOP3}


def per_pair_rate(repetitions: Sequence[Mapping[str, np.ndarray]]) -> np.ndarray:
    """Each pair's top-3 hit rate over the repetitions in which its pool was complete (NaN if in none): a
    per-condition R-precision whose mean over the pairs is the repetitions' mean R-precision when every pool is
    complete."""
    hits = np.stack([r[PER_PAIR_TOP3] for r in repetitions])
    counted = np.isfinite(hits).sum(axis=0)
    total = np.where(np.isfinite(hits), hits, 0.0).sum(axis=0)
    return np.where(counted > 0, total / np.maximum(counted, 1), np.nan)


# ================================================================================================================
# The original T2M evaluator (Guo et al. 2022), loaded from its published checkpoint


T2M_POS = {
    "VERB": 0, "NOUN": 1, "DET": 2, "ADP": 3, "NUM": 4, "AUX": 5, "PRON": 6, "ADJ": 7, "ADV": 8,
    "Loc_VIP": 9, "Body_VIP": 10, "Obj_VIP": 11, "Act_VIP": 12, "Desc_VIP": 13, "OTHER": 14,
}  # fmt: skip
# Words whose part of speech the evaluator replaces by a "very important" class of their own.
T2M_VIP_WORDS = {
    "Loc_VIP": ("left", "right", "clockwise", "counterclockwise", "anticlockwise", "forward", "back", "backward",
                "up", "down", "straight", "curve"),
    "Body_VIP": ("arm", "chin", "foot", "feet", "face", "hand", "mouth", "leg", "waist", "eye", "knee", "shoulder",
                 "thigh"),
    "Obj_VIP": ("stair", "dumbbell", "chair", "window", "floor", "car", "ball", "handrail", "baseball",
                "basketball"),
    "Act_VIP": ("walk", "run", "swing", "pick", "bring", "kick", "put", "squat", "throw", "hop", "dance", "jump",
                "turn", "stumble", "stop", "sit", "lift", "lower", "raise", "wash", "stand", "kneel", "stroll", "rub",
                "bend", "balance", "flap", "jog", "shuffle", "lean", "rotate", "spin", "spread", "climb"),
    "Desc_VIP": ("slowly", "carefully", "fast", "careful", "slow", "quickly", "happy", "angry", "sad", "happily",
                 "angrily", "sadly"),
}  # fmt: skip
T2M_MAX_TEXT_LEN = 20
T2M_CHECKPOINT_PATHS = ("text_mot_match/model/finest.tar", "model/finest.tar", "finest.tar")


def parse_humanml3d_caption(line: str) -> tuple[str, list[str], float, float]:
    """One line of a HumanML3D texts/<id>.txt file, `caption#word/POS word/POS ...#start#end`, as
    (caption, tokens, start, end)."""
    parts = line.strip().split("#")
    if len(parts) != 4:
        raise ValueError(f"not a HumanML3D caption line (caption#tokens#start#end): {line!r}")
    caption, tokens, start, end = parts
    start_s = 0.0 if start in ("", "nan") else float(start)
    end_s = 0.0 if end in ("", "nan") else float(end)
    return caption, tokens.split(), start_s, end_s


def t2m_tokens(tokens: Sequence[str], max_text_len: int = T2M_MAX_TEXT_LEN) -> tuple[list[str], int]:
    """The evaluator's token sequence: at most max_text_len word/POS tokens between sos/OTHER and eos/OTHER,
    padded with unk/OTHER to max_text_len + 2; returns (tokens, length without the padding)."""
    body = ["sos/OTHER", *list(tokens)[:max_text_len], "eos/OTHER"]
    return body + ["unk/OTHER"] * (max_text_len + 2 - len(body)), len(body)


def _restricted_unpickle(path: Path):
    """A pickle of plain lists, dicts, strings and numbers; anything naming a class or function is refused, so a
    word list cannot run code."""

    class _Plain(pickle.Unpickler):
        def find_class(self, module, name):
            raise pickle.UnpicklingError(f"{path}: refusing to load {module}.{name} (only plain data is expected)")

    with open(path, "rb") as f:
        return _Plain(f).load()


class GloveVectors:
    """The evaluator's word vectors: <folder>/<prefix>_data.npy (N, 300), <prefix>_words.pkl (list of words) and
    <prefix>_idx.pkl (word -> row), as shipped with the T2M evaluator (glove/our_vab_*)."""

    def __init__(self, vectors: np.ndarray, word_index: Mapping[str, int]):
        self.vectors = np.asarray(vectors, dtype=np.float32)
        self.word_index = dict(word_index)
        if "unk" not in self.word_index:
            raise ValueError("the word vectors have no 'unk' entry, which every unknown word maps to")

    @classmethod
    def load(cls, folder: str | Path, prefix: str = "our_vab") -> GloveVectors:
        folder = Path(folder)
        paths = [folder / f"{prefix}_{s}" for s in ("data.npy", "words.pkl", "idx.pkl")]
        for p in paths:
            if not p.is_file():
                raise FileNotFoundError(f"T2M word-vector file not found: {p}")
        vectors = np.load(paths[0], allow_pickle=False)
        words = _restricted_unpickle(paths[1])
        index = _restricted_unpickle(paths[2])
        return cls(vectors, {w: int(index[w]) for w in words})

    @property
    def dim(self) -> int:
        return self.vectors.shape[1]

    def lookup(self, token: str) -> tuple[np.ndarray, np.ndarray]:
        """(word vector, POS one-hot (15,)) of a word/POS token: a known word keeps its tag unless it is one of
        the VIP words; an unknown word becomes 'unk' tagged OTHER."""
        word, _, pos = token.partition("/")
        onehot = np.zeros(len(T2M_POS), dtype=np.float32)
        if word not in self.word_index:
            onehot[T2M_POS["OTHER"]] = 1.0
            return self.vectors[self.word_index["unk"]], onehot
        for vip, words in T2M_VIP_WORDS.items():
            if word in words:
                pos = vip
                break
        onehot[T2M_POS.get(pos, T2M_POS["OTHER"])] = 1.0
        return self.vectors[self.word_index[word]], onehot


class T2MMovementEncoder(nn.Module):
    """(B, T, 259) -> (B, T // 4, latent): two stride-2 convolutions. Parameter names follow the checkpoint:
    main.0 and main.3 are the convolutions (dropout and activation between hold no weights), out_net the linear."""

    def __init__(self, inputs: int, hidden: int, latent: int):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv1d(inputs, hidden, 4, 2, 1), nn.Dropout(0.2), nn.LeakyReLU(0.2),
            nn.Conv1d(hidden, latent, 4, 2, 1), nn.Dropout(0.2), nn.LeakyReLU(0.2),
        )  # fmt: skip
        self.out_net = nn.Linear(latent, latent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_net(self.main(x.transpose(1, 2)).transpose(1, 2))


class _T2MBiGRU(nn.Module):
    """input_emb -> bidirectional GRU from a learnt initial state `hidden` (2, 1, H) -> output_net on the
    concatenated final states: the shared shape of T2M's text and motion co-embedding encoders."""

    def __init__(self, inputs: int, hidden: int, outputs: int):
        super().__init__()
        self.input_emb = nn.Linear(inputs, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True, bidirectional=True)
        self.output_net = nn.Sequential(
            nn.Linear(2 * hidden, hidden), nn.LayerNorm(hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, outputs)
        )
        self.hidden = nn.Parameter(torch.zeros(2, 1, hidden))

    def _encode(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h0 = self.hidden.expand(-1, x.shape[0], -1).contiguous()
        return self.output_net(_last_states(self.gru, self.input_emb(x), lengths, h0))


class T2MTextEncoder(_T2MBiGRU):
    """(word vectors (B, L, 300), POS one-hots (B, L, 15), lengths) -> (B, 512); pos_emb maps a one-hot into word
    space, where it is added to the word vector."""

    def __init__(self, word_dim: int, pos_dim: int, hidden: int, outputs: int):
        super().__init__(word_dim, hidden, outputs)
        self.pos_emb = nn.Linear(pos_dim, word_dim)

    def forward(self, words: torch.Tensor, pos: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self._encode(words + self.pos_emb(pos), lengths)


class T2MMotionEncoder(_T2MBiGRU):
    """(movement latents (B, T // 4, 512), lengths // 4) -> (B, 512)."""

    def forward(self, movements: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self._encode(movements, lengths)


class T2MEvaluator(nn.Module):
    """The original evaluator: embeddings whose distances the published HumanML3D numbers are measured in.

    encode_motion expects features normalised with the statistics the evaluator was trained with; pass them as
    mean/std (they are then applied to raw features) or normalise beforehand. Padded frames are set to 0 after
    normalisation, as T2M's loader pads them. encode_text needs the evaluator's word vectors (GloveVectors)."""

    def __init__(
        self,
        movement: T2MMovementEncoder,
        text: T2MTextEncoder,
        motion: T2MMotionEncoder,
        words: GloveVectors | None = None,
        mean=None,
        std=None,
    ):
        super().__init__()
        self.movement_encoder, self.text_encoder, self.motion_encoder = movement, text, motion
        self.words = words
        self.feature_dim = movement.main[0].in_channels + CONTACT_FEATURES
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std, or neither")
        self.mean = None if mean is None else torch.as_tensor(np.asarray(mean), dtype=torch.float32)
        self.std = None if std is None else torch.as_tensor(np.asarray(std), dtype=torch.float32)
        for name, stat in (("mean", self.mean), ("std", self.std)):
            if stat is not None and stat.shape != (self.feature_dim,):
                raise ValueError(f"{name} must have shape ({self.feature_dim},), got {tuple(stat.shape)}")

    @torch.no_grad()
    def encode_motion(self, features: torch.Tensor, lengths) -> torch.Tensor:
        lengths = _check_motion(features, lengths, self.feature_dim)
        x = features.float()
        if self.mean is not None:
            x = (x - self.mean.to(x.device)) / self.std.to(x.device)
        x = _zero_after(x, lengths)
        movements = self.movement_encoder(x[..., : self.feature_dim - CONTACT_FEATURES])
        return self.motion_encoder(movements, lengths // UNIT_LENGTH)

    @torch.no_grad()
    def encode_text_vectors(self, words: torch.Tensor, pos: torch.Tensor, lengths) -> torch.Tensor:
        return self.text_encoder(words.float(), pos.float(), torch.as_tensor(lengths).long().cpu())

    def text_inputs(self, token_lists: Sequence[Sequence[str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(word vectors (B, 22, 300), POS one-hots (B, 22, 15), lengths) of word/POS token lists."""
        if self.words is None:
            raise RuntimeError("encode_text needs the evaluator's word vectors: load_t2m_evaluator(..., glove=...)")
        rows, lengths = [], []
        for tokens in token_lists:
            padded, n = t2m_tokens(tokens)
            rows.append([self.words.lookup(t) for t in padded])
            lengths.append(n)
        words = torch.tensor(np.array([[w for w, _ in r] for r in rows]), dtype=torch.float32)
        pos = torch.tensor(np.array([[p for _, p in r] for r in rows]), dtype=torch.float32)
        return words, pos, torch.tensor(lengths)

    def encode_text(self, token_lists: Sequence[Sequence[str]]) -> torch.Tensor:
        """Embeddings (B, 512) of captions given as HumanML3D word/POS token lists (parse_humanml3d_caption)."""
        return self.encode_text_vectors(*self.text_inputs(token_lists))


def _find_t2m_checkpoint(folder: Path) -> Path:
    if folder.is_file():
        return folder
    tried = [folder / p for p in T2M_CHECKPOINT_PATHS]
    for path in tried:
        if path.is_file():
            return path
    raise FileNotFoundError("T2M evaluator checkpoint not found; tried " + ", ".join(str(p) for p in tried))


def _shape(state: Mapping[str, torch.Tensor], key: str, path: Path, part: str) -> tuple[int, ...]:
    if key not in state:
        raise ValueError(f"{path}: '{part}' has no parameter {key!r} (keys: {sorted(state)})")
    return tuple(state[key].shape)


def load_t2m_evaluator(
    folder: str | Path, glove: str | Path | None = None, mean=None, std=None, device: str | torch.device = "cpu"
) -> T2MEvaluator:
    """The T2M evaluator from <folder>/text_mot_match/model/finest.tar (or model/finest.tar, finest.tar, or the
    file itself).

    Layout (from the public text-to-motion code every HumanML3D benchmark loads it with; we have not seen the real
    file): a torch.save dict with state dicts under 'movement_encoder', 'text_encoder', 'motion_encoder' (and
    'epoch', optimiser states, which are ignored):
      movement_encoder: main.0.{weight [512, 259, 4], bias}, main.3.{weight [512, 512, 4], bias},
                        out_net.{weight [512, 512], bias};
      text_encoder:     pos_emb [300, 15], input_emb [512, 300], gru.*_l0{,_reverse} (hidden 512),
                        output_net.0 [512, 1024], output_net.1 (LayerNorm 512), output_net.3 [512, 512],
                        hidden [2, 1, 512];
      motion_encoder:   input_emb [1024, 512], gru (hidden 1024), output_net.0 [1024, 2048], output_net.1,
                        output_net.3 [512, 1024], hidden [2, 1, 1024].
    Sizes are read from the checkpoint's shapes, so a differently sized evaluator of the same layout loads too.
    glove: folder of the evaluator's word vectors (our_vab_*; needed by encode_text). mean/std: arrays (or .npy
    paths) of the statistics the evaluator's motions were normalised with; where they are shipped differs between
    repositories, so they are never guessed.
    """
    path = _find_t2m_checkpoint(Path(folder))
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"{path}: not a loadable torch checkpoint ({err})") from err
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f"{path}: expected a dict of state dicts, got {type(checkpoint).__name__}")
    for part in ("movement_encoder", "text_encoder", "motion_encoder"):
        if part not in checkpoint:
            raise ValueError(f"{path}: no {part!r} entry (entries: {sorted(checkpoint)})")

    mv, tx, mo = checkpoint["movement_encoder"], checkpoint["text_encoder"], checkpoint["motion_encoder"]
    hidden, inputs, _ = _shape(mv, "main.0.weight", path, "movement_encoder")
    latent = _shape(mv, "main.3.weight", path, "movement_encoder")[0]
    word_dim, pos_dim = _shape(tx, "pos_emb.weight", path, "text_encoder")
    text_hidden = _shape(tx, "input_emb.weight", path, "text_encoder")[0]
    co_dim = _shape(tx, "output_net.3.weight", path, "text_encoder")[0]
    motion_hidden, motion_in = _shape(mo, "input_emb.weight", path, "motion_encoder")
    motion_out = _shape(mo, "output_net.3.weight", path, "motion_encoder")[0]
    if pos_dim != len(T2M_POS):
        raise ValueError(
            f"{path}: text_encoder expects {pos_dim} POS classes, the evaluator's tagging has {len(T2M_POS)}"
        )
    if motion_in != latent or motion_out != co_dim:
        raise ValueError(
            f"{path}: encoder sizes disagree (movement latent {latent} -> motion input {motion_in}, "
            f"text out {co_dim} vs motion out {motion_out})"
        )

    movement = T2MMovementEncoder(inputs, hidden, latent)
    text = T2MTextEncoder(word_dim, pos_dim, text_hidden, co_dim)
    motion = T2MMotionEncoder(latent, motion_hidden, co_dim)
    for part, module, state in (
        ("movement_encoder", movement, mv),
        ("text_encoder", text, tx),
        ("motion_encoder", motion, mo),
    ):
        try:
            module.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ValueError(f"{path}: '{part}' does not match the T2M layout: {err}") from err

    words = GloveVectors.load(glove) if glove is not None else None
    if words is not None and words.dim != word_dim:
        raise ValueError(f"word vectors in {glove} are {words.dim}-d, {path} expects {word_dim}-d")
    mean = np.load(mean, allow_pickle=False) if isinstance(mean, str | Path) else mean
    std = np.load(std, allow_pickle=False) if isinstance(std, str | Path) else std
    model = T2MEvaluator(movement, text, motion, words, mean, std).to(device).eval()
    model.requires_grad_(False)
    return model
