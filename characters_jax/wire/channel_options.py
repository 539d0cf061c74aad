"""gRPC channel and server options of the service: message size limits that follow the
config, and keepalive.

A worker's largest response is one VideoChunk (frames_per_step RGB24 frames and their
audio), so its send limit and the decoder link's receive limit follow the video size (a
fixed limit fails mid-stream on a large config: one 1920x1080 chunk is ~24.9 MB). Its
largest request is a start or CreateSession with the reference image, bounded by the image
limit. Clients receive without a limit: the worker bounds what it sends.

Keepalive: the worker pings a client with a live stream every 10 s and drops it after 5 s
without an answer, so a client that vanished (no FIN, no RST) ends its session within
~15 s; the client pings every 20 s.

Connection age (optional): the worker closes a client connection gracefully after
`max_connection_age_s` (GOAWAY; streams in flight go on to their end), so clients of a
dns:/// target re-resolve and find workers added since.
"""

from __future__ import annotations

from characters_jax.audio.timeline import Timeline
from characters_jax.config import Config

MIB = 1 << 20
_FRAMING = 64 << 10  # per-message room for fields, timestamps, spans and framing
REQUEST_ROOM = 1 << 20  # a start's prompt and limits; the largest audio chunk (~32 s)

SERVER_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]
CLIENT_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


def chunk_message_bytes(cfg: Config) -> int:
    """Upper bound on one VideoChunk (or decoder FrameChunk) message of this config, bytes."""
    v = cfg.video
    frames = v.frames_per_step * v.height * v.width * 3
    return frames + 2 * Timeline.from_config(cfg).max_step_samples + _FRAMING


def latent_message_bytes(cfg: Config) -> int:
    """Upper bound on one latent (LatentChunk / EncodeResponse) message, bytes."""
    v, m = cfg.video, cfg.model
    return 4 * v.grid_h * v.grid_w * m.latent_channels + _FRAMING


def worker_server_options(cfg: Config, max_image_bytes: int, max_connection_age_s: float = 0.0) -> list[tuple[str, int]]:
    """max_connection_age_s: 0 keeps connections open for good."""
    age = [("grpc.max_connection_age_ms", int(max_connection_age_s * 1000))] if max_connection_age_s > 0 else []
    return [
        ("grpc.max_send_message_length", chunk_message_bytes(cfg)),
        ("grpc.max_receive_message_length", max_image_bytes + REQUEST_ROOM),
        ("grpc.so_reuseport", 0),
        *SERVER_KEEPALIVE,
        *age,
    ]


def decoder_channel_options(cfg: Config) -> list[tuple[str, int]]:
    """The worker's channel to its decoder: frames in, latents and the encoder's image out."""
    v = cfg.video
    image = v.height * v.width * 3 + _FRAMING
    return [
        ("grpc.max_receive_message_length", max(chunk_message_bytes(cfg), latent_message_bytes(cfg))),
        ("grpc.max_send_message_length", max(image, latent_message_bytes(cfg))),
    ]


def client_channel_options(max_send_bytes: int = 64 * MIB) -> list[tuple[str, int]]:
    """A CharacterService client: receives whatever the worker sends; sends up to
    `max_send_bytes` (the start with the image)."""
    return [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", max_send_bytes), *CLIENT_KEEPALIVE]
