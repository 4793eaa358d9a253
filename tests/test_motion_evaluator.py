"""The text/motion retrieval evaluator: vocabulary, encoders of both architectures (padding never read), the
contrastive loss against a loop, persistence (old folders load as GRUs), a short training run that learns, the
committed grader's independence from the reward's network, the T2M protocol against independent computations, and
the T2M checkpoint loader on a tiny checkpoint written by hand in the published key layout."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from recam.domains.motion import evaluator as ev

TINY = dict(word_dim=16, text_hidden=16, motion_channels=16, motion_hidden=16, embed_dim=16)
CAPTIONS = ["A person walks forward.", "a person jumps up", "someone waves the left hand", "a man sits down"]
ROOT = Path(__file__).resolve().parents[1]
ARCHS = pytest.mark.parametrize("arch", ev.ARCHITECTURES)


def tiny_model(seed: int = 0, **overrides) -> ev.TextMotionEvaluator:
    torch.manual_seed(seed)
    return ev.TextMotionEvaluator.from_captions(CAPTIONS, **{**TINY, **overrides}).eval()


# ----------------------------------------------------------------------------------------------------------------
# Vocabulary


def test_vocabulary_build_encode_and_json():
    vocab = ev.Vocabulary.build(["b a a, c", "A b!", "d"], min_count=1)
    # Most frequent first, ties alphabetical; <pad> and <unk> lead.
    assert vocab.words == ["<pad>", "<unk>", "a", "b", "c", "d"]
    ids, lengths = vocab.encode(["A c zebra", "", "b"])
    assert ids.tolist() == [[2, 4, 1], [1, 0, 0], [3, 0, 0]]
    assert lengths.tolist() == [3, 1, 1]
    ids, lengths = vocab.encode(["a b c d"], max_words=2)
    assert ids.tolist() == [[2, 3]] and lengths.tolist() == [2]
    assert ev.Vocabulary.build(["x x y"], min_count=2).words == ["<pad>", "<unk>", "x"]
    assert ev.Vocabulary.build(["a b c"], max_size=3).words == ["<pad>", "<unk>", "a"]
    again = ev.Vocabulary.from_json(json.loads(json.dumps(vocab.to_json())))
    assert again.words == vocab.words
    with pytest.raises(ValueError):
        ev.Vocabulary(["a", "<pad>", "<unk>"])
    assert ev.tokenize("He doesn't walk-run, 2 times.") == ["he", "doesn't", "walk", "run", "2", "times"]


# ----------------------------------------------------------------------------------------------------------------
# Encoders


@ARCHS
def test_embeddings_shapes_and_norms(arch):
    model = tiny_model(architecture=arch)
    feats = torch.randn(3, 24, 263)
    t, m = model(CAPTIONS[:3], feats, torch.tensor([24, 13, 4]))
    assert t.shape == m.shape == (3, 16)
    torch.testing.assert_close(t.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(m.norm(dim=-1), torch.ones(3))
    raw = tiny_model(normalize=False, architecture=arch)
    assert not torch.allclose(raw.encode_text(CAPTIONS[:1]).norm(), torch.tensor(1.0))


@ARCHS
@pytest.mark.parametrize("length", [4, 7, 13, 16])
def test_motion_padding_is_never_read(length, arch):
    model = tiny_model(architecture=arch)
    gen = torch.Generator().manual_seed(length)
    clip = torch.randn(1, length, 263, generator=gen)
    alone = model.encode_motion(clip, torch.tensor([length]))
    for total in (length + 1, length + 6, 40):
        padded = torch.full((2, total, 263), 1e4)
        padded[0, :length] = clip[0]
        padded[1] = torch.randn(total, 263, generator=gen)
        got = model.encode_motion(padded, torch.tensor([length, total]))
        torch.testing.assert_close(got[0], alone[0], atol=1e-5, rtol=1e-5)


@ARCHS
def test_foot_contacts_are_not_read_and_stats_normalise(arch):
    model = tiny_model(architecture=arch)
    feats = torch.randn(2, 20, 263)
    other = feats.clone()
    other[..., -4:] = torch.randn(2, 20, 4) * 10
    lengths = torch.tensor([20, 11])
    torch.testing.assert_close(model.encode_motion(feats, lengths), model.encode_motion(other, lengths))
    keep_all = tiny_model(drop_contacts=False, architecture=arch)
    assert not torch.allclose(keep_all.encode_motion(feats, lengths), keep_all.encode_motion(other, lengths))
    # Stats are applied to raw features: raw = mean + std * z encodes like z did under identity stats.
    before = model.encode_motion(feats, lengths)
    mean, std = torch.randn(263), torch.rand(263) + 0.5
    model.set_feature_stats(mean, std)
    torch.testing.assert_close(model.encode_motion(mean + std * feats, lengths), before, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="positive"):
        model.set_feature_stats(mean, -std)


@ARCHS
def test_text_embedding_does_not_depend_on_batch_company(arch):
    model = tiny_model(architecture=arch)
    batch = model.encode_text(["a person walks", "someone waves the left hand slowly and then sits down"])
    alone = model.encode_text(["a person walks"])
    torch.testing.assert_close(batch[0], alone[0], atol=1e-6, rtol=1e-5)


@ARCHS
def test_motion_input_validation(arch):
    model = tiny_model(architecture=arch)
    with pytest.raises(ValueError, match="shape"):
        model.encode_motion(torch.zeros(1, 10, 262), torch.tensor([10]))
    with pytest.raises(ValueError, match="lengths"):
        model.encode_motion(torch.zeros(1, 10, 263), torch.tensor([3]))
    with pytest.raises(ValueError, match="lengths"):
        model.encode_motion(torch.zeros(1, 10, 263), torch.tensor([11]))


# ----------------------------------------------------------------------------------------------------------------
# Loss and similarity


def loop_info_nce(text, motion, tau, exclude=None):
    n = len(text)
    t = [v / np.linalg.norm(v) for v in text]
    m = [v / np.linalg.norm(v) for v in motion]
    total = 0.0
    for i in range(n):
        for direction in ("t2m", "m2t"):
            logits = []
            for j in range(n):
                if exclude is not None and j != i and (exclude[i][j] if direction == "t2m" else exclude[j][i]):
                    continue
                a, b = (t[i], m[j]) if direction == "t2m" else (m[i], t[j])
                logits.append((j, float(a @ b) / tau))
            top = max(v for _, v in logits)
            log_z = top + math.log(sum(math.exp(v - top) for _, v in logits))
            total += 0.5 * (log_z - dict(logits)[i])
    return total / n


def test_info_nce_matches_loop():
    gen = torch.Generator().manual_seed(0)
    text, motion = torch.randn(6, 5, generator=gen, dtype=torch.float64), torch.randn(6, 5, generator=gen)
    motion = motion.double()
    got = ev.info_nce(text, motion, 0.1)
    assert got.item() == pytest.approx(loop_info_nce(text.numpy(), motion.numpy(), 0.1), rel=1e-10)
    exclude = torch.zeros(6, 6, dtype=torch.bool)
    exclude[0, 3] = exclude[3, 0] = True
    exclude[2, 5] = True  # one-sided: text 2 ignores motion 5, and motion 5 ignores text 2
    exclude[4, 4] = True  # the diagonal is never excluded
    got = ev.info_nce(text, motion, 0.5, exclude)
    want = loop_info_nce(text.numpy(), motion.numpy(), 0.5, exclude.numpy())
    assert got.item() == pytest.approx(want, rel=1e-10)


def test_contrastive_loss_excludes_repeated_captions():
    model = tiny_model()
    captions = ["a person walks", "A person walks!", "a man sits down", "a person jumps up"]
    feats, lengths = torch.randn(4, 16, 263), torch.tensor([16, 12, 9, 16])
    loss = ev.contrastive_loss(model, captions, feats, lengths)
    t, m = model(captions, feats, lengths)
    exclude = torch.zeros(4, 4, dtype=torch.bool)
    exclude[0, 1] = exclude[1, 0] = True
    torch.testing.assert_close(loss, ev.info_nce(t, m, model.config.temperature, exclude))
    assert not torch.allclose(loss, ev.info_nce(t, m, model.config.temperature))
    loss.backward()
    assert all(p.grad is not None for p in model.text_encoder.parameters() if p.requires_grad)


def test_similarity_is_cosine():
    a = torch.tensor([[1.0, 0.0], [1.0, 1.0], [2.0, 0.0], [0.0, 3.0]])
    b = torch.tensor([[3.0, 0.0], [-1.0, -1.0], [0.0, 1.0], [0.0, 1.0]])
    torch.testing.assert_close(ev.similarity(a, b), torch.tensor([1.0, -1.0, 0.0, 1.0]))
    x, y = torch.randn(50, 8), torch.randn(50, 8)
    s = ev.similarity(x, y)
    assert bool(((s >= -1) & (s <= 1)).all())
    torch.testing.assert_close(s, (x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1)))


# ----------------------------------------------------------------------------------------------------------------
# Persistence


@ARCHS
def test_save_load_round_trip(tmp_path, arch):
    model = tiny_model(architecture=arch)
    model.set_feature_stats(torch.randn(263), torch.rand(263) + 0.5)
    model.save(tmp_path / "ev")
    loaded = ev.load_evaluator(tmp_path / "ev")
    assert loaded.vocab.words == model.vocab.words and loaded.config == model.config
    feats, lengths = torch.randn(2, 20, 263), torch.tensor([20, 9])
    torch.testing.assert_close(loaded.encode_motion(feats, lengths), model.encode_motion(feats, lengths))
    torch.testing.assert_close(loaded.encode_text(CAPTIONS), model.encode_text(CAPTIONS))


def test_folders_without_an_architecture_load_as_the_gru_they_hold(tmp_path):
    """Folders saved before EvaluatorConfig.architecture existed (checkpoints/motion_evaluator among them) hold GRU
    weights and no architecture field."""
    model = tiny_model()
    folder = model.save(tmp_path / "old")
    config = json.loads((folder / ev.CONFIG_FILE).read_text())
    assert config["architecture"] == "gru"
    old = {k: v for k, v in config.items() if k not in ("architecture", "layers", "heads", "patch_frames")}
    (folder / ev.CONFIG_FILE).write_text(json.dumps(old))
    loaded = ev.load_evaluator(folder)
    assert loaded.config.architecture == "gru" and isinstance(loaded.motion_encoder, ev.MotionEncoder)
    torch.testing.assert_close(loaded.encode_text(CAPTIONS), model.encode_text(CAPTIONS))
    committed = json.loads((ROOT / "checkpoints" / "motion_evaluator" / ev.CONFIG_FILE).read_text())
    assert "architecture" not in committed  # the case above is the reward's own network


def test_architecture_settings_are_checked_and_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="architecture='lstm'"):
        tiny_model(architecture="lstm")
    with pytest.raises(ValueError, match="word_dim=16 is not divisible by heads=3"):
        tiny_model(architecture="transformer", heads=3)
    with pytest.raises(ValueError, match="patch_frames must be >= 1"):
        tiny_model(architecture="transformer", patch_frames=0)
    folder = tiny_model().save(tmp_path / "ev")
    config = json.loads((folder / ev.CONFIG_FILE).read_text())
    (folder / ev.CONFIG_FILE).write_text(json.dumps({**config, "architecture": "lstm"}))
    with pytest.raises(ValueError, match=ev.CONFIG_FILE):
        ev.load_evaluator(folder)


def test_transformer_tower_attends_to_real_patches_and_averages_them():
    """An independent forward pass of the transformer motion tower, written out with its own modules: frames grouped
    into patches of patch_frames (the last padded with zeros), a sinusoidal position per patch, the encoder over the
    real patches alone (the padding cut off, not masked), their mean, and the head."""
    model = tiny_model(architecture="transformer", patch_frames=3)
    tower = model.motion_encoder
    feats = torch.randn(1, 20, 263)
    got = model.encode_motion(feats, torch.tensor([10]))  # 10 frames: patches 0-2, 3-5, 6-8, 9 (+2 zeros)
    x = (feats[0, :10, :259] - model.feature_mean[:259]) / model.feature_std[:259]
    x = torch.cat([x, torch.zeros(2, 259)]).reshape(4, 3 * 259)
    pos = torch.zeros(4, 16)
    for t in range(4):
        for i in range(8):
            pos[t, 2 * i] = math.sin(t / 10000 ** (2 * i / 16))
            pos[t, 2 * i + 1] = math.cos(t / 10000 ** (2 * i / 16))
    h = tower.encoder(tower.frames(x)[None] + pos[None])[0]
    want = torch.nn.functional.normalize(tower.head(h.mean(0, keepdim=True)), dim=-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_committed_grader_shares_nothing_with_the_reward_network():
    """motion.metric_evaluator's default (the grader of every held-out evaluation) and motion.evaluator's (the
    alignment reward's network), loaded from the committed folders: another architecture, and no parameter tensor
    of one equal to any of the other; trained from another seed on another draw of the world's training split."""
    from config import grpo

    for name in ("motion_tiny_cpu", "motion_smoke", "mdm_humanml3d_8npu"):
        c = grpo.get_config(name)
        assert c.motion.metric_evaluator and c.motion.metric_evaluator != c.motion.evaluator, name
    c = grpo.get_config("motion_tiny_cpu")
    reward = ev.load_evaluator(ROOT / c.motion.evaluator)
    grader = ev.load_evaluator(ROOT / c.motion.metric_evaluator)
    assert (reward.config.architecture, grader.config.architecture) == ("gru", "transformer")
    grader_params = list(grader.parameters())
    for p in reward.parameters():
        assert not any(p.shape == q.shape and torch.equal(p, q) for q in grader_params)
    # both read the world's features with the world's normalisation
    torch.testing.assert_close(grader.feature_mean, reward.feature_mean)
    provenance = [json.loads((ROOT / f / "provenance.json").read_text())
                  for f in (c.motion.evaluator, c.motion.metric_evaluator)]
    assert provenance[0]["seed"] != provenance[1]["seed"]
    assert provenance[0]["args"]["data_seed"] != provenance[1]["args"]["data_seed"]
    assert provenance[1]["architecture"] == "transformer" and provenance[1]["heldout"]["pool"] == 32
    # another network: its embeddings of the same captions are not the reward's
    assert not torch.allclose(grader.encode_text(CAPTIONS), reward.encode_text(CAPTIONS), atol=1e-2)


def test_load_errors_name_the_file(tmp_path):
    folder = tiny_model().save(tmp_path / "ev")
    (folder / ev.WEIGHTS_FILE).rename(folder / "moved")
    with pytest.raises(FileNotFoundError, match=ev.WEIGHTS_FILE):
        ev.load_evaluator(folder)
    (folder / "moved").rename(folder / ev.WEIGHTS_FILE)
    vocab = (folder / ev.VOCAB_FILE).read_text()
    (folder / ev.VOCAB_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=ev.VOCAB_FILE):
        ev.load_evaluator(folder)
    (folder / ev.VOCAB_FILE).write_text(vocab)
    config = json.loads((folder / ev.CONFIG_FILE).read_text())
    (folder / ev.CONFIG_FILE).write_text(json.dumps({**config, "embed_dim": 8}))
    with pytest.raises(ValueError, match=ev.WEIGHTS_FILE):
        ev.load_evaluator(folder)
    (folder / ev.CONFIG_FILE).write_text(json.dumps({**config, "colour": "red"}))
    with pytest.raises(ValueError, match=ev.CONFIG_FILE):
        ev.load_evaluator(folder)
    (folder / ev.CONFIG_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=ev.CONFIG_FILE):
        ev.load_evaluator(folder)


# ----------------------------------------------------------------------------------------------------------------
# A short training run learns to retrieve


def toy_batch(gen: torch.Generator, n: int):
    """Four kinds of motion, each a distinct pattern in a few feature channels, with one caption per kind."""
    labels = torch.randint(0, 4, (n,), generator=gen)
    lengths = torch.randint(12, 33, (n,), generator=gen)
    t = torch.arange(32, dtype=torch.float32)
    feats = 0.3 * torch.randn(n, 32, 263, generator=gen)
    for i, (c, length) in enumerate(zip(labels.tolist(), lengths.tolist(), strict=True)):
        feats[i, :, 10 * c : 10 * c + 10] += torch.sin(t * (0.2 + 0.2 * c))[:, None]
        feats[i, length:] = 0.0
    return [CAPTIONS[c] for c in labels.tolist()], feats, lengths, labels


@ARCHS
def test_training_loop_learns_retrieval(arch):
    model = tiny_model(seed=1, dropout=0.0, architecture=arch).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        captions, feats, lengths, _ = toy_batch(gen, 16)
        loss = ev.contrastive_loss(model, captions, feats, lengths)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])
    model.eval()
    with torch.no_grad():
        _, feats, lengths, labels = toy_batch(gen, 32)
        sims = model.encode_motion(feats, lengths) @ model.encode_text(CAPTIONS).T
    accuracy = (sims.argmax(dim=1) == labels).float().mean().item()
    assert accuracy > 0.9


# ----------------------------------------------------------------------------------------------------------------
# The T2M protocol


def loop_r_precision(text, motion, pool, top_k):
    hits = [0] * top_k
    pools = len(text) // pool
    for p in range(pools):
        for i in range(pool):
            ti = text[p * pool + i]
            d = [math.dist(ti, motion[p * pool + j]) for j in range(pool)]
            ahead = sum(1 for j in range(pool) if j != i and d[j] <= d[i])
            for k in range(top_k):
                hits[k] += ahead < k + 1
    return np.array(hits) / (pools * pool)


def test_r_precision_matches_loop():
    rng = np.random.default_rng(0)
    text = rng.normal(size=(100, 6))
    motion = text + rng.normal(scale=1.2, size=(100, 6))
    got = ev.r_precision(text, motion, pool_size=32, top_k=3)
    np.testing.assert_allclose(got, loop_r_precision(text, motion, 32, 3))
    assert 0 < got[0] <= got[1] <= got[2] < 1
    np.testing.assert_allclose(ev.r_precision(text, text, pool_size=32), [1.0, 1.0, 1.0])
    # Ties count against the evaluator: constant embeddings retrieve nothing.
    np.testing.assert_allclose(ev.r_precision(np.zeros((32, 4)), np.zeros((32, 4))), [0.0, 0.0, 0.0])
    # Motion 1 replaced by motion 0: text 0 finds two motions at distance 0 (a miss at top-1, a hit at top-2);
    # text 1 finds all 32 motions at distance sqrt(2) and misses at every k; the other 30 texts hit at top-1.
    text = np.eye(32)
    motion = np.eye(32)
    motion[1] = motion[0]
    hand = ev.r_precision(text, motion)
    np.testing.assert_allclose(hand, [30 / 32, 31 / 32, 31 / 32])
    with pytest.raises(ValueError, match="32"):
        ev.r_precision(np.zeros((31, 2)), np.zeros((31, 2)))


def test_r_precision_hits_per_pair_match_the_loop_and_drop_the_incomplete_pool():
    rng = np.random.default_rng(1)
    text = rng.normal(size=(70, 5))
    motion = text + rng.normal(scale=1.0, size=(70, 5))
    hits = ev.r_precision_hits(text, motion, pool_size=32, top_k=3)
    assert np.isnan(hits[64:]).all() and np.isfinite(hits[:64]).all()
    for i in (0, 17, 40, 63):
        p = i // 32
        d = [math.dist(text[i], motion[p * 32 + j]) for j in range(32)]
        ahead = sum(1 for j in range(32) if p * 32 + j != i and d[j] <= d[i - p * 32])
        np.testing.assert_array_equal(hits[i], [ahead < k for k in (1, 2, 3)])
    np.testing.assert_array_equal(ev.r_precision(text, motion), hits[:64].mean(axis=0))


def test_per_pair_rate_averages_each_pair_over_the_shuffles():
    rng = np.random.default_rng(2)
    text = rng.normal(size=(64, 6))
    motion = text + rng.normal(scale=1.5, size=(64, 6))
    reps = [ev.protocol_repetition(text, motion, text, rng, diversity_pairs=32) for _ in range(5)]
    rate = ev.per_pair_rate(reps)
    # by hand: pair i's hit in each shuffle, from the same permutations (the rng replayed)
    replay = np.random.default_rng(2)
    replay.normal(size=(64, 6)), replay.normal(size=(64, 6))
    want = np.zeros(64)
    for _ in range(5):
        order = replay.permutation(64)
        want[order] += ev.r_precision_hits(text[order], motion[order])[:, 2]
        replay.choice(64, 32, replace=False), replay.choice(64, 32, replace=False)  # diversity's draws
    np.testing.assert_allclose(rate, want / 5)
    assert rate.mean() == pytest.approx(ev.summarize_repetitions(reps)["r_precision_top3"][0], abs=1e-12)
    assert "per_pair_top3" not in ev.summarize_repetitions(reps)
    # a pair whose pool was incomplete in every shuffle has no rate
    reps[0][ev.PER_PAIR_TOP3][3] = np.nan
    assert np.isfinite(ev.per_pair_rate(reps)[3])
    for r in reps:
        r[ev.PER_PAIR_TOP3][3] = np.nan
    assert np.isnan(ev.per_pair_rate(reps)[3])


def test_matching_score_and_distances():
    text = np.array([[0.0, 0.0], [1.0, 1.0]])
    motion = np.array([[3.0, 4.0], [1.0, 2.0]])
    assert ev.matching_score(text, motion) == pytest.approx(3.0)
    np.testing.assert_allclose(ev.euclidean_distances(text, motion), [[5.0, math.sqrt(5)], [math.sqrt(13), 1.0]])
    assert ev.matching_score(torch.tensor(text), torch.tensor(motion)) == pytest.approx(3.0)


def test_fid_hand_values():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(400, 5)) @ rng.normal(size=(5, 5))
    assert ev.fid(a, a) == pytest.approx(0.0, abs=1e-8)
    shift = np.array([1.0, -2.0, 0.5, 0.0, 3.0])
    assert ev.fid(a, a + shift) == pytest.approx(float(shift @ shift), rel=1e-8)
    # Diagonal Gaussians: |dmu|^2 + sum (sqrt(s1) - sqrt(s2))^2.
    mu1, mu2 = np.array([0.0, 1.0, 2.0]), np.array([1.0, 1.0, 0.0])
    s1, s2 = np.array([1.0, 4.0, 0.25]), np.array([9.0, 1.0, 0.25])
    want = float(((mu1 - mu2) ** 2).sum() + ((np.sqrt(s1) - np.sqrt(s2)) ** 2).sum())
    assert ev.frechet_distance(mu1, np.diag(s1), mu2, np.diag(s2)) == pytest.approx(want, rel=1e-10)
    # A full-covariance case against scipy's sqrtm of the symmetric form.
    c1, c2 = np.cov(a, rowvar=False), np.cov(rng.normal(size=(300, 5)), rowvar=False)
    import scipy.linalg

    r1 = scipy.linalg.sqrtm(c1)
    want = np.trace(c1) + np.trace(c2) - 2 * np.trace(scipy.linalg.sqrtm(r1 @ c2 @ r1)).real
    assert ev.frechet_distance(np.zeros(5), c1, np.zeros(5), c2) == pytest.approx(want, rel=1e-8)
    # Fewer samples than dimensions: a singular product still gives a finite, non-negative distance.
    small = rng.normal(size=(6, 20))
    value = ev.fid(small, small + 0.1)
    assert math.isfinite(value) and value == pytest.approx(20 * 0.01, rel=1e-3)
    assert math.isnan(ev.frechet_distance([0.0], [[math.nan]], [0.0], [[1.0]]))


def test_diversity_hand_values():
    emb = np.array([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]])
    assert ev.diversity_of_pairs(emb, [0, 1], [1, 2]) == pytest.approx(5.0)
    assert ev.diversity_of_pairs(emb, [0, 2, 1], [2, 0, 1]) == pytest.approx(20 / 3)
    # The random draw: T2M's two independent draws of 300 indices without replacement, checked by a loop over the
    # same draws.
    rng = np.random.default_rng(3)
    cloud = rng.normal(size=(500, 4))
    got = ev.diversity(cloud, 300, np.random.default_rng(7))
    draw = np.random.default_rng(7)
    first, second = draw.choice(500, 300, replace=False), draw.choice(500, 300, replace=False)
    want = sum(math.dist(cloud[i], cloud[j]) for i, j in zip(first, second, strict=True)) / 300
    assert got == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="300"):
        ev.diversity(cloud[:299])


def test_repetitions_and_interval():
    mean, half = ev.mean_and_interval([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and half == pytest.approx(1.96 * math.sqrt(1.25) / 2)
    rng = np.random.default_rng(0)
    text = rng.normal(size=(320, 8))
    reps = [ev.protocol_repetition(text, text, text, rng) for _ in range(3)]
    summary = ev.summarize_repetitions(reps)
    assert summary["r_precision_top1"] == (1.0, 0.0)
    assert summary["mm_dist"] == (0.0, 0.0)
    assert summary["fid"][0] == pytest.approx(0.0, abs=1e-8)
    assert summary["diversity"][0] > 0 and summary["diversity"][1] > 0
    # Worse motions score worse on every metric but diversity.
    noisy = text + rng.normal(scale=2.0, size=text.shape)
    bad = ev.protocol_repetition(text, noisy, text, rng)
    assert bad["r_precision_top3"] < 1 and bad["mm_dist"] > 1 and bad["fid"] > 1


# ----------------------------------------------------------------------------------------------------------------
# T2M: text handling


def test_humanml3d_line_and_t2m_tokens():
    caption, tokens, start, end = ev.parse_humanml3d_caption("a man walks.#a/DET man/NOUN walk/VERB#0.0#2.5\n")
    assert caption == "a man walks." and tokens == ["a/DET", "man/NOUN", "walk/VERB"] and (start, end) == (0.0, 2.5)
    assert ev.parse_humanml3d_caption("x#x/X#nan#nan")[2:] == (0.0, 0.0)
    with pytest.raises(ValueError):
        ev.parse_humanml3d_caption("no tokens here")
    padded, n = ev.t2m_tokens(tokens)
    assert n == 5 and len(padded) == 22
    assert padded[:5] == ["sos/OTHER", "a/DET", "man/NOUN", "walk/VERB", "eos/OTHER"]
    assert set(padded[5:]) == {"unk/OTHER"}
    padded, n = ev.t2m_tokens([f"w{i}/NOUN" for i in range(30)])
    assert n == 22 and len(padded) == 22 and padded[-2] == "w19/NOUN" and padded[-1] == "eos/OTHER"


def write_glove(folder, words, dim, seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    vectors = np.random.default_rng(seed).normal(size=(len(words), dim)).astype(np.float32)
    np.save(folder / "our_vab_data.npy", vectors)
    with open(folder / "our_vab_words.pkl", "wb") as f:
        pickle.dump(list(words), f)
    with open(folder / "our_vab_idx.pkl", "wb") as f:
        pickle.dump({w: i for i, w in enumerate(words)}, f)
    return vectors


def test_glove_lookup_and_vip_tags(tmp_path):
    words = ["unk", "sos", "eos", "a", "man", "walk", "left"]
    vectors = write_glove(tmp_path / "glove", words, 7)
    glove = ev.GloveVectors.load(tmp_path / "glove")
    vec, pos = glove.lookup("man/NOUN")
    np.testing.assert_array_equal(vec, vectors[4])
    assert pos.argmax() == 1 and pos.sum() == 1
    assert glove.lookup("walk/VERB")[1].argmax() == ev.T2M_POS["Act_VIP"]
    assert glove.lookup("left/ADJ")[1].argmax() == ev.T2M_POS["Loc_VIP"]
    assert glove.lookup("a/WEIRD")[1].argmax() == ev.T2M_POS["OTHER"]
    vec, pos = glove.lookup("zebra/NOUN")
    np.testing.assert_array_equal(vec, vectors[0])
    assert pos.argmax() == ev.T2M_POS["OTHER"]
    # A pickle naming a callable is refused rather than executed.
    with open(tmp_path / "glove" / "our_vab_words.pkl", "wb") as f:
        pickle.dump(np.array([1]), f)
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        ev.GloveVectors.load(tmp_path / "glove")
    with pytest.raises(FileNotFoundError, match="our_vab_data.npy"):
        ev.GloveVectors.load(tmp_path / "nowhere")


# ----------------------------------------------------------------------------------------------------------------
# T2M: a tiny checkpoint in the published layout, and a numpy reference forward pass

WORD, POS, TEXT_H, CO, MOVE_H, LATENT, MOTION_H = 7, 15, 4, 3, 6, 5, 4


def gru_params(prefix_in: int, hidden: int, rng) -> dict[str, torch.Tensor]:
    out = {}
    for suffix in ("", "_reverse"):
        out[f"gru.weight_ih_l0{suffix}"] = rng.normal(size=(3 * hidden, prefix_in))
        out[f"gru.weight_hh_l0{suffix}"] = rng.normal(size=(3 * hidden, hidden))
        out[f"gru.bias_ih_l0{suffix}"] = rng.normal(size=3 * hidden)
        out[f"gru.bias_hh_l0{suffix}"] = rng.normal(size=3 * hidden)
    return out


def co_encoder_params(inputs: int, hidden: int, outputs: int, rng) -> dict:
    return {
        "input_emb.weight": rng.normal(size=(hidden, inputs)),
        "input_emb.bias": rng.normal(size=hidden),
        **gru_params(hidden, hidden, rng),
        "output_net.0.weight": rng.normal(size=(hidden, 2 * hidden)),
        "output_net.0.bias": rng.normal(size=hidden),
        "output_net.1.weight": rng.normal(size=hidden),
        "output_net.1.bias": rng.normal(size=hidden),
        "output_net.3.weight": rng.normal(size=(outputs, hidden)),
        "output_net.3.bias": rng.normal(size=outputs),
        "hidden": rng.normal(size=(2, 1, hidden)),
    }


def tiny_t2m_checkpoint(path, seed=0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    parts = {
        "movement_encoder": {
            "main.0.weight": rng.normal(size=(MOVE_H, 259, 4)) * 0.1,
            "main.0.bias": rng.normal(size=MOVE_H),
            "main.3.weight": rng.normal(size=(LATENT, MOVE_H, 4)),
            "main.3.bias": rng.normal(size=LATENT),
            "out_net.weight": rng.normal(size=(LATENT, LATENT)),
            "out_net.bias": rng.normal(size=LATENT),
        },
        "text_encoder": {
            "pos_emb.weight": rng.normal(size=(WORD, POS)),
            "pos_emb.bias": rng.normal(size=WORD),
            **co_encoder_params(WORD, TEXT_H, CO, rng),
        },
        "motion_encoder": co_encoder_params(LATENT, MOTION_H, CO, rng),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: {n: torch.tensor(v, dtype=torch.float32) for n, v in p.items()} for k, p in parts.items()}
    torch.save({**state, "epoch": 7, "iter": 1234, "text_enc_opt": {"state": {}, "param_groups": []}}, path)
    return {k: {n: v.astype(np.float32).astype(np.float64) for n, v in p.items()} for k, p in parts.items()}


def np_leaky(x):
    return np.where(x > 0, x, 0.2 * x)


def np_sigmoid(x):
    return 1 / (1 + np.exp(-x))


def np_gru_direction(x, h, w_ih, w_hh, b_ih, b_hh):
    """PyTorch's GRU cell over the rows of x, gates ordered (reset, update, new)."""
    hs = len(h)
    for xt in x:
        gi, gh = w_ih @ xt + b_ih, w_hh @ h + b_hh
        r = np_sigmoid(gi[:hs] + gh[:hs])
        z = np_sigmoid(gi[hs : 2 * hs] + gh[hs : 2 * hs])
        n = np.tanh(gi[2 * hs :] + r * gh[2 * hs :])
        h = (1 - z) * n + z * h
    return h


def np_co_encoder(x, p):
    """input_emb -> bi-GRU from `hidden` -> output_net, on one sequence x (L, inputs)."""
    e = x @ p["input_emb.weight"].T + p["input_emb.bias"]
    fwd = np_gru_direction(
        e, p["hidden"][0, 0], *(p[f"gru.{n}_l0"] for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
    )
    bwd = np_gru_direction(
        e[::-1],
        p["hidden"][1, 0],
        *(p[f"gru.{n}_l0_reverse"] for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")),
    )
    y = np.concatenate([fwd, bwd]) @ p["output_net.0.weight"].T + p["output_net.0.bias"]
    y = (y - y.mean()) / np.sqrt(y.var() + 1e-5) * p["output_net.1.weight"] + p["output_net.1.bias"]
    return np_leaky(y) @ p["output_net.3.weight"].T + p["output_net.3.bias"]


def np_conv(x, w, b):
    """Conv1d, kernel 4, stride 2, padding 1, on x (C, T) by explicit windows."""
    xp = np.pad(x, ((0, 0), (1, 1)))
    steps = (x.shape[1] + 2 - 4) // 2 + 1
    return np.stack([np.einsum("ock,ck->o", w, xp[:, 2 * j : 2 * j + 4]) + b for j in range(steps)], axis=1)


def np_t2m_motion(features, length, parts, mean, std):
    x = (features - mean) / std
    x[length:] = 0.0
    mv = parts["movement_encoder"]
    h = np_leaky(np_conv(x[:, :259].T, mv["main.0.weight"], mv["main.0.bias"]))
    h = np_leaky(np_conv(h, mv["main.3.weight"], mv["main.3.bias"])).T
    h = h @ mv["out_net.weight"].T + mv["out_net.bias"]
    return np_co_encoder(h[: length // 4], parts["motion_encoder"])


def test_t2m_loader_reproduces_a_reference_forward_pass(tmp_path):
    root = tmp_path / "t2m"
    parts = tiny_t2m_checkpoint(root / "text_mot_match" / "model" / "finest.tar")
    words = ["unk", "sos", "eos", "a", "man", "walk", "left", "forward"]
    vectors = write_glove(tmp_path / "glove", words, WORD).astype(np.float64)
    rng = np.random.default_rng(5)
    mean, std = rng.normal(size=263), rng.uniform(0.5, 2.0, size=263)
    np.save(tmp_path / "mean.npy", mean)
    model = ev.load_t2m_evaluator(root, glove=tmp_path / "glove", mean=tmp_path / "mean.npy", std=std)

    features = rng.normal(size=(3, 40, 263))
    lengths = [40, 23, 8]
    got = model.encode_motion(torch.tensor(features, dtype=torch.float32), torch.tensor(lengths)).numpy()
    mean32 = mean.astype(np.float32).astype(np.float64)
    std32 = std.astype(np.float32).astype(np.float64)
    for b, n in enumerate(lengths):
        want = np_t2m_motion(features[b].copy(), n, parts, mean32, std32)
        np.testing.assert_allclose(got[b], want, rtol=2e-4, atol=2e-4)

    captions = [["a/DET", "man/NOUN", "walk/VERB", "forward/ADV"], ["left/ADJ", "zebra/NOUN"]]
    got = model.encode_text(captions).numpy()
    tx = parts["text_encoder"]
    index = {w: i for i, w in enumerate(words)}
    pos_of = {"sos/OTHER": 14, "eos/OTHER": 14, "a/DET": 2, "man/NOUN": 1, "walk/VERB": 12, "forward/ADV": 9,
              "left/ADJ": 9, "zebra/NOUN": 14}  # fmt: skip
    for b, caption in enumerate(captions):
        tokens = ["sos/OTHER", *caption, "eos/OTHER"]
        rows = []
        for tok in tokens:
            word = tok.split("/")[0]
            vec = vectors[index.get(word, 0)]
            onehot = np.eye(15)[pos_of[tok]]
            rows.append(vec + tx["pos_emb.weight"] @ onehot + tx["pos_emb.bias"])
        want = np_co_encoder(np.array(rows), tx)
        np.testing.assert_allclose(got[b], want, rtol=2e-4, atol=2e-4)


def test_t2m_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="text_mot_match/model/finest.tar"):
        ev.load_t2m_evaluator(tmp_path)
    path = tmp_path / "finest.tar"
    tiny_t2m_checkpoint(path)
    model = ev.load_t2m_evaluator(path)  # the file itself, no word vectors, already-normalised motions
    assert model.encode_motion(torch.zeros(1, 8, 263), torch.tensor([8])).shape == (1, CO)
    with pytest.raises(RuntimeError, match="word vectors"):
        model.encode_text([["a/DET"]])
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint["motion_encoder"]
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match="motion_encoder"):
        ev.load_t2m_evaluator(path)
    tiny_t2m_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint["text_encoder"]["hidden"]
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match="text_encoder"):
        ev.load_t2m_evaluator(path)


def test_training_script_saves_the_architecture_and_evaluate_reproduces_its_numbers(tmp_path):
    """scripts/pretrain/train_motion_evaluator.py --arch transformer writes the architecture into evaluator.json and
    provenance.json, and --evaluate on the saved folder measures the same held-out numbers (same split, same
    shuffles) as the training run recorded."""
    import importlib.util

    path = ROOT / "scripts" / "pretrain" / "train_motion_evaluator.py"
    spec = importlib.util.spec_from_file_location("train_motion_evaluator", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    sizes = ["--num-eval-conditions", "32", "--seed", "3", "--data-seed", "2"]
    provenance = script.main(["--out", str(tmp_path / "ev"), "--arch", "transformer", "--steps", "4",
                              "--eval-every", "4", "--batch-size", "8", "--num-train-conditions", "16",
                              "--hidden", "16", "--embed-dim", "16", *sizes])
    assert provenance["architecture"] == "transformer" and provenance["args"]["data_seed"] == 2
    assert json.loads((tmp_path / "ev" / ev.CONFIG_FILE).read_text())["architecture"] == "transformer"
    again = script.main(["--evaluate", str(tmp_path / "ev"), *sizes])
    assert again["heldout"] == pytest.approx(provenance["heldout"], rel=1e-6)
    assert again["heldout"]["pool"] == 32
