"""Real Pipecat pipelines around CharactersVideoService, run in the Pipecat client
environment (.venv-pipecat) by tests/test_integrations_pipecat.py; prints one JSON object.

    python tests/pipecat_pipeline.py SCENARIO WORKER_ADDRESS

Scenarios (the TTS is scripted: 24 kHz mono in 20 ms frames at real-time pace with +-5 ms of
seeded jitter, or faster where named):
  speak      two utterances, the second interrupted mid-way by an InterruptionFrame: the
             latency from the first TTS audio to the first speaking frame out, the time from
             the interrupt to the last stale frame, the TTSStoppedFrame after playback.
  long       over 60 s of conversation on a clock 4x faster than real time (utterances and
             pauses): the audio/video offset of every published frame and its drift.
  bad_audio  a TTS frame with half a sample, then good audio at 48 kHz stereo.
  unreachable a worker address where nothing listens.
"""

import asyncio
import json
import sys
import time

import numpy as np
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    OutputImageRawFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner
from PIL import Image

from characters_jax.integrations.pipecat import CharactersVideoService
from characters_jax.integrations.playout import PlayoutOptions, ScaledClock

TTS_RATE = 24000
SEED = 7


def png() -> bytes:
    import io

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (120, 160, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def tts_audio(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * TTS_RATE)) / TTS_RATE
    return (np.sin(2 * np.pi * 180 * t) * 6000 + rng.standard_normal(t.size) * 300).astype(np.int16)


class Recorder(FrameProcessor):
    """The end (or the start) of the pipeline: records the frames flowing one way, with the
    monotonic time each arrived."""

    def __init__(self, direction: FrameDirection):
        super().__init__()
        self.direction = direction
        self.frames: list[tuple[float, Frame]] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if direction == self.direction and not isinstance(frame, StartFrame):
            self.frames.append((time.monotonic(), frame))
        await self.push_frame(frame, direction)


async def say(worker: PipelineWorker, seconds: float, seed: int, clock_speed: float = 1.0) -> float:
    """Queues an utterance's TTS frames at real-time pace (on a clock `clock_speed` times
    faster) with +-5 ms of jitter; returns when the first frame was queued."""
    pcm = tts_audio(seconds, seed)
    rng = np.random.default_rng(seed)
    step = TTS_RATE // 50
    await worker.queue_frame(TTSStartedFrame())
    t0 = time.monotonic()
    for i, off in enumerate(range(0, len(pcm), step)):
        due = t0 + ((i + 1) * 0.02 + rng.uniform(-0.005, 0.005)) / clock_speed
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        await worker.queue_frame(TTSAudioRawFrame(audio=pcm[off: off + step].tobytes(), sample_rate=TTS_RATE, num_channels=1))
    await worker.queue_frame(TTSStoppedFrame())
    return t0


async def wait_for(predicate, timeout: float) -> bool:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            return False
        await asyncio.sleep(0.01)
    return True


async def run(scenario: str, address: str) -> dict:
    clock = ScaledClock(4.0) if scenario == "long" else None
    options = PlayoutOptions(open_timeout_s=3.0 if scenario == "unreachable" else 60.0)
    video = CharactersVideoService(target=address, image=png(), clock=clock, options=options)
    up, down = Recorder(FrameDirection.UPSTREAM), Recorder(FrameDirection.DOWNSTREAM)
    worker = PipelineWorker(Pipeline([up, video, down]), cancel_on_idle_timeout=False, params=PipelineParams())
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def _started(_worker, _frame):
        started.set()

    out: dict = {"scenario": scenario}

    def images():
        return [(t, f) for t, f in down.frames if isinstance(f, OutputImageRawFrame)]

    def speech_out():
        return [(t, f) for t, f in down.frames if isinstance(f, TTSAudioRawFrame)]

    async def drive():
        await asyncio.wait_for(started.wait(), 30)
        if scenario == "unreachable":
            await wait_for(lambda: up.frames, 10)
        elif scenario == "speak":
            await wait_for(lambda: len(images()) >= 24, 30)  # listening video first
            t_first = await say(worker, 1.5, SEED)
            await wait_for(lambda: any(isinstance(f, TTSStoppedFrame) for _, f in down.frames), 30)
            out["stopped_after_playback"] = any(isinstance(f, TTSStoppedFrame) for _, f in down.frames)
            out["first_latency_s"] = next(t for t, _ in speech_out()) - t_first
            n_before = len(speech_out())
            talking = asyncio.create_task(say(worker, 3.0, SEED + 1))
            await wait_for(lambda: len(speech_out()) > n_before + 12, 30)  # the second utterance is playing
            talking.cancel()  # the TTS stops where the user barges in
            t_int = time.monotonic()
            await worker.queue_frame(InterruptionFrame())
            await asyncio.sleep(1.0)
            after = [t for t, _ in speech_out() if t > t_int]
            out["stale_frames"] = len(after)
            out["interrupt_to_last_stale_s"] = (max(after) - t_int) if after else 0.0
            out["images_after_interrupt"] = len([1 for t, _ in images() if t > t_int])
        elif scenario == "long":
            await wait_for(lambda: len(images()) >= 24, 30)
            rng = np.random.default_rng(SEED)
            for k in range(9):  # 9 x (5-6 s of speech + 1-2 s of listening): over 60 s of media
                await say(worker, float(rng.uniform(5, 6)), SEED + k, clock_speed=4.0)
                await asyncio.sleep(float(rng.uniform(1, 2)) / 4.0)
            await wait_for(lambda: sum(isinstance(f, TTSStoppedFrame) for _, f in down.frames) >= 9, 60)
        elif scenario == "bad_audio":
            await wait_for(lambda: len(images()) >= 4, 30)
            await worker.queue_frame(TTSAudioRawFrame(audio=b"\x01\x02\x03", sample_rate=TTS_RATE, num_channels=1))
            await wait_for(lambda: up.frames, 10)
            stereo = np.repeat(tts_audio(1.0, SEED)[:, None], 2, axis=1)
            await worker.queue_frame(TTSAudioRawFrame(audio=stereo.tobytes(), sample_rate=48000, num_channels=2))
            await worker.queue_frame(TTSStoppedFrame())
            out["played_converted"] = await wait_for(lambda: speech_out(), 30)
        await worker.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    t0 = time.monotonic()
    await asyncio.wait_for(asyncio.gather(runner.run(), drive()), 120)
    out["run_s"] = time.monotonic() - t0
    out["errors"] = [f.error for _, f in up.frames if isinstance(f, ErrorFrame)]
    out["images"] = len(images())
    out["speech_frames"] = len(speech_out())
    out["latencies_s"] = video.latencies_s
    out["session_final"] = None if video.session.final is None else int(video.session.final.end_reason)
    out["tasks_left"] = sorted(t.get_name() for t in asyncio.all_tasks() if t is not asyncio.current_task())
    if scenario == "long":
        out.update(av_offsets(down.frames, clock))
    return out


def av_offsets(frames, clock: ScaledClock) -> dict:
    """One clock: each image's presentation time against the audio published before it
    (listening ticks publish no audio: their frame period counts as silence), and the
    image's pts against its push time on the clock (the pacing's drift)."""
    audio_samples = 0
    offsets, lateness = [], []
    n_images = 0
    last_pts = None
    for t, f in frames:
        if isinstance(f, TTSAudioRawFrame):
            audio_samples += f.num_frames
            last_pts = f.pts
        elif isinstance(f, OutputImageRawFrame):
            if last_pts != f.pts:  # a listening tick: its period plays silence
                audio_samples += (n_images + 1) * 16000 // 24 - n_images * 16000 // 24
            n_images += 1
            offsets.append(audio_samples / 16000 - n_images / 24)
            lateness.append((t - clock._t0) * clock.speed - f.pts / 1e9)
    lat = np.asarray(lateness)
    lat = lat - lat[0]
    slope = float(np.polyfit(np.arange(len(lat)) / 24, lat, 1)[0]) if len(lat) > 2 else 0.0
    return {"media_s": n_images / 24, "av_offset_max_s": float(np.max(np.abs(offsets))) if offsets else None,
            "push_jitter_p99_s": float(np.percentile(np.abs(lat), 99)) if len(lat) else None, "pacing_drift_s_per_min": slope * 60}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(run(sys.argv[1], sys.argv[2]))))
