"""The Pipecat video service over Pipecat's own WebRTC transport (SmallWebRTCTransport,
aiortc) to headless Chromium, on loopback.

The agent (tests/pipecat_webrtc_agent.py, in the Pipecat client environment .venv-pipecat)
runs `transport.input() -> CharactersVideoService -> transport.output()` against the
in-process FakeWorker (tiny: 128x128 at 24 fps) and serves tests/pipecat_webrtc_page.html,
which connects through the SmallWebRTC offer/answer over HTTP and records every presented
frame (its size and mean colour), the voice's level per 10 ms and getStats. The
FakeWorker's frames are one colour whose green follows the step's audio (~145 with the
scripted speech, ~28 listening), so the page can tell a speaking frame from a listening
one. The test drives the agent over stdin (an utterance played out, a second one cut by an
InterruptionFrame) and measures, on the wall clock both sides read:

- the connection: page loaded -> offer posted (ICE gathering) -> answer applied (the agent's
  pipeline set up) -> connected (ICE and DTLS) -> first frame presented;
- first TTS audio at the service -> first speaking frame presented in the page and the voice
  heard (its level up), and the voice's offset from the video at the utterance's start and
  end (the audio's play-out time from AudioContext.getOutputTimestamp);
- interrupt -> the last speaking frame presented (and the voice's last loud 10 ms);
- frames per second: pushed by the service, handed to aiortc's video track by Pipecat's
  output transport, decoded in the page (getStats framesDecoded) and presented
  (requestVideoFrameCallback).

Skipped, with the reason, where Chromium is not installed (tools/install_browser.sh, as for
the viewer's test) or the Pipecat client environment cannot be made (the fixture of
tests/test_integrations_pipecat.py). CHARACTERS_PIPECAT_WEBRTC_REPORT=PATH writes the
figures as JSON.
"""

import asyncio
import itertools
import json
import os
import pathlib
import time

import numpy as np
import pytest
from test_integrations_pipecat import pipecat_python  # noqa: F401  (the fixture: the Pipecat client environment, made or skipped)
from test_view_browser import CHROMIUM, Browser, write_wav

from characters_jax.config import load_config
from characters_jax.demo.fakes import FakeWorker
from characters_jax.serving.worker import WorkerOptions

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed: run tools/install_browser.sh (root, Debian: apt-get install chromium)")

ROOT = pathlib.Path(__file__).resolve().parent.parent
AGENT = ROOT / "tests" / "pipecat_webrtc_agent.py"
PAGE = ROOT / "tests" / "pipecat_webrtc_page.html"
SPEAKING_GREEN = 45  # FakeVaeRuntime: green = 128 + 100 * the step's audio-token mean (~145 with the scripted speech, ~28 listening)
LOUD = 0.05  # the voice's peak |x| above which a 10 ms block is speech (the scripted TTS peaks near 0.2; silence is 0)
FRAMES_PER_CHUNK = 4  # the worker's frames per step
FPS = 24


class AgentProcess:
    """tests/pipecat_webrtc_agent.py in the Pipecat environment: commands in, JSON events out."""

    def __init__(self, python, worker_address: str, size: str, log_path: pathlib.Path):
        self.argv = [str(python), str(AGENT), worker_address, size, str(PAGE)]
        self.log_path = log_path
        self.events: list[dict] = []
        self._changed = asyncio.Condition()
        self.proc = self._reader = None
        self._log = open(log_path, "w")  # noqa: SIM115  (the agent's stderr; closed by close())

    async def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.proc = await asyncio.create_subprocess_exec(*self.argv, cwd=self.log_path.parent, env=env, stdin=asyncio.subprocess.PIPE,
                                                         stdout=asyncio.subprocess.PIPE, stderr=self._log)
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for line in self.proc.stdout:
            async with self._changed:
                self.events.append(json.loads(line))
                self._changed.notify_all()
        async with self._changed:
            self.events.append({"event": "exited"})
            self._changed.notify_all()

    async def wait(self, kind: str, timeout_s: float, count: int = 1) -> dict:
        """The count-th event of this kind (waits up to timeout_s for it)."""

        def found():
            return [e for e in self.events if e["event"] == kind][count - 1:] or [e for e in self.events if e["event"] == "exited"]

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(found), timeout_s)
            except TimeoutError:
                raise AssertionError(f"the agent sent no {kind!r} within {timeout_s:g} s: {self.tail()}") from None
            event = found()[0]
        assert event["event"] == kind, f"the agent exited before {kind!r}: {self.tail()}"
        return event

    async def send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()

    def tail(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-3000:]

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        if self.proc is not None:
            await self.proc.wait()
        if self._reader is not None:
            await self._reader
        self._log.close()


async def clock_offset(browser: Browser) -> tuple[float, float]:
    """(the page's wall clock - this process's, half the round trip), seconds: the quickest of five reads."""
    best = None
    for _ in range(5):
        a = time.time()
        page = await browser.eval("performance.timeOrigin + performance.now()") / 1000
        b = time.time()
        if best is None or (b - a) / 2 < best[1]:
            best = (page - (a + b) / 2, (b - a) / 2)
    return best


def speaking(frame) -> bool:
    return frame[5] > SPEAKING_GREEN


def connect_figures(page_marks: dict) -> dict:
    """Seconds between the page's connection steps (ms since the epoch, on the page's clock)."""
    steps = ("start", "offer", "answer", "connected", "firstFrame")
    out = {f"{a}_to_{b}_s": (page_marks[b] - page_marks[a]) / 1000 for a, b in itertools.pairwise(steps) if a in page_marks and b in page_marks}
    if "start" in page_marks and "firstFrame" in page_marks:
        out["start_to_firstFrame_s"] = (page_marks["firstFrame"] - page_marks["start"]) / 1000
    return out


def figures(m: dict, agent: dict, marks: dict) -> dict:
    """The figures from the page's records (ms since the epoch, on the page's clock) and the
    agent's (seconds, this process's clock); marks: the agent's event times."""
    off = marks["clock_offset_s"]
    frames = [[(f[0] / 1000) - off, *f[1:]] for f in m["frames"]]
    levels = [((t / 1000) - off, p) for t, p in m["levels"]]
    t_first = agent["first_tts_audio"]
    t_int = marks["interrupted"]
    out: dict = {"frames_presented": len(frames), "frame_sizes": sorted({(f[2], f[3]) for f in frames}), "connect": connect_figures(m["marks"])}

    before = [f for f in frames if f[0] < t_first[0]]
    out["listening_frames_before_speech"] = len(before)
    out["speaking_frames_before_speech"] = sum(map(speaking, before))  # the classifier's negative control
    out["greens"] = {"listening_median": float(np.median([f[5] for f in before])) if before else None}

    utterances = []
    for i, t0 in enumerate(t_first):
        end = t_first[i + 1] if i + 1 < len(t_first) else t_int
        mine = [f for f in frames if t0 <= f[0] < end]
        spoken = [f for f in mine if speaking(f)]
        loud = [t for t, p in levels if t0 <= t < end and p > LOUD]
        u = {"speaking_frames": len(spoken), "speaking_span_s": spoken[-1][0] - spoken[0][0] + 1 / FPS if spoken else 0.0,
             "tts_to_frame_s": spoken[0][0] - t0 if spoken else None,
             "tts_to_voice_s": loud[0] - t0 if loud else None,
             "service_latency_s": agent["service_latencies_s"][i] if i < len(agent["service_latencies_s"]) else None,
             "speaking_green_median": float(np.median([f[5] for f in spoken])) if spoken else None}
        if spoken and loud:
            u["voice_minus_frame_s"] = loud[0] - spoken[0][0]
            if i + 1 < len(t_first):  # played out: its last sound against its last picture
                u["voice_end_minus_frame_end_s"] = (loud[-1] + 0.01) - (spoken[-1][0] + 1 / FPS)
        utterances.append(u)
    out["utterances"] = utterances

    stale = [f for f in frames if f[0] >= t_int and speaking(f)]
    loud_after = [t for t, p in levels if t >= t_int and p > LOUD]
    after = [f for f in frames if f[0] >= t_int]
    listening_tail = next((k for k, f in enumerate(reversed(after)) if speaking(f)), len(after))
    out["interrupt"] = {"stale_frames": len(stale), "stale_at_s": [round(f[0] - t_int, 3) for f in stale], "interrupt_to_last_stale_s": (stale[-1][0] - t_int) if stale else 0.0,
                        "interrupt_to_voice_stop_s": (loud_after[-1] - t_int) if loud_after else 0.0,
                        "frames_after": len(after), "listening_frames_after": len(after) - len(stale), "listening_tail": listening_tail}

    polls = [s for s in m["stats"] if s.get("framesDecoded")]
    a, b = polls[0], polls[-1]
    out["service_fps"], out["drawn_fps"] = agent["service_fps"], agent["drawn_fps"]
    out["decoded_fps"] = (b["framesDecoded"] - a["framesDecoded"]) / ((b["t"] - a["t"]) / 1000)
    out["decoded_over_s"] = (b["t"] - a["t"]) / 1000
    out["frames_dropped"] = b.get("framesDropped")
    out["presented_fps"] = (len(frames) - 1) / (frames[-1][0] - frames[0][0])
    out["longest_gap_s"] = float(np.max(np.diff([f[0] for f in frames])))
    out["audio_samples_received"] = b.get("audioSamples")
    out["audio_energy"] = b.get("audioEnergy")
    return out


async def _run(python, worker_address: str, tmp: pathlib.Path) -> dict:
    agent = AgentProcess(python, worker_address, "128x128", tmp / "agent.log")
    mic = tmp / "silence.wav"  # the browser's fake microphone: nothing is sent
    write_wav(mic, np.zeros(4800, np.int16), 48000)
    browser = Browser(tmp, mic)
    marks: dict = {}
    t0 = time.monotonic()
    try:
        await agent.start()
        await browser.open()
        url = (await agent.wait("ready", 60))["url"]
        marks["agent_ready_s"] = time.monotonic() - t0
        await browser.cmd("Page.navigate", url=url)
        await browser.wait_for("!!window.peer && (window.peer.frames.length >= 24 || !!window.peer.error)", 30, "no video in the page")
        assert await browser.eval("window.peer.error") is None, await browser.eval("window.peer.error")
        await agent.wait("connected", 5)
        marks["first_video_s"] = time.monotonic() - t0
        off, half_rtt = await clock_offset(browser)
        marks["clock_offset_s"], marks["clock_offset_uncertainty_s"] = off, half_rtt

        def page_ms(t: float) -> float:
            return (t + off) * 1000

        def speaking_after(t: float) -> str:
            return f"window.peer.frames.filter((f) => f[0] > {page_ms(t)} && f[5] > {SPEAKING_GREEN}).length"

        def frames_after(t: float) -> str:
            return f"window.peer.frames.filter((f) => f[0] > {page_ms(t)}).length"

        # One utterance, played out: the TTSStoppedFrame leaves the transport after it.
        await agent.send("speak 1.5")
        t_stopped = (await agent.wait("stopped", 30))["t"]
        await browser.wait_for(f"{frames_after(t_stopped)} >= 12", 10, "the video did not go on after the utterance")

        # A second one, cut once the page shows it.
        await agent.send("speak 3.0")
        t_speak = (await agent.wait("speaking", 5, count=2))["t"]
        await browser.wait_for(f"{speaking_after(t_speak)} >= 12", 15, "the second utterance did not reach the page")
        await agent.send("interrupt")
        marks["interrupted"] = (await agent.wait("interrupted", 5))["t"]
        await browser.wait_for(f"{frames_after(marks['interrupted'])} >= 36", 15, "the video did not go on after the interrupt")
        m = await browser.eval("window.peer.metrics()")
        (tmp / "page.json").write_text(json.dumps(m))

        await agent.send("end")
        done = await agent.wait("done", 40)
        marks["test_s"] = time.monotonic() - t0
    finally:
        await browser.close()
        await agent.close()
    out = figures(m, done, marks)
    out["agent"] = {k: done[k] for k in ("errors", "service_latencies_s", "images_out", "images_written", "images_drawn", "audio_written_s", "stopped", "tasks_left",
                                         "interrupt")}
    out["marks"] = {k: round(v, 4) for k, v in marks.items() if k != "interrupted"}
    out["page_state"] = m["state"]
    return out


@pytest.fixture(scope="module")
def worker():
    w = FakeWorker(load_config("tiny"), WorkerOptions(idle_timeout_s=60))
    yield w
    w.close()


def test_character_over_smallwebrtc_in_headless_chromium(pipecat_python, worker, tmp_path):  # noqa: F811
    r = asyncio.run(_run(pipecat_python, worker.address, tmp_path))
    print(json.dumps(r, indent=1))
    if os.environ.get("CHARACTERS_PIPECAT_WEBRTC_REPORT"):
        pathlib.Path(os.environ["CHARACTERS_PIPECAT_WEBRTC_REPORT"]).write_text(json.dumps(r, indent=1))

    assert r["agent"]["errors"] == [] and r["agent"]["stopped"] == 1 and r["agent"]["tasks_left"] == [], r["agent"]
    assert r["page_state"] == "connected", r["page_state"]
    assert set(r["connect"]) >= {"answer_to_connected_s", "start_to_firstFrame_s"}, r["connect"]
    assert r["frame_sizes"] == [(128, 128)], r["frame_sizes"]
    # The classifier: listening frames before any speech, speaking ones while the TTS speaks.
    assert r["listening_frames_before_speech"] >= 24 and r["speaking_frames_before_speech"] == 0, r
    first, second = r["utterances"]
    # 1.5 s of speech shown for 1.5 s (36 frames at 24 fps; Pipecat draws fewer under load)
    assert 1.4 <= first["speaking_span_s"] <= 2.0 and first["speaking_frames"] >= 24, first
    assert first["tts_to_frame_s"] is not None and first["tts_to_frame_s"] < 2.0, first
    assert first["tts_to_voice_s"] is not None and second["tts_to_voice_s"] is not None, r["utterances"]  # the voice arrives
    assert r["audio_samples_received"] > 0 and r["audio_energy"] > 0, r
    # The voice plays with its pictures (the service's one clock, Pipecat's sync_with_audio) up
    # to the path's offset: the voice waits in Chromium's audio jitter buffer and WebAudio while
    # the video shows at once (aiortc stamps the video on a 30 fps RTP clock whatever its rate,
    # which gives the receiver's lip sync nothing true to go by); 0.05-0.18 s here, up to
    # ~0.45 s with the machine loaded.
    assert abs(first["voice_minus_frame_s"]) < 1.0 and abs(first["voice_end_minus_frame_end_s"]) < 1.0, first
    # The interrupt: the speaking frames stop within one chunk of the interrupt over this path
    # (what was on its way, transit measured at the utterances' starts, and the last picture
    # redrawn until the worker's listening frames arrive); the voice stops as late after that as
    # it plays after its pictures; the video goes on.
    transit = max(max(0.0, u["tts_to_frame_s"] - u["service_latency_s"]) for u in r["utterances"])
    stale_bound = transit + (FRAMES_PER_CHUNK + 1) / FPS
    voice_lag = max(first["voice_minus_frame_s"], first["voice_end_minus_frame_end_s"], second["voice_minus_frame_s"])
    i = r["interrupt"]
    assert i["interrupt_to_last_stale_s"] <= stale_bound, (i, transit)
    assert i["interrupt_to_voice_stop_s"] <= stale_bound + voice_lag, (i, stale_bound, voice_lag)  # 2.5 s of the utterance were left
    assert i["listening_tail"] >= 12, i  # half a second and more of listening video to end with
    # The service pushes 24 fps. Pipecat's output transport redraws its latest picture and then
    # sleeps 1/24 s, so it draws a little under 24 (23.3 here, ~21 with the machine loaded);
    # the page decodes what it drew, every frame.
    assert 23 <= r["service_fps"] <= 25, r["service_fps"]
    assert abs(r["decoded_fps"] / r["drawn_fps"] - 1) < 0.1, (r["decoded_fps"], r["drawn_fps"])
    assert 15 <= r["presented_fps"] <= 25, r["presented_fps"]
