"""Stand-ins for the model, for serving tests and client development: a `Generator` and a
decoder runtime that need no weights and compile nothing.

`FakeGenerator` follows the engine's `Generator` protocol (engine/interface.py) and records
the audio tokens of every step, so a test can check that a chunk was generated from the
audio it carries. Its latent of step n holds n (channel 0) and the mean of the step's audio
tokens (channel 1). `FakeVaeRuntime` is what `DecoderServicer` runs: its frames show the
step (red = step mod 256) and the audio (green grows with the tokens' mean).

With both, `FakeWorker` serves the real orchestration (build_worker: pacing, events,
interrupts, limits, drain) in-process in milliseconds.
"""

from __future__ import annotations

import collections

import numpy as np

from characters_jax.config import Config


class FakeGenerator:
    def __init__(self, config: Config, keep_steps: int = 10_000):
        """keep_steps: how many steps' tokens `tokens_seen` keeps (the latest)."""
        self.config = config
        self.tokens_seen: collections.deque[np.ndarray] = collections.deque(maxlen=keep_steps)
        self.sessions = 0
        self.warmups = 0
        self._step_index = 0

    @property
    def step_index(self) -> int:
        return self._step_index

    def start_session(self, image_latent, prompt_tokens, seed: int = 0) -> None:
        v, m = self.config.video, self.config.model
        expected = (v.grid_h, v.grid_w, m.latent_channels)
        if tuple(np.shape(image_latent)) != expected:
            raise ValueError(f"image_latent must have shape {expected}, got {tuple(np.shape(image_latent))}")
        if len(prompt_tokens) > self.config.cache.max_prompt_tokens:
            raise ValueError(f"prompt: {len(prompt_tokens)} tokens over {self.config.cache.max_prompt_tokens}")
        self.sessions += 1
        self.tokens_seen.clear()
        self._step_index = 0

    def step(self, audio_tokens) -> np.ndarray:
        """audio_tokens [audio_tokens_per_step, audio_feature_dim] -> latent [gh, gw, C] float32."""
        v, m = self.config.video, self.config.model
        tokens = np.asarray(audio_tokens, np.float32)
        if tokens.shape != (m.audio_tokens_per_step, m.audio_feature_dim):
            raise ValueError(f"audio_tokens must have shape {(m.audio_tokens_per_step, m.audio_feature_dim)}, got {tokens.shape}")
        self.tokens_seen.append(tokens)
        latent = np.zeros((v.grid_h, v.grid_w, m.latent_channels), np.float32)
        latent[..., 0] = self._step_index
        latent[..., 1] = tokens.mean()
        self._step_index += 1
        return latent

    def warmup(self) -> None:
        """Compiles nothing; counts the warm-ups (`warmups`)."""
        self.warmups += 1

    def capture_state(self) -> "FakeCapture":
        """Its state is the step index alone (the latent of step n holds n)."""
        return FakeCapture({"step": np.array(self._step_index, np.int64)}, self._step_index)

    def restore_state(self, arrays, step_index: int) -> None:
        if set(arrays) != {"step"} or np.shape(arrays["step"]) != ():
            raise ValueError(f"the state does not fit this generator: arrays {sorted(arrays)}, expected ['step']")
        self._step_index = int(step_index)
        self.tokens_seen.clear()

    def state_identity(self) -> dict:
        from characters_jax.engine.snapshot import identity

        return identity(self.config, 1, {"generator": "fake"}, "none")

    def compiled_programs(self) -> int:
        return 0


class FakeCapture:
    """A captured FakeGenerator state (the engine's StateCapture interface)."""

    def __init__(self, arrays: dict, step_index: int):
        self._arrays, self.step_index = arrays, step_index

    def arrays(self) -> dict:
        return dict(self._arrays)


class FakeVaeRuntime:
    """The decoder runtime's interface (decoder/runtime.py: initial_state, decode, encode,
    export_state, import_state); its streams have no temporal state."""

    def __init__(self, config: Config):
        v, m = config.video, config.model
        self.config = config
        self.latent_shape = (v.grid_h, v.grid_w, m.latent_channels)
        self.decoded = 0

    def initial_state(self) -> list:
        return []

    def export_state(self, state) -> list:
        return []

    def import_state(self, arrays) -> list:
        if len(arrays):
            raise ValueError(f"the decoder state has 0 arrays, got {len(arrays)}")
        return []

    def decode(self, state, latent) -> tuple[np.ndarray, list]:
        """latent [gh, gw, C] -> frames [frames_per_step, H, W, 3] uint8."""
        v = self.config.video
        z = np.asarray(latent, np.float32)
        frames = np.zeros((v.frames_per_step, v.height, v.width, 3), np.uint8)
        frames[..., 0] = int(z[0, 0, 0]) % 256
        frames[..., 1] = int(np.clip(128 + 100 * z[0, 0, 1], 0, 255))
        self.decoded += 1
        return frames, state

    def encode(self, rgb: np.ndarray) -> np.ndarray:
        return np.full(self.latent_shape, float(np.asarray(rgb).mean()) / 255.0, np.float32)


class FakeWorker:
    """A whole worker in this process: the real orchestration (build_worker, WorkerServer)
    over a FakeGenerator, its decoder a DecoderServicer running FakeVaeRuntime on a loopback
    port.

        with FakeWorker("tiny") as w:
            client = CharacterClient(w.address)
    """

    def __init__(self, config="tiny", options=None, host: str = "127.0.0.1", port: int = 0, credentials=None, interceptors=(),
                 generator: FakeGenerator | None = None, limits=None):
        """options: the WorkerOptions (default WorkerOptions()); credentials, interceptors:
        the server's TLS credentials and interceptors (serving/tls.py: worker_transport);
        generator: the FakeGenerator to serve (default: a new one); limits: the RpcLimits
        (default RpcLimits())."""
        from characters_jax.config import load_config
        from characters_jax.decoder.service import start_decoder_server
        from characters_jax.serving.composition import build_worker
        from characters_jax.serving.decoder_link import DecoderClient

        cfg = load_config(config) if isinstance(config, str) else config
        self.config = cfg
        self.vae = FakeVaeRuntime(cfg)
        self.decoder_server, dport = start_decoder_server(self.vae, "127.0.0.1:0")
        self.generator = generator or FakeGenerator(cfg)
        self.decoder = DecoderClient(f"127.0.0.1:{dport}", cfg)
        self.server = build_worker(self.generator, self.decoder, options, host=host, port=port, limits=limits, credentials=credentials,
                                   interceptors=interceptors)
        self.server.start()
        self.address = self.server.address

    def close(self, drain_timeout_s: float | None = 0.0, grace_s: float = 1.0) -> None:
        """Drains for up to drain_timeout_s (None: the options' drain_timeout_s), stops serving
        (RPCs still running after grace_s are cancelled), then stops the decoder."""
        self.server.drain(drain_timeout_s)
        self.server.stop(grace=grace_s)
        self.decoder.close()
        self.decoder_server.stop(grace=0.5).wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
