"""The worker's side of the decoder process: image encoding and one Decode stream per session.

`DecoderLink.submit(step, latent)` queues a device latent; the stream's request iterator
copies it to the host (this is where the worker waits for step n's compute, in the stream's
thread, while the step loop has already dispatched step n + 1) and sends it. Decoded chunks
come back on `on_chunk(step, frames, decode_ms, diffusion_ms)`; a failed stream calls
`on_error(message)` once. `request_state(step, on_state)` asks, in order after the latents
queued before it, for the stream's temporal state (a snapshot's), which comes back on
`on_state(arrays, error)`; a stream may start from a state (`initial_state`: a resumed
session's).

The link carries no TLS and no authentication, so it stays on this machine: a Unix socket or
a loopback address (decoder/address.py's `require_loopback`, checked by `decode-serve
--listen`, `serve --decoder` and `DecoderClient`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time

import grpc
import numpy as np

from characters_jax.config import Config
from characters_jax.decoder.address import require_loopback
from characters_jax.decoder.tensors import array_from_proto, array_to_proto, tensor_from_proto, tensor_to_proto
from characters_jax.protos_gen import decoder_pb2, decoder_pb2_grpc
from characters_jax.wire.channel_options import decoder_channel_options

log = logging.getLogger("characters_jax.serving.decoder_link")


class DecoderUnavailable(Exception):
    pass


class DecoderClient:
    """A channel to the decoder process (unix:PATH or a loopback host:port), its message
    limits sized for the config's chunks."""

    def __init__(self, address: str, config: Config):
        """Raises ValueError for an address off this machine (require_loopback)."""
        from characters_jax.decoder.runtime import state_bytes

        self.address = require_loopback(address)
        state = state_bytes(config) + (1 << 20)  # a snapshot's decoder state goes both ways in one message
        options = [(k, max(v, state)) if k in ("grpc.max_receive_message_length", "grpc.max_send_message_length") else (k, v)
                   for k, v in decoder_channel_options(config)]
        self.channel = grpc.insecure_channel(address, options=options)
        self.stub = decoder_pb2_grpc.DecoderServiceStub(self.channel)

    def encode(self, rgb: np.ndarray, latent_shape, timeout: float = 120.0) -> np.ndarray:
        """rgb [H, W, 3] uint8 -> latent float32. Waits up to `timeout` for a (re)starting decoder.

        Raises DecoderUnavailable."""
        h, w, _ = rgb.shape
        try:
            resp = self.stub.Encode(decoder_pb2.EncodeRequest(width=w, height=h, rgb=rgb.tobytes()), timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as err:
            raise DecoderUnavailable(f"decoder at {self.address}: {err.code().name}: {err.details()}") from None
        return tensor_from_proto(resp.latent, latent_shape)

    def wait_ready(self, timeout: float) -> bool:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            return False

    def close(self) -> None:
        self.channel.close()


@dataclasses.dataclass(frozen=True)
class StateRequest:
    """A request for the stream's state after the latents queued before it; `on_state(arrays,
    error)` gets it (a list of numpy arrays, None), or why it did not come (None, message)."""

    step: int
    on_state: object


@dataclasses.dataclass(frozen=True)
class QueuedLatent:
    """A step's latent waiting for the stream: its (device) array and when the step was
    dispatched (time.perf_counter)."""

    step: int
    latent: object
    dispatched_at: float


class DecoderLink:
    def __init__(self, client: DecoderClient, session_id: str, on_chunk, on_error, on_end, initial_state: list | None = None):
        """initial_state: the stream's temporal state to start from (numpy arrays of an
        exported state), None: an empty history."""
        self._client = client
        self._session_id = session_id
        self._initial = initial_state
        self._q: queue.Queue[QueuedLatent | StateRequest | None] = queue.Queue()  # None: no more latents
        self._state_requests: collections.deque[StateRequest] = collections.deque()  # sent, state not back yet
        self._on_chunk, self._on_error, self._on_end = on_chunk, on_error, on_end
        self._timing: dict[int, float] = {}
        self._prev_ready = 0.0
        self._call = None
        self._thread = threading.Thread(target=self._read, name=f"decoder-link-{session_id[:8]}", daemon=True)

    def start(self) -> None:
        self._call = self._client.stub.Decode(self._requests(), wait_for_ready=False)
        self._thread.start()

    def submit(self, step: int, latent) -> None:
        self._q.put(QueuedLatent(step, latent, time.perf_counter()))

    def request_state(self, step: int, on_state) -> None:
        """Asks for the stream's state after every latent submitted so far (the state before
        step `step`); on_state(arrays, error) is called on the link's thread."""
        self._q.put(StateRequest(step, on_state))

    def finish(self) -> None:
        """No more latents: the stream ends after the queued ones are decoded."""
        self._q.put(None)

    def cancel(self) -> None:
        self._q.put(None)
        if self._call is not None:
            self._call.cancel()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _requests(self):
        while True:
            item = self._q.get()
            if item is None:
                return
            if isinstance(item, StateRequest):
                self._state_requests.append(item)
                msg = decoder_pb2.LatentChunk(session_id=self._session_id, step_index=item.step, export_state=True)
            else:
                host = np.asarray(item.latent)  # waits for this step's compute
                t_ready = time.perf_counter()
                self._timing[item.step] = (t_ready - max(item.dispatched_at, self._prev_ready)) * 1e3
                self._prev_ready = t_ready
                msg = decoder_pb2.LatentChunk(session_id=self._session_id, step_index=item.step, latent=tensor_to_proto(host))
            if self._initial is not None:
                msg.initial_state.extend(array_to_proto(a) for a in self._initial)
                self._initial = None
            yield msg

    def _read(self) -> None:
        try:
            self._read_stream()
        finally:
            self._fail_state_requests()

    def _fail_state_requests(self) -> None:
        """The stream is over: state requests still unanswered get their error, and the
        request iterator ends (gRPC's request thread waits in it for the next item; the
        drain below may have taken the None that finish or cancel queued for it)."""
        pending = list(self._state_requests)
        self._state_requests.clear()
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, StateRequest):
                pending.append(item)
        self._q.put(None)
        for req in pending:
            req.on_state(None, "the decoder stream ended before the decoder's state came back")

    def _read_stream(self) -> None:
        try:
            for fc in self._call:
                if not fc.frames:  # a state request's answer
                    self._state_requests.popleft().on_state([array_from_proto(t) for t in fc.state], None)
                    continue
                frames = [np.frombuffer(b, np.uint8).reshape(fc.height, fc.width, 3) for b in fc.frames]
                self._on_chunk(fc.step_index, frames, fc.decode_ms, self._timing.pop(fc.step_index, 0.0))
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED and self._call is not None and self._call.cancelled():
                self._on_end()
                return
            self._on_error(f"decoder stream failed: {err.code().name}: {err.details()}")
            return
        except Exception as err:  # never let a bad chunk kill the thread silently
            log.exception("decoder link error")
            self._on_error(f"decoder stream failed: {type(err).__name__}: {err}")
            return
        self._on_end()
