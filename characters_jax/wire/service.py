"""The names and the audio format both ends of CharacterService use."""

from __future__ import annotations

from characters_jax.protos_gen import characters_pb2 as pb

SERVICE_NAME = "characters.v1.CharacterService"  # the grpc.health.v1 name balancers place sessions by

# Audio in: 16 kHz mono PCM, s16le (what the client library sends) or f32le.
PCM_FORMAT = pb.AudioFormat(sample_rate_hz=16000, channels=1, encoding=pb.AudioFormat.PCM_S16LE)
AUDIO_ENCODINGS = {pb.AudioFormat.PCM_S16LE: "s16le", pb.AudioFormat.PCM_F32LE: "f32le"}
