"""MP4 out via PyAV: H.264 video (yuv420p) plus the session's audio as AAC."""

from __future__ import annotations

import fractions

import numpy as np


def write_mp4(path, frames: list[np.ndarray], audio: np.ndarray, fps: int = 24, sample_rate: int = 16000) -> None:
    """frames: [H, W, 3] uint8 each (H, W even); audio: int16 mono [n]."""
    import av

    def audio_frame(piece: np.ndarray):
        af = av.AudioFrame.from_ndarray(piece[None, :], format="fltp", layout="mono")
        af.sample_rate = sample_rate
        return af

    with av.open(str(path), "w") as out:
        v = out.add_stream("libx264", rate=fps)
        h, w, _ = frames[0].shape
        v.width, v.height, v.pix_fmt = w, h, "yuv420p"
        v.options = {"crf": "20", "preset": "veryfast"}
        a = out.add_stream("aac", rate=sample_rate, layout="mono")
        _encode(out, v, ((av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24"), i)
                         for i, f in enumerate(frames)), fractions.Fraction(1, fps))
        n = a.codec_context.frame_size or 1024
        samples = np.asarray(audio, np.int16).astype(np.float32) / 32768.0
        _encode(out, a, ((audio_frame(samples[i : i + n]), i) for i in range(0, len(samples), n)),
                fractions.Fraction(1, sample_rate))


def _encode(out, stream, frames, time_base: fractions.Fraction) -> None:
    """Encodes (frame, pts) pairs (pts in `time_base`) into `stream`, muxing its packets into
    `out`, then flushes the encoder."""
    for frame, pts in frames:
        frame.pts = pts
        frame.time_base = time_base
        for p in stream.encode(frame):
            out.mux(p)
    for p in stream.encode():
        out.mux(p)


def probe_mp4(path) -> dict:
    """Counts what an MP4 holds: {"video_frames", "width", "height", "audio_streams", "audio_seconds"}."""
    import av

    with av.open(str(path)) as c:
        vs = c.streams.video[0]
        n = sum(1 for _ in c.decode(vs))
    with av.open(str(path)) as c:
        audio_samples = 0
        rate = 0
        if c.streams.audio:
            rate = c.streams.audio[0].rate
            audio_samples = sum(fr.samples for fr in c.decode(c.streams.audio[0]))
        return {"video_frames": n, "width": vs.width, "height": vs.height, "audio_streams": len(c.streams.audio), "audio_seconds": audio_samples / rate if rate else 0.0}
