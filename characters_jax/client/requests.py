"""The requests of a Converse stream, built for the client library."""

from __future__ import annotations

import numpy as np

from characters_jax.protos_gen import characters_pb2 as pb
from characters_jax.wire.service import PCM_FORMAT


def start_request(*, session_id: str = "", session_token: str = "", image: bytes | None = None, prompt: str = "", seed: int = 0,
                  limits: pb.SessionLimits | None = None, playout_reports: bool = True, begin_with_speech: bool = False,
                  audio_format: pb.AudioFormat = PCM_FORMAT, jitter_buffer_s: float | None = None, resumable: bool = True) -> pb.ConverseRequest:
    """The `start` of a Converse stream: of a session made by CreateSession (session_id and
    its session_token), or opening one (image, prompt, seed, limits). jitter_buffer_s: the
    session's input jitter buffer (None: the worker's; -1: adaptive). resumable: the
    client's conversation resumes the session elsewhere when its worker drains or fails
    (the library's conversations do: client/resume.py)."""
    start = pb.ConverseRequest.Start(audio_format=audio_format, playout_reports=playout_reports, begin_with_speech=begin_with_speech,
                                     resumable=resumable)
    if jitter_buffer_s is not None:
        start.jitter_buffer_s = jitter_buffer_s
    if session_id:
        start.session_id = session_id
        start.session_token = session_token
    else:
        start.create.CopyFrom(pb.CreateSessionRequest(image=image or b"", prompt=prompt, seed=seed, limits=limits))
    return pb.ConverseRequest(start=start)


def audio_request(pcm) -> pb.ConverseRequest:
    data = pcm if isinstance(pcm, (bytes, bytearray)) else np.asarray(pcm, "<i2").tobytes()
    return pb.ConverseRequest(audio=pb.ConverseRequest.AudioChunk(pcm=bytes(data)))


def playout_request(frames_played: int, underruns: int) -> pb.ConverseRequest:
    return pb.ConverseRequest(playout=pb.ConverseRequest.PlayoutReport(frames_played=frames_played, underruns=underruns))


def interrupt_request(frames_played: int | None = None, underruns: int = 0) -> pb.ConverseRequest:
    it = pb.ConverseRequest.Interrupt()
    if frames_played is not None:
        it.playout.CopyFrom(pb.ConverseRequest.PlayoutReport(frames_played=frames_played, underruns=underruns))
    return pb.ConverseRequest(interrupt=it)


END_OF_SPEECH = pb.ConverseRequest(end_of_speech=pb.ConverseRequest.EndOfSpeech())
END_OF_AUDIO = pb.ConverseRequest(end_of_audio=pb.ConverseRequest.EndOfAudio())
SNAPSHOT = pb.ConverseRequest(snapshot=pb.ConverseRequest.SnapshotRequest())
