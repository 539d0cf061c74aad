"""One config surface: frozen dataclasses read from TOML by one loader (`loader`), with
`--set TABLE.KEY=VALUE` on every command (`cli`).

- `model`: the model config, `configs/<name>.toml` (`Config`, `load_config`), whose tables
  include the commands' that run it: `[serve]` (`serve`: WorkerOptions, RpcLimits, the
  worker process's settings) and `[bench]` (`bench`).
- The training settings (`configs/train/<name>.toml`, `train.settings`) and the options of
  the commands that read no file (talk, data, lipsync, view's page) use the same loader.
"""

from characters_jax.config.bench import BenchConfig
from characters_jax.config.loader import ConfigError, read_toml
from characters_jax.config.model import (
    ATTENTION_IMPLS,
    CONFIG_DIR,
    KERNELS,
    REDUCE_METHODS,
    AudioConfig,
    CacheConfig,
    Config,
    DecoderConfig,
    EngineConfig,
    ModelConfig,
    SamplerConfig,
    VideoConfig,
    config_from_dict,
    load_config,
    validate,
)
from characters_jax.config.serve import ImageLimits, RpcLimits, ServeConfig, WorkerOptions

__all__ = ["ATTENTION_IMPLS", "CONFIG_DIR", "KERNELS", "REDUCE_METHODS", "AudioConfig", "BenchConfig", "CacheConfig",
           "Config", "ConfigError", "DecoderConfig", "EngineConfig", "ImageLimits", "ModelConfig", "RpcLimits",
           "SamplerConfig", "ServeConfig", "VideoConfig", "WorkerOptions", "config_from_dict", "load_config",
           "read_toml", "validate"]
