"""`DecoderService` over gRPC: one Decode stream per session holds that session's state.

Runs in its own OS process (`characters-jax decode-serve`), pinned to its own device. The
server starts listening only after both programs are compiled, so a client that waits for
the channel to be ready gets a decoder that answers at full speed.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
import numpy as np

from characters_jax.decoder.runtime import VaeRuntime
from characters_jax.protos_gen import decoder_pb2, decoder_pb2_grpc
from characters_jax.decoder.tensors import array_from_proto, array_to_proto, tensor_from_proto, tensor_to_proto

log = logging.getLogger("characters_jax.decoder")


class DecoderServicer(decoder_pb2_grpc.DecoderServiceServicer):
    def __init__(self, runtime: VaeRuntime):
        self.runtime = runtime
        self._lock = threading.Lock()  # one device, one program at a time

    def Decode(self, request_iterator, context):
        rt = self.runtime
        state = rt.initial_state()
        session = ""
        n = 0
        for req in request_iterator:
            session = req.session_id
            if req.initial_state:
                if n:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "initial_state: only a stream's first chunk may carry one")
                try:
                    state = rt.import_state([array_from_proto(t) for t in req.initial_state])
                except ValueError as err:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"initial_state: {err}")
            latent = None
            if req.HasField("latent") or not req.export_state:
                try:
                    latent = tensor_from_proto(req.latent, rt.latent_shape)
                except ValueError as err:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"latent: {err}")
            t0 = time.perf_counter()
            reply = decoder_pb2.FrameChunk(step_index=req.step_index)
            with self._lock:
                if latent is not None:
                    frames, state = rt.decode(state, latent)
                    frames = np.asarray(frames)
                    _, reply.height, reply.width, _ = frames.shape
                    reply.frames.extend(f.tobytes() for f in frames)
                if req.export_state:
                    reply.state.extend(array_to_proto(a) for a in rt.export_state(state))
            reply.decode_ms = (time.perf_counter() - t0) * 1e3
            n += 1
            yield reply
        log.info("decode stream ended", extra={"fields": {"session_id": session, "chunks": n}})

    def Encode(self, request, context):
        v = self.runtime.config.video
        if (request.width, request.height) != (v.width, v.height) or len(request.rgb) != v.width * v.height * 3:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"image must be {v.width}x{v.height} RGB24 ({v.width * v.height * 3} bytes), got {request.width}x{request.height} with {len(request.rgb)} bytes")
        rgb = np.frombuffer(request.rgb, np.uint8).reshape(v.height, v.width, 3)
        with self._lock:
            latent = np.asarray(self.runtime.encode(rgb))
        return decoder_pb2.EncodeResponse(latent=tensor_to_proto(latent))


def start_decoder_server(runtime: VaeRuntime, address: str) -> tuple[grpc.Server, int]:
    """Starts serving on `address` (host:port, port 0 = any; or unix:PATH). Returns (server, port)."""
    limit = max(64 << 20, getattr(runtime, "state_bytes", 0) + (1 << 20))  # a stream's state travels in one message
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)])
    decoder_pb2_grpc.add_DecoderServiceServicer_to_server(DecoderServicer(runtime), server)
    port = server.add_insecure_port(address)
    server.start()
    return server, port
