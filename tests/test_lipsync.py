"""The lip-sync measure (characters_jax.lipsync): lag correlations, the shipped probes on
held-out clips (held-out identities, voices and words), identity matching."""

import numpy as np
import pytest

from characters_jax.data.face import render_batch
from characters_jax.lipsync.evaluate import SHIFT, shifted_late
from characters_jax.lipsync.identity import identify, identity_distance
from characters_jax.lipsync.probe import Probe, default_path, load_probe
from characters_jax.lipsync.score import lag_correlations, probe_track, score, sync_score

SEED = 5
H, W = 64, 96


def _smooth_track(rng, n):
    x = rng.normal(size=n + 8)
    return np.convolve(x, np.ones(5) / 5, mode="same")[4:-4]


def test_lag_correlations_match_a_float64_reference():
    rng = np.random.default_rng(SEED)
    for n, max_lag in ((40, 5), (96, 15), (200, 15)):
        v, g = rng.normal(size=n).astype(np.float32), rng.normal(size=(n, 2)).astype(np.float32)
        got = lag_correlations(v, g, max_lag)
        ref = []
        for lag in range(-max_lag, max_lag + 1):
            a = v[lag:] if lag >= 0 else v[:n + lag]
            b = g[:n - lag, 0] if lag >= 0 else g[-lag:, 0]
            ref.append(np.corrcoef(a.astype(np.float64), b.astype(np.float64))[0, 1])
        np.testing.assert_allclose(got, ref, atol=1e-6)


@pytest.mark.parametrize("delay", [-7, -3, 0, 3, 11])
def test_positive_lag_means_the_video_is_late(delay):
    rng = np.random.default_rng([SEED, delay + 100])
    gt = _smooth_track(rng, 160)
    video = np.roll(gt, delay)  # video[t] = gt[t - delay]
    s = sync_score(video, gt)
    assert s.lag == delay and s.peak > 0.99 and s.confidence > 0.5
    assert len(s.correlations) == 31 and s.max_lag == 15


def test_constant_tracks_score_zero_without_nan():
    rng = np.random.default_rng(SEED)
    for video, gt in ((rng.normal(size=64), np.zeros(64)), (np.full(64, 0.3), rng.normal(size=64)),
                      (np.zeros(64), np.zeros(64))):
        s = sync_score(video, gt)
        assert (s.peak, s.lag, s.confidence) == (0.0, 0, 0.0)
        assert np.all(np.isfinite(s.correlations))


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="too few"):
        sync_score(np.zeros(20), np.zeros(20))
    with pytest.raises(ValueError, match="differ in length"):
        sync_score(np.zeros(50), np.zeros(51))
    with pytest.raises(ValueError, match=r"\[T\] or \[T, 2\]"):
        sync_score(np.zeros((50, 2, 2)), np.zeros(50))
    with pytest.raises(ValueError, match="frames must be"):
        score(np.zeros((50, 64, 96), np.uint8), np.zeros(50))


# ---- the shipped probes on held-out clips -----------------------------------------------------------


@pytest.fixture(scope="module")
def mouth():
    return load_probe("mouth")


N_CLIPS = 20


@pytest.fixture(scope="module")
def heldout_clips():
    """20 four-second held-out clips at 64 x 96 (espeak-ng speech; held-out identities, voices, words)."""
    pytest.importorskip("espeakng_loader")
    from characters_jax.data.clips import ClipSpec, plan_clip, render_plans
    from characters_jax.data.speech import EspeakVoice

    spec = ClipSpec(seconds=4.0, height=H, width=W)
    with EspeakVoice() as voice:
        plans = [plan_clip("heldout", i, spec, SEED, voice) for i in range(N_CLIPS)]
    return render_plans(plans, H, W)


def test_probe_reads_the_jaw_of_heldout_identities(heldout_clips, mouth):
    """Per-clip correlation of the probe's jaw with the ground truth, clean and degraded."""
    from characters_jax.lipsync.train import degraded

    clean = [sync_score(probe_track(c.frames, mouth), c.plan.track, 0).peak for c in heldout_clips]
    worse = [sync_score(probe_track(degraded(c.frames, SEED + i), mouth), c.plan.track, 0).peak
             for i, c in enumerate(heldout_clips[:8])]
    print(f"probe jaw correlation per held-out clip: clean mean {np.mean(clean):.3f} min {np.min(clean):.3f}; "
          f"degraded mean {np.mean(worse):.3f} min {np.min(worse):.3f}")
    assert np.mean(clean) > 0.9 and np.min(clean) > 0.85
    assert np.mean(worse) > 0.75


def test_ground_truth_scores_high_and_shuffled_audio_low(heldout_clips, mouth):
    tracks = [probe_track(c.frames, mouth) for c in heldout_clips]
    gt = [sync_score(t, c.plan.track) for t, c in zip(tracks, heldout_clips)]
    shuffled = [sync_score(t, heldout_clips[(i + 1) % len(tracks)].plan.track) for i, t in enumerate(tracks)]
    print(f"ground truth: peak {np.mean([s.peak for s in gt]):.3f} confidence {np.mean([s.confidence for s in gt]):.3f}; "
          f"shuffled: peak {np.mean([s.peak for s in shuffled]):.3f} "
          f"confidence {np.mean([s.confidence for s in shuffled]):.3f}")
    assert all(s.lag == 0 for s in gt)
    assert np.mean([s.peak for s in gt]) > 0.9 and min(s.peak for s in gt) > 0.85
    assert np.mean([s.peak for s in shuffled]) < 0.45
    assert all(sh.peak < g.peak - 0.3 for sh, g in zip(shuffled, gt))
    assert np.mean([s.confidence for s in gt]) > np.mean([s.confidence for s in shuffled]) + 0.3


def test_a_three_frame_delay_is_found_as_lag_three(heldout_clips, mouth):
    late = render_batch(np.stack([c.plan.identity for c in heldout_clips]),
                        np.stack([shifted_late(c.plan.params, SHIFT) for c in heldout_clips]), H, W)
    lags = [score(f, c.plan.track, mouth).lag for f, c in zip(late, heldout_clips)]
    assert lags == [SHIFT] * len(heldout_clips)


def test_identity_matches_its_own_reference_among_20_heldout(heldout_clips):
    """Each held-out clip (talking, blinking, moving) is nearest to its own portrait (the first
    frame at rest) among the 20 held-out identities."""
    from characters_jax.data.clips import portrait

    probe = load_probe("identity")
    refs = np.stack([portrait(c.plan, H, W) for c in heldout_clips])
    matches = [identify(c.frames[:24], refs, probe) for c in heldout_clips]
    top1 = np.mean([m.index == i for i, m in enumerate(matches)])
    own = [m.distances[i] for i, m in enumerate(matches)]
    other = [np.delete(m.distances, i).min() for i, m in enumerate(matches)]
    print(f"identity top-1 among {len(refs)} held-out: {top1:.3f}; own distance {np.mean(own):.3f}, "
          f"nearest other {np.mean(other):.3f}")
    assert top1 >= 0.95
    first = heldout_clips[0].frames[:24]
    assert identity_distance(first, refs[0], probe) == pytest.approx(own[0], rel=1e-5)
    assert identity_distance(first, refs[0], probe) < identity_distance(first, refs[1], probe)


def test_probe_weights_are_small_and_round_trip(tmp_path):
    for kind in ("mouth", "identity"):
        path = default_path(kind)
        assert path.stat().st_size < 600_000
        probe = load_probe(kind)
        assert probe.cfg.kind == kind and "command" in probe.cfg.meta
        probe.save(tmp_path / "p.npz")
        again = Probe.load(tmp_path / "p.npz")
        frames = np.random.default_rng(SEED).integers(0, 256, (3, H, W, 3), dtype=np.uint8)
        np.testing.assert_array_equal(again.predict(frames), probe.predict(frames))
    with pytest.raises(ValueError, match="not a mouth probe"):
        load_probe("mouth", default_path("identity"))
    with pytest.raises(FileNotFoundError):
        load_probe("mouth", tmp_path / "missing.npz")


def test_the_lipsync_command_rejects_bad_arguments(tmp_path, capsys):
    from characters_jax.cli import main

    assert main(["lipsync", "score", "--data", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert main(["lipsync", "evaluate", "--set", "evaluate.clips=1"]) == 2
    assert "evaluate.clips: must be at least 2" in capsys.readouterr().err
