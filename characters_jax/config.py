"""Typed, frozen configuration loaded from `configs/<name>.toml`.

A config file has one table per dataclass below (`[model]`, `[video]`, `[cache]`,
`[sampler]`, `[audio]`, `[decoder]`, `[engine]`); a field left out takes its default. A user adds a
config by dropping a new `.toml` into `configs/` (or passing a path): no code changes.
`validate()` runs on load and names the offending field in its error.
"""

from __future__ import annotations

import argparse
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
    name: str
    model: ModelConfig
    video: VideoConfig
    cache: CacheConfig
    sampler: SamplerConfig
    audio: AudioConfig
    decoder: DecoderConfig
    engine: EngineConfig = EngineConfig()

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


def read_toml(name_or_path: str, directory: pathlib.Path, what: str) -> tuple[dict, pathlib.Path]:
    """(the parsed table, its path) of `directory/<name>.toml`, or of a .toml path. Raises
    ConfigError naming `what` and the known names when there is no such file."""
    path = pathlib.Path(name_or_path)
    if path.suffix != ".toml":
        path = directory / f"{name_or_path}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in directory.glob("*.toml")))
        raise ConfigError(f"{what} {name_or_path!r} not found (known: {known})")
    with path.open("rb") as fh:
        return tomllib.load(fh), path


def load_config(name_or_path: str) -> Config:
    """Loads `configs/<name>.toml`, or a .toml file given by path, and validates it."""
    raw, path = read_toml(name_or_path, CONFIG_DIR, "config")
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


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that override the config's [engine] and [cache] tables (default: the
    config's), the same for every command that builds an engine (serve, bench, numerics,
    demo); ``with_engine_arguments`` applies them."""
    g = parser.add_argument_group("engine (override the config's [engine] and [cache])")
    g.add_argument("--attention", default=None, metavar="|".join(ATTENTION_IMPLS),
                   help="attention implementation")
    g.add_argument("--reduce", default=None, metavar="|".join(REDUCE_METHODS),
                   help="the blocks' all-reduce")
    g.add_argument("--kernels", default=None, metavar="auto|none|" + "+".join(KERNELS),
                   help="custom kernels: auto, none, or a '+'-joined subset of "
                        + ", ".join(KERNELS))
    g.add_argument("--cache-mode", default=None, metavar="|".join(_CHOICES[("cache", "mode")]),
                   help="cache.mode")
    g.add_argument("--cache-dtype", default=None, metavar="|".join(_CHOICES[("cache", "dtype")]),
                   help="cache.dtype")


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The flags of ``add_engine_arguments`` that were given, as a command line (for a
    command that starts another, e.g. demo -> serve)."""
    out = []
    for key in ("attention", "reduce", "kernels", "cache_mode", "cache_dtype"):
        value = getattr(args, key, None)
        if value is not None:
            out += ["--" + key.replace("_", "-"), str(value)]
    return out


def with_engine_arguments(cfg: Config, args: argparse.Namespace) -> Config:
    """``cfg`` with the flags of ``add_engine_arguments`` applied (those given), validated:
    a bad value is a ConfigError naming the field and its allowed values."""
    engine = {k: getattr(args, k) for k in ("attention", "reduce", "kernels")
              if getattr(args, k, None) is not None}
    cache = {k: getattr(args, f"cache_{k}") for k in ("mode", "dtype")
             if getattr(args, f"cache_{k}", None) is not None}
    return cfg.replace(engine=engine, cache=cache)
