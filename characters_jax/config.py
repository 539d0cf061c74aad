"""Typed, frozen configuration loaded from `configs/<name>.toml`.

A config file has one table per dataclass below (`[model]`, `[video]`, `[cache]`,
`[sampler]`, `[audio]`, `[decoder]`); a field left out takes its default. A user adds a
config by dropping a new `.toml` into `configs/` (or passing a path): no code changes.
`validate()` runs on load and names the offending field in its error.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tomllib
from typing import Any

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A config value is invalid; the message names the field."""


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


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    model: ModelConfig
    video: VideoConfig
    cache: CacheConfig
    sampler: SamplerConfig
    audio: AudioConfig
    decoder: DecoderConfig

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
}

_CHOICES = {
    ("model", "dtype"): ("float32", "bfloat16"),
    ("model", "weight_dtype"): ("float32", "bfloat16", "fp8"),
    ("model", "activation_scale"): ("tensor", "row"),
    ("cache", "mode"): ("ring", "launch"),
    ("cache", "dtype"): ("fp8", "bf16", "float32"),
    ("decoder", "dtype"): ("float32", "bfloat16"),
}


def _build_section(section: str, cls: type, raw: dict[str, Any]) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: expected a table, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"{section}.{key}: unknown field (known: {', '.join(sorted(fields))})")
        default = getattr(cls(), key)
        if isinstance(default, tuple):
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"{section}.{key}: expected a list, got {value!r}")
            value = tuple(value)
        elif isinstance(default, bool) or not isinstance(default, (int, float, str)):
            pass
        elif isinstance(default, float) and isinstance(value, int):
            value = float(value)
        elif not isinstance(value, type(default)):
            raise ConfigError(f"{section}.{key}: expected {type(default).__name__}, got {value!r}")
        kwargs[key] = value
    return cls(**kwargs)


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


def load_config(name_or_path: str) -> Config:
    """Loads `configs/<name>.toml`, or a .toml file given by path, and validates it."""
    path = pathlib.Path(name_or_path)
    if path.suffix != ".toml":
        path = CONFIG_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml")))
        raise ConfigError(f"config {name_or_path!r} not found (known: {known})")
    with path.open("rb") as fh:
        raw = tomllib.load(fh)
    return config_from_dict(raw, default_name=path.stem)


def config_from_dict(raw: dict[str, Any], default_name: str = "custom") -> Config:
    raw = dict(raw)
    name = raw.pop("name", default_name)
    unknown = set(raw) - set(_SECTIONS)
    if unknown:
        raise ConfigError(f"{sorted(unknown)[0]}: unknown section (known: {', '.join(_SECTIONS)})")
    sections = {s: _build_section(s, cls, raw.get(s, {})) for s, cls in _SECTIONS.items()}
    cfg = Config(name=name, **sections)
    validate(cfg)
    return cfg
