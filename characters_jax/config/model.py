"""The model config: `configs/<name>.toml` as a frozen `Config`.

A config file has a top-level `name` and `seed` and one table per dataclass: the model's
(`[model]`, `[video]`, `[cache]`, `[sampler]`, `[audio]`, `[decoder]`, `[engine]`) and the
commands' that run it (`[serve]`, `[bench]`); a field left out takes its default. A user adds
a config by dropping a new `.toml` into `configs/` (or passing a path): no code changes.
The loader (`config.loader`) checks each value's type; `validate()` then checks the model's
tables together; every error names the offending TABLE.KEY.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterable
from typing import Any

from characters_jax.config.bench import BenchConfig
from characters_jax.config.loader import ConfigError, apply_sets, from_document, read_toml
from characters_jax.config.serve import ServeConfig

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The video DiT. Shapes: d_model = residual width; heads x head_dim = attention width."""

    num_blocks: int = 2
    d_model: int = 64
    num_heads: int = 4
    head_dim: int = 16
    mlp_dim: int = 256
    latent_channels: int = 16
    audio_feature_dim: int = 32  # features per audio token (from the audio front end)
    audio_tokens_per_step: int = 9
    prompt_vocab: int = 256  # byte-level prompt tokens
    rope_theta: float = 10000.0
    rope_split: tuple[int, int, int] = (4, 2, 2)  # rotary frequency pairs on (time, height, width); sum = head_dim // 2
    norm_eps: float = 1e-6
    dtype: str = "float32"  # activation dtype: float32 | bfloat16
    weight_dtype: str = "float32"  # float32 | bfloat16 | fp8 (e4m3 values (N, K) + scale)
    # FP8 weights: activations quantized with one scale per tensor, or one per row (token)
    activation_scale: str = "tensor"  # tensor | row


@dataclasses.dataclass(frozen=True)
class VideoConfig:
    """Output video and the VAE's compression; the latent grid follows from these."""

    height: int = 128
    width: int = 128
    fps: int = 24
    frames_per_step: int = 4  # = VAE temporal compression: one latent frame per step
    spatial_compression: int = 32

    @property
    def grid_h(self) -> int:
        return self.height // self.spatial_compression

    @property
    def grid_w(self) -> int:
        return self.width // self.spatial_compression

    @property
    def tokens_per_frame(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def step_seconds(self) -> float:
        return self.frames_per_step / self.fps


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV cache: sink (reference image + prompt) then a ring of frames."""

    ring_frames: int = 6  # past frames + the current one
    max_prompt_tokens: int = 32
    prompt_buckets: tuple[int, ...] = (8, 16, 32)  # padded prompt lengths (compiled shapes)
    reset_period: int = 42  # steps between position resets
    mode: str = "ring"  # ring | launch
    dtype: str = "fp8"  # fp8 | bf16 | float32


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Flow-matching Euler sampler: len(sigmas) - 1 denoising passes per step."""

    sigmas: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25, 0.0)

    @property
    def num_passes(self) -> int:
        return len(self.sigmas) - 1


@dataclasses.dataclass(frozen=True)
class AudioConfig:
    """Audio in: 16 kHz mono PCM s16le; log-mel features pooled into tokens."""

    sample_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    n_mels: int = 32


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Causal 3-D conv VAE decoder (LTX-Video layout); small configs shrink channels only."""

    channels: tuple[int, ...] = (64, 32, 16, 8)  # per stage, from the latent side
    blocks_per_stage: int = 1
    out_channels: int = 48  # 3 RGB x 4 x 4 unpatchify
    unpatchify: int = 4
    dtype: str = "float32"


ATTENTION_IMPLS = ("auto", "pallas", "cudnn", "xla", "reference")
REDUCE_METHODS = ("auto", "psum", "ppermute", "pallas")
KERNELS = ("gemm", "quant", "qkv")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine computes the step; every choice keeps the model's arithmetic up to
    rounding (the numerics harness judges each against the reference).

    attention: 'auto' (the Pallas FP8 kernel on an NVIDIA Hopper GPU for an FP8 cache and
      head_dim 128, else the reference) | 'pallas' | 'cudnn' | 'xla' (``jax.nn.
      dot_product_attention`` on dequantized K/V) | 'reference' (plain jnp, float32).
    reduce: the block's all-reduce: 'auto' (the fused Pallas FP8 GEMM + all-reduce on
      Hopper where the shapes tile, else psum) | 'psum' | 'ppermute' (a ring overlapping
      the GEMM; portable) | 'pallas' (the fused kernel; FP8 weights).
    kernels: the custom kernels besides attention and the reduction: 'auto' (every one
      that applies and runs here) | 'none' | a '+'-joined subset of 'gemm' (the stacked
      Pallas FP8 GEMM, weights read in place, attention-out + MLP-down joined; its jnp
      reference off Hopper), 'quant' (the GEMM inputs' norm / GELU + per-row FP8
      quantization kernels) and 'qkv' (QK-norm, RoPE, Q's e4m3 parts and the K/V cache
      write in one kernel).
    """

    attention: str = "auto"
    reduce: str = "auto"
    kernels: str = "auto"

    def __post_init__(self):
        for name, choices in (("attention", ATTENTION_IMPLS), ("reduce", REDUCE_METHODS)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"engine.{name}: must be one of {choices}, got {getattr(self, name)!r}")
        self.kernel_set()  # checks the kernels field

    def kernel_set(self) -> frozenset[str] | None:
        """The kernels asked for by name (a frozenset, empty for 'none'), or None for 'auto'."""
        k = self.kernels
        if k == "auto":
            return None
        if k == "none":
            return frozenset()
        names = k.split("+") if isinstance(k, str) else []
        if not names or any(n not in KERNELS for n in names) or len(set(names)) != len(names):
            raise ConfigError(f"engine.kernels: must be 'auto', 'none' or a '+'-joined subset of "
                              f"{KERNELS} (e.g. 'gemm+quant'), got {k!r}")
        return frozenset(names)


@dataclasses.dataclass(frozen=True)
class Config:
    """One config: the model's tables, and the tables of the commands that run it. seed: of
    the random weights where a command makes them (serve, decode-serve, bench,
    init-checkpoint) and of bench's inputs."""

    name: str = "custom"
    seed: int = 0
    model: ModelConfig = ModelConfig()
    video: VideoConfig = VideoConfig()
    cache: CacheConfig = CacheConfig()
    sampler: SamplerConfig = SamplerConfig()
    audio: AudioConfig = AudioConfig()
    decoder: DecoderConfig = DecoderConfig()
    engine: EngineConfig = EngineConfig()
    serve: ServeConfig = ServeConfig()
    bench: BenchConfig = BenchConfig()

    @property
    def sink_image_tokens(self) -> int:
        return self.video.tokens_per_frame

    @property
    def sink_slots(self) -> int:
        return self.sink_image_tokens + self.cache.max_prompt_tokens

    @property
    def tokens_per_step(self) -> int:
        """New tokens per pass: one latent frame plus its audio tokens."""
        return self.video.tokens_per_frame + self.model.audio_tokens_per_step

    @property
    def ring_slots(self) -> int:
        return self.cache.ring_frames * self.tokens_per_step

    @property
    def cache_slots(self) -> int:
        return self.sink_slots + self.ring_slots

    def replace(self, **sections: dict[str, Any]) -> "Config":
        """A copy with some fields changed: `cfg.replace(cache={"mode": "launch"})`."""
        updates = {}
        for section, fields in sections.items():
            current = getattr(self, section)
            updates[section] = dataclasses.replace(current, **fields) if fields else current
        out = dataclasses.replace(self, **updates)
        validate(out)
        return out

    def share_of_tp(self, n: int) -> "Config":
        """One GPU's share of tensor-parallel size n, to run at tp = 1 (what one GPU of the
        tp = n step computes, without the all-reduce): num_heads / n and mlp_dim / n, the
        residual width, norms, modulation and cache rows as at tp = n; named
        '<name>-share-of-tp<n>'. ConfigError if the model does not split n ways."""
        if n == 1:
            return self
        self.validate_tp(n)
        m = self.model
        shared = self.replace(model={"num_heads": m.num_heads // n, "mlp_dim": m.mlp_dim // n})
        return dataclasses.replace(shared, name=f"{self.name}-share-of-tp{n}")

    def validate_tp(self, tp: int) -> None:
        if tp < 1:
            raise ConfigError(f"tp: must be >= 1, got {tp}")
        if self.model.num_heads % tp:
            raise ConfigError(f"model.num_heads: {self.model.num_heads} is not divisible by the tensor-parallel size {tp}")
        if self.model.mlp_dim % tp:
            raise ConfigError(f"model.mlp_dim: {self.model.mlp_dim} is not divisible by the tensor-parallel size {tp}")


_SECTIONS = {
    "model": ModelConfig,
    "video": VideoConfig,
    "cache": CacheConfig,
    "sampler": SamplerConfig,
    "audio": AudioConfig,
    "decoder": DecoderConfig,
    "engine": EngineConfig,
}

_CHOICES = {
    ("model", "dtype"): ("float32", "bfloat16"),
    ("model", "weight_dtype"): ("float32", "bfloat16", "fp8"),
    ("model", "activation_scale"): ("tensor", "row"),
    ("cache", "mode"): ("ring", "launch"),
    ("cache", "dtype"): ("fp8", "bf16", "float32"),
    ("decoder", "dtype"): ("float32", "bfloat16"),
}


def validate(cfg: Config) -> None:
    """Raises ConfigError naming the first invalid field."""
    for section in _SECTIONS:
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            values = v if isinstance(v, tuple) else (v,)
            for x in values:
                if isinstance(x, (int, float)) and not isinstance(x, bool) and x < 0:
                    raise ConfigError(f"{section}.{f.name}: must not be negative, got {v!r}")
            choices = _CHOICES.get((section, f.name))
            if choices and v not in choices:
                raise ConfigError(f"{section}.{f.name}: must be one of {choices}, got {v!r}")
    m, vid, c, s = cfg.model, cfg.video, cfg.cache, cfg.sampler
    for name in ("num_blocks", "d_model", "num_heads", "head_dim", "mlp_dim", "latent_channels", "audio_feature_dim", "prompt_vocab"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}: must be positive, got {getattr(m, name)}")
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim: must be even for RoPE, got {m.head_dim}")
    if len(m.rope_split) != 3 or sum(m.rope_split) != m.head_dim // 2:
        raise ConfigError(f"model.rope_split: must be 3 numbers summing to head_dim // 2 = {m.head_dim // 2}, got {m.rope_split}")
    for name in ("height", "width", "fps", "frames_per_step", "spatial_compression"):
        if getattr(vid, name) <= 0:
            raise ConfigError(f"video.{name}: must be positive, got {getattr(vid, name)}")
    if vid.height % vid.spatial_compression or vid.width % vid.spatial_compression:
        raise ConfigError(f"video.height/width: {vid.height}x{vid.width} must be multiples of video.spatial_compression={vid.spatial_compression}")
    if c.ring_frames < 1:
        raise ConfigError(f"cache.ring_frames: the cache must hold at least one frame (the current one), got {c.ring_frames}")
    if not c.prompt_buckets or list(c.prompt_buckets) != sorted(set(c.prompt_buckets)):
        raise ConfigError(f"cache.prompt_buckets: must be a non-empty increasing list, got {c.prompt_buckets}")
    if c.prompt_buckets[-1] != c.max_prompt_tokens:
        raise ConfigError(f"cache.prompt_buckets: the last bucket must equal cache.max_prompt_tokens={c.max_prompt_tokens}, got {c.prompt_buckets}")
    if c.reset_period < 1:
        raise ConfigError(f"cache.reset_period: must be >= 1, got {c.reset_period}")
    if len(s.sigmas) < 2 or any(a <= b for a, b in zip(s.sigmas, s.sigmas[1:])):
        raise ConfigError(f"sampler.sigmas: must be at least two strictly decreasing values, got {s.sigmas}")


def load_config(name_or_path: str, sets: Iterable[str] = ()) -> Config:
    """Loads `configs/<name>.toml`, or a .toml file given by path, with `--set` items
    (`TABLE.KEY=VALUE`) applied, and validates it. Raises ConfigError naming the key."""
    raw, path = read_toml(name_or_path, CONFIG_DIR, "config")
    return config_from_dict(apply_sets(raw, sets), default_name=path.stem)


def config_from_dict(raw: dict[str, Any], default_name: str = "custom") -> Config:
    """A Config from a parsed document (missing keys and tables take their defaults)."""
    cfg = from_document(Config(name=default_name), raw)
    validate(cfg)
    return cfg
