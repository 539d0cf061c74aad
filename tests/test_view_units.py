"""The viewer's parts on their own: resampling against float64 references, the playout clock
(pacing, underruns, catch-up, flush, the voice aligned with its frames), the loopback-only
ICE (SDP filter; two aiortc peers that gather on 127.0.0.1 alone), the per-frame peaks."""

import asyncio
import time

import numpy as np
import pytest

pytest.importorskip("aiortc", reason="the viewer needs aiortc: pip install aiortc (see pyproject's view extra)")

from characters_jax.audio.timeline import Timeline  # noqa: E402
from characters_jax.viewer.bridge import frame_peaks  # noqa: E402
from characters_jax.viewer.ice import OfferError, gather_on, loopback_offer  # noqa: E402
from characters_jax.viewer.media import MicResampler, TrackPlayoutClock, PlayoutEnded, Upsampler  # noqa: E402

SEED = 20261204


def band_limited(rng, rate: int, n: int, top_hz: float, tones: int = 24):
    """A sum of random sinusoids below top_hz: (int16 samples, f(t) -> float64 reference)."""
    f = rng.uniform(40, top_hz, tones)
    ph = rng.uniform(0, 2 * np.pi, tones)
    a = rng.uniform(0.2, 1.0, tones)
    a *= 0.6 * 32767 / a.sum()

    def at(t):
        return (a[None, :] * np.sin(2 * np.pi * f[None, :] * np.asarray(t)[:, None] + ph[None, :])).sum(1)

    return np.rint(at(np.arange(n) / rate)).astype(np.int16), at


def test_upsampler_matches_band_limited_interpolation_block_by_block():
    rng = np.random.default_rng(SEED)
    x, exact = band_limited(rng, 16000, 8000, top_hz=6000)
    up = Upsampler(3)
    pieces, i = [], 0
    while i < x.size:  # random block sizes, as chunks arrive
        n = int(rng.integers(1, 3000))
        out = up(x[i : i + n])
        assert out.dtype == np.int16 and out.size == 3 * x[i : i + n].size
        pieces.append(out)
        i += n
    y = np.concatenate(pieces).astype(np.float64)
    # output sample j is the input at time j / 48000 - half_width / 16000
    t = np.arange(y.size) / 48000 - up.half_width / 16000
    ok = slice(3 * 2 * up.half_width, None)  # past the filter's start-up
    err = np.abs(y[ok] - exact(t[ok]))
    assert err.max() < 0.01 * 32767, err.max()  # within 1% of full scale, on fresh random tones up to 6 kHz
    one = Upsampler(3)(x).astype(np.int64)
    assert np.abs(one - np.concatenate(pieces)).max() <= 1  # block boundaries change nothing but rounding


def test_mic_resampler_48k_stereo_to_16k_mono():
    import av

    rng = np.random.default_rng(SEED)
    f0 = float(rng.uniform(300, 3000))
    res = MicResampler(16000)
    n_frames, out = 50, b""
    for k in range(n_frames):  # 20 ms frames, as aiortc's Opus decoder hands them out
        t = (np.arange(960) + 960 * k) / 48000
        s = (0.5 * 32767 * np.sin(2 * np.pi * f0 * t)).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(np.stack([s, s], 1).reshape(1, -1), format="s16", layout="stereo")
        frame.sample_rate = 48000
        out += res(frame)
    y = np.frombuffer(out, "<i2").astype(np.float64)
    assert abs(y.size - n_frames * 320) <= 64  # the resampler holds back a few samples at most
    spec = np.abs(np.fft.rfft(y[200:] * np.hanning(y.size - 200)))
    peak_hz = np.argmax(spec) * 16000 / (y.size - 200)
    assert abs(peak_hz - f0) < 16000 / (y.size - 200) * 1.5, (peak_hz, f0)
    assert 0.4 * 32767 < np.abs(y[200:]).max() < 0.6 * 32767


def _frames(first: int, n: int, h=2, w=2):
    return [np.full((h, w, 3), (first + i) % 256, np.uint8) for i in range(n)]


def _audio_for(first: int, n: int, per_frame: int):
    """Audio whose samples hold the index of the frame they belong to."""
    return np.repeat(np.arange(first, first + n, dtype=np.int16), per_frame)


def test_playout_paces_frames_and_audio_on_one_clock_and_stalls_on_underrun():
    fps, rate = 50, 16000  # 20 ms frames; 320 samples each
    per = rate // fps

    async def run():
        p = TrackPlayoutClock(fps, rate, prebuffer_frames=8, catchup_frames=4, catchup_after_s=10.0)
        got, audio = [], []

        async def produce():  # a chunk every 80 ms (real time), chunk 4 200 ms late: 120 ms past the 80 ms of slack
            for c in range(6):
                await p.push(_frames(4 * c, 4), _audio_for(4 * c, 4, per))
                await asyncio.sleep(0.080 if c != 2 else 0.280)
            await p.end()

        async def video():
            try:
                while True:
                    k, f = await p.next_frame()
                    got.append((k, int(f[0, 0, 0]), time.monotonic() - p.due(k / fps)))
            except PlayoutEnded:
                pass

        async def voice():
            try:
                while True:
                    s, pcm = await p.next_audio(per)
                    audio.append((s, pcm.copy(), time.monotonic() - p.due(s / rate)))
            except PlayoutEnded:
                pass

        await asyncio.gather(produce(), video(), voice())
        return p, got, audio

    p, got, audio = asyncio.run(run())
    assert [k for k, _, _ in got] == list(range(24)) and all(v == k for k, v, _ in got)
    late = np.array([x for _, _, x in got])
    assert late.min() > -0.002 and np.median(late) < 0.01, late  # never early, on time when there
    # one stall, from frame 12's due time (0.32 s) until the buffer holds 8 frames again (chunk 5, at 0.52 s)
    assert p.underruns == 1 and 0.15 < p.stalled_s < 0.3, (p.underruns, p.stalled_s)
    for s, pcm, _ in audio:  # each packet holds the audio of the frames at its media time
        assert np.array_equal(pcm, np.arange(s, s + per) // per), s
    assert np.median([x for _, _, x in audio]) < 0.01


def test_playout_catches_up_a_buffer_left_over_its_target():
    fps, rate = 50, 16000
    per = rate // fps

    async def run():
        p = TrackPlayoutClock(fps, rate, prebuffer_frames=4, catchup_frames=4, catchup_after_s=0.05)
        await p.push(_frames(0, 20), _audio_for(0, 20, per))  # a burst: 20 frames at once
        await p.end()
        frames = []
        try:
            while True:
                frames.append((await p.next_frame())[0])
        except PlayoutEnded:
            pass
        return p, frames

    p, frames = asyncio.run(run())
    assert p.catchups >= 1
    assert frames == sorted(frames) and len(frames) == 20 - 4 * p.catchups
    jumps = np.diff(frames)
    assert set(jumps.tolist()) == {1, 5}  # whole chunks dropped, in one step each


def test_playout_flush_drops_what_it_holds_and_continues_the_playback_timeline():
    fps, rate = 50, 16000
    per = rate // fps

    async def run():
        p = TrackPlayoutClock(fps, rate, prebuffer_frames=4, catchup_frames=4, catchup_after_s=10.0)
        await p.push(_frames(0, 12), _audio_for(0, 12, per))
        played = [(await p.next_frame())[0] for _ in range(3)]
        await p.flush()
        assert p.buffered_frames == 0
        first = await p.push(_frames(100, 4), _audio_for(100, 4, per))
        nxt = [await p.next_frame() for _ in range(4)]
        return p, played, first, nxt

    p, played, first, nxt = asyncio.run(run())
    assert played == [0, 1, 2] and first == 3
    assert [k for k, _ in nxt] == [3, 4, 5, 6] and [int(f[0, 0, 0]) for _, f in nxt] == [100, 101, 102, 103]
    assert p.underruns == 0


CHROMIUM_OFFER = """v=0\r
o=- 1 2 IN IP4 127.0.0.1\r
s=-\r
t=0 0\r
m=audio 9 UDP/TLS/RTP/SAVPF 111\r
a=candidate:1 1 udp 2122194687 127.0.0.1 52601 typ host generation 0\r
a=candidate:2 1 udp 2122063615 192.0.2.2 34635 typ host generation 0\r
a=candidate:3 1 udp 2122267903 ::1 57923 typ host generation 0\r
a=candidate:4 1 tcp 1518214911 127.0.0.1 9 typ host tcptype active generation 0\r
a=candidate:5 1 udp 2122063615 5f0c2a9e-1b2c-4d5e.local 40001 typ host generation 0\r
"""


def test_loopback_offer_keeps_only_loopback_udp_candidates():
    kept = [line for line in loopback_offer(CHROMIUM_OFFER).split("\r\n") if line.startswith("a=candidate")]
    assert [line.split()[4] for line in kept] == ["127.0.0.1", "::1"]
    without = "".join(line + "\r\n" for line in CHROMIUM_OFFER.split("\r\n") if "127.0.0.1" not in line and "::1" not in line)
    with pytest.raises(OfferError, match="allow-loopback-in-peer-connection"):
        loopback_offer(without)


def test_two_peers_that_gather_on_loopback_alone_connect():
    from aiortc import RTCConfiguration, RTCPeerConnection

    async def run():
        a, b = RTCPeerConnection(RTCConfiguration(iceServers=[])), RTCPeerConnection(RTCConfiguration(iceServers=[]))
        got = asyncio.get_running_loop().create_future()
        ch = a.createDataChannel("events")
        ch.on("open", lambda: ch.send("hello over 127.0.0.1"))
        b.on("datachannel", lambda c: c.on("message", lambda m: got.done() or got.set_result(m)))
        await gather_on(a)
        await a.setLocalDescription(await a.createOffer())
        await b.setRemoteDescription(a.localDescription)
        await gather_on(b)
        await b.setLocalDescription(await b.createAnswer())
        await a.setRemoteDescription(b.localDescription)
        msg = await asyncio.wait_for(got, 10)
        sdps = [a.localDescription.sdp, b.localDescription.sdp]
        await a.close()
        await b.close()
        return msg, sdps

    msg, sdps = asyncio.run(run())
    assert msg == "hello over 127.0.0.1"
    for sdp in sdps:
        addresses = {line.split()[4] for line in sdp.splitlines() if line.startswith("a=candidate")}
        assert addresses == {"127.0.0.1"}, addresses


def test_frame_peaks_follow_the_timeline():
    rng = np.random.default_rng(SEED)
    tl = Timeline(16000, 24, 4)
    step = 5
    lo, hi = tl.step_span(step)
    audio = rng.integers(-20000, 20000, hi - lo).astype(np.int16)
    peaks = frame_peaks(audio, lo, step * 4, 4, 16000, 24)
    want = [np.abs(audio[tl.frame_start(k) - lo : tl.frame_start(k + 1) - lo].astype(np.int64)).max() / 32768 for k in range(step * 4, step * 4 + 4)]
    assert np.allclose(peaks, want, atol=1e-4)
