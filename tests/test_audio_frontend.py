"""Audio front end: sample/frame/step bookkeeping, log-mel tokens, alignment, format checks."""

import numpy as np
import pytest

from characters_jax.audio.features import AudioFrontEnd, FrontEndSpec, pooling_matrix
from characters_jax.audio.pcm import AudioFormatError, PcmFormat, check_format, pcm_to_int16, read_wav, write_wav
from characters_jax.audio.timeline import Timeline
from characters_jax.config import ConfigError, load_config


@pytest.fixture(scope="module")
def tiny():
    return load_config("tiny")


def test_timeline_slices_tile_the_audio_exactly():
    tl = Timeline(16000, 24, 4)
    spans = [tl.step_span(s) for s in range(100)]
    assert spans[0][0] == 0
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no gaps, no overlaps
    assert {e - s for s, e in spans} == {2666, 2667}  # 16000 / 6 per step, no drift
    assert spans[-1][1] == 100 * 16000 // 6
    for n in (0, 1, 666, 667, 2666, 2667, 2668, 16000, 31999):
        steps = tl.steps_for(n)
        assert tl.step_span(steps - 1)[1] >= n if steps else n == 0
        assert steps == 0 or tl.step_span(steps - 2)[1] < n if steps > 1 else True
    assert tl.frame_time(24) == pytest.approx(1.0)


def test_tokens_shape_and_one_program(tiny):
    fe = AudioFrontEnd(tiny)
    spec = fe.spec
    assert spec.tokens == tiny.model.audio_tokens_per_step == 9
    pcm = (np.random.default_rng(0).standard_normal(16000) * 3000).astype(np.int16)
    toks = [np.asarray(fe.tokens(fe.window(lambda a, b: pcm[a:b], s))) for s in range(6)]
    assert all(t.shape == (9, tiny.model.audio_feature_dim) and t.dtype == np.float32 for t in toks)
    assert all(np.isfinite(t).all() for t in toks)
    assert fe._tokens._cache_size() == 1


def test_frame_k_carries_audio_k(tiny):
    """A burst inside step 3's audio changes step 3's tokens and no earlier step's (causal),
    and not step 4's when it ends before step 4's window reaches back."""
    fe = AudioFrontEnd(tiny)
    tl = fe.timeline
    n = tl.step_span(6)[1]
    quiet = np.zeros(n, np.int16)
    loud = quiet.copy()
    s3, e3 = tl.step_span(3)
    burst_end = e3 - (fe.spec.window_samples - (e3 - s3)) - 10  # before step 4's context
    loud[s3 + 10 : burst_end] = (np.sin(np.arange(burst_end - s3 - 10) * 0.3) * 20000).astype(np.int16)

    def toks(pcm, s):
        return np.asarray(fe.tokens(fe.window(lambda a, b: pcm[a:b], s)))

    changed = [not np.allclose(toks(quiet, s), toks(loud, s)) for s in range(6)]
    assert changed == [False, False, False, True, False, False]


def test_window_zero_pads_start_and_end(tiny):
    fe = AudioFrontEnd(tiny)
    pcm = np.full(100, 16384, np.int16)
    w = fe.window(lambda a, b: pcm[a:b], 0)
    assert w.shape == (fe.spec.window_samples,)
    start, _ = fe.window_bounds(0)
    assert np.all(w[: -start] == 0) and np.allclose(w[-start : -start + 100], 0.5) and np.all(w[-start + 100 :] == 0)


def test_pooling_rows_average():
    p = pooling_matrix(17, 9)
    assert np.allclose(p.sum(1), 1.0) and (p >= 0).all()


def test_feature_dim_must_match(tiny):
    with pytest.raises(ConfigError, match="audio.n_mels"):
        FrontEndSpec.from_config(tiny.replace(audio={"n_mels": 16}))


@pytest.mark.parametrize("fmt,msg", [
    (PcmFormat(44100, 1, "s16le"), "sample rate 44100"),
    (PcmFormat(16000, 2, "s16le"), "2 channels"),
    (PcmFormat(16000, 1, "f32le"), "encoding f32le"),
])
def test_only_16k_mono_s16le(fmt, msg):
    with pytest.raises(AudioFormatError, match=msg):
        check_format(fmt)
    check_format(PcmFormat(16000, 1, "s16le"))


def test_partial_samples_rejected_and_wav_roundtrip(tmp_path):
    with pytest.raises(AudioFormatError, match="whole number"):
        pcm_to_int16(b"\x00\x01\x02")
    x = (np.arange(1000) % 200 - 100).astype(np.int16)
    write_wav(tmp_path / "a.wav", x)
    y, fmt = read_wav(str(tmp_path / "a.wav"))
    assert fmt == PcmFormat(16000, 1, "s16le") and np.array_equal(y[:, 0], x)
