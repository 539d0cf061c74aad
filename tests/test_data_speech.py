"""espeak-ng speech with phoneme timings (characters_jax.data.speech) and the mouth track built
from it (characters_jax.data.visemes)."""

import hashlib

import numpy as np
import pytest

pytest.importorskip("espeakng_loader")

from characters_jax.data import visemes  # noqa: E402
from characters_jax.data.speech import SAMPLE_RATE, EspeakError, EspeakVoice, Phoneme, Utterance  # noqa: E402

UTTERANCES = (Utterance("The red house is big, bamo kitu sela.", "en-us+f2", rate=160, noise_seed=5),
              Utterance("Was ist das? Ein Haus.", "de+klatt3", rate=200, pitch=70, noise_seed=6))


@pytest.fixture(scope="module")
def voice():
    return EspeakVoice()


def _digest(speeches):
    return [hashlib.sha256(s.audio.tobytes() + repr(s.phonemes).encode()).hexdigest() for s in speeches]


def test_phoneme_timings_lie_inside_the_audio_in_order(voice):
    for sp in voice.say(UTTERANCES):
        assert sp.audio.dtype == np.int16 and sp.audio.ndim == 1
        assert 0.5 < sp.seconds < 5.0
        assert np.abs(sp.audio.astype(np.int32)).max() > 1000  # not silence
        starts = np.array([p.start for p in sp.phonemes])
        ends = np.array([p.end for p in sp.phonemes])
        assert len(sp.phonemes) >= 10
        assert np.all(np.diff(starts) > 0) and np.all(ends > starts) and np.all(ends[:-1] <= starts[1:] + 1e-9)
        assert starts[0] >= 0 and ends[-1] <= sp.seconds + 1e-9
        assert not any(p.symbol.startswith("(") for p in sp.phonemes)  # language switches are not sounds


def test_speech_energy_follows_the_phonemes(voice):
    """The audio is loud inside the phoneme spans and quiet in the pauses between sentences."""
    sp = voice.say([Utterance("Mama. Papa.", "en-us", rate=120)])[0]
    covered = np.zeros(len(sp.audio), bool)
    for p in sp.phonemes:
        covered[int(p.start * SAMPLE_RATE):int(p.end * SAMPLE_RATE)] = True
    x = sp.audio.astype(np.float64)
    assert covered.any() and (~covered).any()
    assert np.sqrt((x[covered] ** 2).mean()) > 10 * np.sqrt((x[~covered] ** 2).mean() + 1.0)


def test_same_request_gives_the_same_bytes_whatever_ran_before(voice):
    first = _digest(voice.say(UTTERANCES))
    voice.say([Utterance("Something else entirely, said first.", "fr+m3", noise_seed=9)])
    assert _digest(voice.say(UTTERANCES)) == first
    assert _digest(EspeakVoice().say(UTTERANCES)) == first
    other_seed = [Utterance(u.text, u.voice, u.rate, u.pitch, u.pitch_range, u.volume, u.noise_seed + 1)
                  for u in UTTERANCES]
    assert _digest(voice.say(other_seed))[0] != first[0]  # f2 breathes: its noise follows the seed


def test_an_unknown_voice_is_a_clear_error(voice):
    with pytest.raises(EspeakError, match="no voice 'xx-nothing'"):
        voice.say([Utterance("hello", "xx-nothing")])


def test_bilabials_close_the_mouth_and_open_vowels_open_it():
    assert visemes.phoneme_targets("m") == [(0.0, 0.5)]
    jaw_a = visemes.phoneme_targets("ɑː")[0][0]
    jaw_i = visemes.phoneme_targets("i")[0][0]
    assert jaw_a > jaw_i > 0.0
    assert visemes.phoneme_targets("ˈa")[0][0] > visemes.phoneme_targets("a")[0][0]  # stress opens more
    assert len(visemes.phoneme_targets("aɪ")) == 2 and visemes.phoneme_targets("ʲ") == []
    u, i = visemes.phoneme_targets("u")[0], visemes.phoneme_targets("i")[0]
    assert u[1] < 0.2 < 0.8 < i[1]  # rounded vs spread


def test_frame_targets_are_time_weighted_means():
    """A phoneme covering half a frame contributes half of its target; the rest is the rest state."""
    fps = 24
    ph = [Phoneme("a", 0.0, 0.5 / fps), Phoneme("m", 1.0 / fps, 2.0 / fps)]
    t = visemes.frame_targets(ph, 3, fps)
    a = np.asarray(visemes.phoneme_targets("a")[0])
    np.testing.assert_allclose(t[0], 0.5 * a + 0.5 * np.asarray(visemes.REST), atol=1e-12)
    np.testing.assert_allclose(t[1], visemes.phoneme_targets("m")[0], atol=1e-12)
    np.testing.assert_allclose(t[2], visemes.REST, atol=1e-12)


def _random_phonemes(rng, start, stop):
    symbols = ["a", "i", "u", "m", "s", "ˈɑː", "oʊ", "p", "e", "l"]
    out, t = [], start
    while t < stop:
        d = rng.uniform(0.03, 0.2)
        if rng.random() < 0.8:
            out.append(Phoneme(symbols[rng.integers(len(symbols))], t, min(t + d, stop)))
        t += d + (rng.uniform(0.05, 0.3) if rng.random() < 0.15 else 0.0)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_track_is_causal_per_chunk(seed):
    """Changing the phonemes after the end of chunk c leaves frames 0 .. 4c+3 unchanged, and
    changes later frames (so the perturbation is real)."""
    rng = np.random.default_rng(seed)
    fps, frames = 24, 96
    base = _random_phonemes(rng, 0.0, frames / fps)
    track = visemes.mouth_track(base, frames, fps)
    assert track.shape == (frames, 2) and track.dtype == np.float32
    for chunk in (0, 3, 10, 22):
        t_end = (4 * chunk + 4) / fps
        kept = [Phoneme(p.symbol, p.start, min(p.end, t_end)) for p in base if p.start < t_end]
        other = kept + [Phoneme("ˈɑː", t_end, t_end + 1 / fps)] + _random_phonemes(rng, t_end + 1 / fps, frames / fps)
        changed = visemes.mouth_track(other, frames, fps)
        np.testing.assert_array_equal(changed[:4 * chunk + 4], track[:4 * chunk + 4])
        assert np.abs(changed[4 * chunk + 4:] - track[4 * chunk + 4:]).max() > 1e-3


def test_lookahead_stays_inside_the_chunk():
    """Anticipation of one frame: a phoneme starting at frame 5 already moves frame 4 (same chunk),
    one starting at frame 4 does not move frame 3 (the previous chunk)."""
    fps = 24
    dyn = visemes.MouthDynamics(lookahead=1, smoothing=0.0)
    t5 = visemes.mouth_track([Phoneme("a", 5 / fps, 6 / fps)], 8, fps, dyn)
    assert t5[4, 0] > 0.1 and t5[3, 0] == 0.0
    t4 = visemes.mouth_track([Phoneme("a", 4 / fps, 5 / fps)], 8, fps, dyn)
    assert t4[3, 0] == 0.0 and t4[4, 0] > 0.1
