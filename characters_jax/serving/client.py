"""Client library: create a session, stream audio at real-time pace, receive video chunks.

    client = CharacterClient("localhost:50051")
    session = client.create_session(open("face.png", "rb").read(), prompt="hello")
    result = client.converse(session.session_id, pcm_int16)
    write_mp4("out.mp4", result.frames, result.audio, fps=24)

`converse` keeps a playout buffer (PlayoutClock) and reports its position to the worker,
which paces to it. RPC errors surface as grpc.RpcError with the worker's status code.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

import grpc
import numpy as np

from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.protos_gen import characters_pb2_grpc
from characters_jax.serving.playout import PlayoutClock

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 16 << 20)]


@dataclasses.dataclass
class ConverseResult:
    """Everything a session returned, and the client-side measurements."""

    chunks: list  # VideoChunk protos (frames left as bytes)
    final_event: object  # SessionEvent or None
    recv_times: list[float]  # monotonic arrival time of each chunk
    send_times: np.ndarray  # [n_sent_chunks, 2]: (end sample, monotonic send time)
    underruns: int
    frames_played: int
    stall_s: float
    t_start: float

    @property
    def frames(self) -> list[np.ndarray]:
        """All frames, [H, W, 3] uint8 each, in order."""
        return [np.frombuffer(f, np.uint8).reshape(c.height, c.width, 3) for c in self.chunks for f in c.frames]

    @property
    def audio(self) -> np.ndarray:
        """The audio slices of all chunks, concatenated: int16 [n]."""
        return np.concatenate([np.frombuffer(c.audio_pcm, "<i2") for c in self.chunks]) if self.chunks else np.zeros(0, np.int16)

    def sample_send_time(self, sample: int) -> float:
        """When the client sent the audio chunk holding `sample`."""
        i = int(np.searchsorted(self.send_times[:, 0], sample, side="right"))
        return float(self.send_times[min(i, len(self.send_times) - 1), 1])

    def summary(self, fps: int) -> dict:
        c = self.chunks
        out: dict = {"steps": len(c), "frames": sum(len(x.frames) for x in c), "playout_underruns": self.underruns, "playout_stall_s": round(self.stall_s, 3)}
        if len(c) >= 2:
            span = self.recv_times[-1] - self.recv_times[0]
            out["sustained_fps"] = round((out["frames"] - len(c[0].frames)) / span, 2) if span > 0 else None
        for key, vals in (("step", [x.diffusion_ms for x in c]), ("decode", [x.decode_ms for x in c]), ("period", [x.step_period_ms for x in c[1:]])):
            if vals:
                out[f"{key}_ms_p50"] = round(float(np.percentile(vals, 50)), 2)
                out[f"{key}_ms_p99"] = round(float(np.percentile(vals, 99)), 2)
        if len(self.send_times) and c:
            lat = [t - self.sample_send_time(x.audio_first_sample) for x, t in zip(c, self.recv_times)]
            out["audio_to_frame_latency_s_first"] = round(lat[0], 3)
            out["audio_to_frame_latency_s_p50"] = round(float(np.percentile(lat, 50)), 3)
            out["audio_to_frame_latency_s_p99"] = round(float(np.percentile(lat, 99)), 3)
        if self.final_event is not None:
            out["final_state"] = pb.SessionState.Name(self.final_event.state)
        return out


class CharacterClient:
    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = characters_pb2_grpc.CharacterServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def wait_ready(self, timeout: float) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def create_session(self, image: bytes, prompt: str = "", seed: int = 0, timeout: float = 180.0) -> pb.Session:
        return self.stub.CreateSession(pb.CreateSessionRequest(image=image, prompt=prompt, seed=seed), timeout=timeout)

    def get_session(self, session_id: str, timeout: float = 10.0) -> pb.Session:
        return self.stub.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=timeout)

    def close_session(self, session_id: str, timeout: float = 10.0) -> pb.Session:
        return self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=timeout)

    def converse(
        self,
        session_id: str,
        pcm: np.ndarray | bytes,
        *,
        fps: int = 24,
        realtime: bool = True,
        send_realtime: bool | None = None,
        chunk_ms: int = 20,
        sample_rate: int = 16000,
        channels: int = 1,
        encoding: int = pb.AudioFormat.PCM_S16LE,
        prebuffer_frames: int = 8,
        on_chunk=None,
        stop_after_chunks: int | None = None,
        timeout: float | None = None,
    ) -> ConverseResult:
        """Streams `pcm` (int16 mono samples, or raw bytes sent as they are) and collects the video.

        realtime: send audio at its real pace and play out at `fps` (else: send at once,
        count frames as played on arrival); send_realtime overrides the sending half. stop_after_chunks: cancel the RPC after that many
        chunks (a client that goes away). Raises grpc.RpcError on a non-OK status."""
        send_realtime = realtime if send_realtime is None else send_realtime
        data = pcm if isinstance(pcm, (bytes, bytearray)) else np.asarray(pcm, "<i2").tobytes()
        bytes_per_sample = 2 * max(channels, 1)
        step_bytes = max(bytes_per_sample, int(sample_rate * chunk_ms / 1000) * bytes_per_sample)
        outbox: queue.Queue = queue.Queue()
        done = threading.Event()
        sent: list[tuple[int, float]] = []

        def report(played, under):
            outbox.put(pb.ConverseRequest(playout=pb.ConverseRequest.PlayoutReport(frames_played=played, underruns=under)))

        clock = PlayoutClock(fps, prebuffer_frames, realtime, on_report=report)

        def requests():
            fmt = pb.AudioFormat(sample_rate_hz=sample_rate, channels=channels, encoding=encoding)
            yield pb.ConverseRequest(start=pb.ConverseRequest.Start(session_id=session_id, audio_format=fmt, playout_reports=True))
            t0 = time.monotonic()
            for off in range(0, len(data), step_bytes):
                if done.is_set():
                    return
                if send_realtime:
                    due = t0 + off / bytes_per_sample / sample_rate
                    while True:  # the microphone's pace; playout reports go out meanwhile
                        wait = due - time.monotonic()
                        if wait <= 0:
                            break
                        try:
                            yield outbox.get(timeout=wait)
                        except queue.Empty:
                            break
                while not outbox.empty():
                    yield outbox.get_nowait()
                piece = data[off : off + step_bytes]
                sent.append(((off + len(piece)) // bytes_per_sample, time.monotonic()))
                yield pb.ConverseRequest(audio=pb.ConverseRequest.AudioChunk(pcm=piece))
            yield pb.ConverseRequest(end_of_audio=pb.ConverseRequest.EndOfAudio())
            while not done.is_set():
                try:
                    yield outbox.get(timeout=0.05)
                except queue.Empty:
                    pass

        chunks, recv, final = [], [], None
        t_start = time.monotonic()
        call = self.stub.Converse(requests(), timeout=timeout)
        try:
            for resp in call:
                if resp.WhichOneof("event") == "chunk":
                    chunks.append(resp.chunk)
                    recv.append(time.monotonic())
                    clock.add_frames(len(resp.chunk.frames))
                    if on_chunk:
                        on_chunk(resp.chunk)
                    if stop_after_chunks is not None and len(chunks) >= stop_after_chunks:
                        call.cancel()
                        break
                else:
                    final = resp.session_event
        finally:
            done.set()
            clock.end()
        clock.wait_drained(timeout=30)
        return ConverseResult(chunks, final, recv, np.asarray(sent, dtype=np.float64).reshape(-1, 2), clock.underruns, clock.played, clock.stall_s, t_start)
