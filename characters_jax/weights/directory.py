"""A weights directory: the trained generator and VAE of one config, and its checks.

Layout (`save_weights` writes it, `open_weights` reads it):
  manifest.json   format, the config's name and shape fields, the parts' trees (path ->
                  shape, dtype), the latent statistics and a training summary
  dit/            orbax: the DiT's parameters as `nnx.to_pure_dict` of the engine's state
                  (what `weights.dit.restore_params` restores; `weights.dit.dit_checkpoint`
                  checks it against the engine's)
  vae/            orbax: {"decoder": ..., "encoder": ...} parameter dicts
Arrays may be stored in a narrower float dtype (bfloat16) than the config computes in;
they are cast on restore. Every check runs at start-up, before a session exists: a
directory made for other shapes, or a damaged one, is a `WeightsError` that names the
config field or the array that differs, never an error in the middle of a session.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = "characters-jax-weights/1"
MANIFEST = "manifest.json"
PARTS = ("dit", "vae")
# The config fields the parts' shapes follow (compared first: the clearest message).
SHAPE_FIELDS = {
    "model": ("num_blocks", "d_model", "num_heads", "head_dim", "mlp_dim", "latent_channels",
              "audio_feature_dim", "audio_tokens_per_step", "prompt_vocab"),
    "video": ("height", "width", "frames_per_step", "spatial_compression"),
    "decoder": ("channels", "blocks_per_stage", "out_channels", "unpatchify"),
}


class WeightsError(ValueError):
    """A weights directory cannot serve this config; the message says what differs."""


@dataclasses.dataclass(frozen=True)
class LatentStats:
    """Per-channel statistics of the encoder's raw latents: mean, std float32 [C].
    The generator's latent space is (z - mean) / std."""

    mean: np.ndarray
    std: np.ndarray

    def normalise(self, z):
        return (z - jnp.asarray(self.mean)) / jnp.asarray(self.std)

    def denormalise(self, zn):
        return zn * jnp.asarray(self.std) + jnp.asarray(self.mean)

    def to_json(self) -> dict:
        return {"mean": [float(x) for x in self.mean], "std": [float(x) for x in self.std]}

    @classmethod
    def from_json(cls, d: dict) -> "LatentStats":
        return cls(np.asarray(d["mean"], np.float32), np.asarray(d["std"], np.float32))


def config_fields(cfg) -> dict:
    """{"model.d_model": 256, ...}: the fields of SHAPE_FIELDS, JSON-ready."""
    out = {}
    for section, names in SHAPE_FIELDS.items():
        for name in names:
            v = getattr(getattr(cfg, section), name)
            out[f"{section}.{name}"] = list(v) if isinstance(v, tuple) else v
    return out


def tree_spec(tree) -> dict:
    """{"a/b/c": [shape list, dtype name]} of a nested dict of arrays or ShapeDtypeStructs."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {_key(path): [list(x.shape), str(jnp.dtype(x.dtype))] for path, x in flat}


def _key(path) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def checkpointer():
    """orbax's StandardCheckpointer (imported when first needed)."""
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def _cast_tree(tree, dtype):
    def cast(x):
        x = jnp.asarray(x)
        return x.astype(dtype) if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)


def save_weights(directory, cfg, dit: dict, vae: dict, stats: LatentStats, training: dict | None = None,
                 store_dtype: str | None = "bfloat16") -> pathlib.Path:
    """Writes a weights directory (must not exist). dit: the DiT's pure dict of parameters;
    vae: {"decoder": pure dict, "encoder": pure dict}; store_dtype: float arrays are stored
    in it (None: as they are)."""
    out = pathlib.Path(directory).resolve()
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    out.mkdir(parents=True)
    dtype = jnp.dtype(store_dtype) if store_dtype else None
    parts = {"dit": _cast_tree(dit, dtype), "vae": _cast_tree(vae, dtype)}
    ckpt = checkpointer()
    for name, tree in parts.items():
        ckpt.save(out / name, tree)
    ckpt.wait_until_finished()
    manifest = {"format": FORMAT, "config": cfg.name, "config_fields": config_fields(cfg),
                "latent_stats": stats.to_json(), "trees": {k: tree_spec(v) for k, v in parts.items()},
                "training": training or {}}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out


@dataclasses.dataclass(frozen=True)
class Weights:
    """An opened, checked weights directory."""

    path: pathlib.Path
    manifest: dict

    @property
    def stats(self) -> LatentStats:
        return LatentStats.from_json(self.manifest["latent_stats"])

    def part(self, name: str) -> pathlib.Path:
        return self.path / name

    def restore(self, name: str, target):
        """Restores part `name` onto `target` (a tree of ShapeDtypeStructs, shardings
        allowed): arrays come back in the target's dtypes."""
        check_tree(f"{self.path}: {name}", self.manifest["trees"][name], tree_spec(target))
        try:
            return checkpointer().restore(self.part(name), target)
        except Exception as err:  # a damaged array file: name the part, not orbax's internals
            raise WeightsError(f"{self.part(name)}: cannot be restored ({type(err).__name__}: "
                               f"{str(err).splitlines()[0] if str(err) else ''})") from None


def open_weights(directory, cfg) -> Weights:
    """Reads and checks a weights directory for `cfg`: the manifest, the shape fields of the
    config, that every part is there and readable. Raises WeightsError (or
    FileNotFoundError for a path that does not exist)."""
    path = pathlib.Path(directory).resolve()
    if not path.exists():
        raise FileNotFoundError(f"weights directory {path} does not exist")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise WeightsError(f"{path}: no {MANIFEST} (not a weights directory written by "
                           "`characters-jax train`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"{path / MANIFEST}: unreadable ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise WeightsError(f"{path / MANIFEST}: format {got!r}, expected {FORMAT!r}")
    try:
        stored = manifest["config_fields"]
        trees = manifest["trees"]
        LatentStats.from_json(manifest["latent_stats"])
    except (KeyError, TypeError, ValueError) as err:
        raise WeightsError(f"{path / MANIFEST}: incomplete ({type(err).__name__}: {err})") from None
    wanted = config_fields(cfg)
    diffs = [f"{k}: {stored.get(k)!r} in the weights, {v!r} in config {cfg.name!r}"
             for k, v in wanted.items() if stored.get(k) != v]
    if diffs:
        raise WeightsError(f"{path} was trained for config {manifest.get('config')!r}, whose shapes differ "
                           f"from {cfg.name!r}: " + "; ".join(diffs))
    stats = LatentStats.from_json(manifest["latent_stats"])
    c = cfg.model.latent_channels
    if stats.mean.shape != (c,) or stats.std.shape != (c,) or not np.all(np.isfinite(stats.mean)) \
            or not np.all(stats.std > 0):
        raise WeightsError(f"{path / MANIFEST}: latent_stats must be {c} finite means and positive stds")
    for name in PARTS:
        if name not in trees:
            raise WeightsError(f"{path / MANIFEST}: no tree for part {name!r}")
        try:
            meta = checkpointer().metadata(path / name).item_metadata.tree
        except Exception as err:
            raise WeightsError(f"{path / name}: not a readable orbax checkpoint "
                               f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
        check_tree(f"{path}: {name} (stored)", trees[name], tree_spec(meta))
    return Weights(path, manifest)


def check_tree(what: str, have: dict, want: dict) -> None:
    """Raises WeightsError listing the arrays missing, extra, or of another shape, or of a
    non-float dtype that differs (float dtypes cast on restore)."""
    problems = []
    for k in sorted(set(want) - set(have)):
        problems.append(f"{k} missing")
    for k in sorted(set(have) - set(want)):
        problems.append(f"{k} unexpected")
    for k in sorted(set(have) & set(want)):
        (hs, hd), (ws, wd) = have[k], want[k]
        if list(hs) != list(ws):
            problems.append(f"{k} has shape {tuple(hs)}, needs {tuple(ws)}")
        elif hd != wd and not (jnp.issubdtype(jnp.dtype(hd), jnp.floating) and jnp.issubdtype(jnp.dtype(wd), jnp.floating)):
            problems.append(f"{k} is {hd}, needs {wd}")
    if problems:
        more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
        raise WeightsError(f"{what}: " + "; ".join(problems[:6]) + more)


def abstract_tree(tree, device=None):
    """A tree of ShapeDtypeStructs with the same shapes and dtypes, placed on one device
    (default: the first): a restore target that names its placement, so weights saved on
    another machine (another device count or platform) restore here."""
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


CHECKPOINT_DIR = pathlib.Path(__file__).resolve().parents[2] / "checkpoints"


def bundled_weights(name: str) -> pathlib.Path | None:
    """checkpoints/NAME when it holds a weights directory (the repository ships the talking
    demonstrator's), else None."""
    path = CHECKPOINT_DIR / name
    return path if (path / MANIFEST).is_file() else None


def checkpoint_path(choice: str | None, config_name: str) -> pathlib.Path | None:
    """The weights directory a `--checkpoint` flag names, unchecked (no JAX; `open_weights`
    checks it where it is loaded): 'auto' (or None) is the config's bundled weights if the
    repository has them, else random weights (None); 'none' is random weights; anything else
    a path."""
    if choice in (None, "", "auto"):
        return bundled_weights(config_name)
    if choice == "none":
        return None
    return pathlib.Path(choice)


def demo_clip(checkpoint) -> dict | None:
    """The held-out demo clip shipped with a weights directory (demo/*-portrait.png,
    *-speech.wav, *-tracks.npz: `characters-jax train demo-assets`), or None."""
    if not checkpoint:
        return None
    d = pathlib.Path(checkpoint) / "demo"
    found = {k: sorted(d.glob(f"*-{k}.{ext}")) for k, ext in (("portrait", "png"), ("speech", "wav"), ("tracks", "npz"))}
    if not all(found.values()):
        return None
    return {k: v[0] for k, v in found.items()}
