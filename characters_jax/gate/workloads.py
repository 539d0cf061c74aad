"""What every run of the gate runs, prepared once: a random-weights session, or the trained
model's held-out clips.

`RandomSession` (no checkpoint; the latent distance on any config, characters-57b included):
weights drawn from the config's seed (block weights snapped to the FP8 grid unless
`latent.float_weights`), one session of `latent.steps` steps on random inputs rounded to the
activation dtype. `HeldOutClips` (a weights directory): the trained model runs every
held-out clip through the service's path (`sessions.ClipSession`: prefill with the
VAE-encoded portrait, one step per audio window) and the trained VAE decodes each clip with
its temporal state carried, as the decoder process does; a metric may add longer clips
(`add_long_clips`, the lip-sync drift).

`run(engine, params, ref_run)` gives one run's `Outputs`; a perturbed reference run
(`runs.RefRun`) gets its perturbation here: 'ulp' nudges the inputs by one ulp of the
activation dtype (the engine nudges its noise), 'seed' moves every noise seed.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from characters_jax.config import Config
from characters_jax.gate import runs as R
from characters_jax.gate.options import ClipOptions, LatentOptions

SEED_SHIFT = 7919  # a 'seed' reference run k moves every noise seed by k * SEED_SHIFT


@dataclasses.dataclass(frozen=True)
class Outputs:
    """One run's outputs. latents float32 [items, steps, gh, gw, C] (host); frames: per item
    uint8 [T, H, W, 3] as the decoder process decodes them (None: not decoded); long: the
    long clips' Outputs (None: none asked for)."""

    latents: np.ndarray
    frames: list | None = None
    long: "Outputs | None" = None

    @property
    def finite(self) -> bool:
        return bool(np.isfinite(self.latents).all())


def _seed_shift(ref_run: R.RefRun | None) -> int:
    return SEED_SHIFT * ref_run.ulp_seed if ref_run is not None and ref_run.kind == "seed" else 0


def _ulp_seed(ref_run: R.RefRun | None) -> int:
    return ref_run.ulp_seed if ref_run is not None and ref_run.kind == "ulp" else 0


# -- random weights, one session ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Inputs:
    """One session's inputs. image_latent [gh, gw, C] f32; prompt [B] int32 (padded to its
    bucket) with `prompt_len` real tokens; audio [K, A_tok, F_a] f32; seed: the noise seed."""

    image_latent: np.ndarray
    prompt: np.ndarray
    prompt_len: int
    audio: np.ndarray
    seed: int

    @property
    def steps(self) -> int:
        return len(self.audio)


def make_inputs(cfg: Config, steps: int, prompt_bucket_fn, seed: int = 0) -> Inputs:
    """Random inputs, already rounded to the activation dtype (so a one-ulp nudge is exact)."""
    rs = np.random.RandomState(seed)
    dt = R.act_dtype(cfg)
    v, m = cfg.video, cfg.model
    image = rs.randn(v.grid_h, v.grid_w, m.latent_channels).astype(dt).astype(np.float32)
    audio = rs.randn(steps, m.audio_tokens_per_step, m.audio_feature_dim).astype(dt).astype(np.float32)
    prompt = list(b"a person talking to the camera")[: cfg.cache.max_prompt_tokens]
    padded, n = prompt_bucket_fn(prompt)
    return Inputs(image_latent=image, prompt=padded, prompt_len=n, audio=audio, seed=seed + 1)


def perturb(inputs: Inputs, cfg: Config, seed: int) -> Inputs:
    """The same inputs with the image latent and the audio features nudged by one ulp (the
    in-step noise is nudged in the engine: ``make_engine(..., noise_ulp_seed=seed)``)."""
    dt = R.act_dtype(cfg)
    return dataclasses.replace(inputs, image_latent=R.nudge_ulp(inputs.image_latent, dt, 2 * seed),
                               audio=R.nudge_ulp(inputs.audio, dt, 2 * seed + 1))


def run_session(engine, params, inputs: Inputs, sync_each_step: bool = False) -> np.ndarray:
    """Prefill + K steps; returns the latents [K, grid_h, grid_w, C] float32 (host).

    sync_each_step: wait for each step (XLA:CPU with several virtual devices runs more
    smoothly on few cores when programs do not queue up).
    """
    state = engine.init_state()
    state = engine.prefill(params, state, jnp.asarray(inputs.image_latent.reshape(-1, inputs.image_latent.shape[-1])),
                           jnp.asarray(inputs.prompt), jnp.int32(inputs.prompt_len), jnp.uint32(inputs.seed))
    audio = jax.device_put(jnp.asarray(inputs.audio), engine.replicated)
    latents = []
    for s in range(inputs.steps):
        state, latent = engine.step(params, state, audio[s])
        if sync_each_step:
            latent.block_until_ready()
        latents.append(latent)
    out = np.stack([np.asarray(x) for x in latents])
    del state
    return out


class RandomSession:
    """Random weights (the config's seed) and one random session of `options.steps` steps."""

    name = "random session"
    default_perturbations = None  # runs.reference_plan's: ulp, tp and, on GPUs, a repeat
    default_variants = ("ring-bf16", "ring-fp8", "fp8-attention", "fp8-gemm", "fused-reduce", "ppermute")

    def __init__(self, options: LatentOptions = LatentOptions()):
        self.options = options
        self.inputs: Inputs | None = None
        self.config: Config | None = None

    def prepare(self, bench) -> tuple[object, object]:
        """(the reference engine at bench's tp, its params)."""
        cfg, seed = bench.config, bench.config.seed
        self.config = cfg
        if not self.options.float_weights:
            bench.notes.append("reference block weights on the FP8 grid (e4m3 x power-of-two scale per layer): "
                               "FP8-weight variants run the same model; their divergence is the FP8 arithmetic")
        if cfg.model.dtype == "float32":
            bench.notes.append("activations float32: the reference's spread is float32 rounding, so any bf16/FP8 "
                               "storage lies outside it; --set model.dtype=bfloat16 matches the serving configs")
        with bench.timer("init"):
            engine = R.make_engine(cfg, bench.settings.tp)
            params = engine.init_params(jax.random.key(seed))
            if not self.options.float_weights:
                params = R.snap_to_fp8_grid(params)
            self.inputs = make_inputs(cfg, self.options.steps, engine.pad_prompt, seed)
            jax.block_until_ready(params)
        return engine, params

    def describe(self) -> str:
        return f"random weights, one session of {self.options.steps} steps"

    def run(self, engine, params, ref_run: R.RefRun | None = None, log=None) -> Outputs:
        inputs = self.inputs
        if _ulp_seed(ref_run):
            inputs = perturb(inputs, self.config, _ulp_seed(ref_run))
        if _seed_shift(ref_run):
            inputs = dataclasses.replace(inputs, seed=inputs.seed + _seed_shift(ref_run))
        lat = run_session(engine, params, inputs, sync_each_step=jax.default_backend() == "cpu")
        return Outputs(lat[None])


# -- the trained model, held-out clips ----------------------------------------------------------
DEFAULT_CLIP_PERTURBATIONS = ("ulp", "seed", "tp", "seed")
# The reference's run-to-run variation on the trained model: a one-ulp nudge, other noise
# seeds (what two sessions of the same system differ by: each draws its own noise), another
# tp size where the devices allow. The ulp/tp runs alone barely move a trained model's
# scores (a few ulps of chaos), so a band of their spread would fail every FP8 path; planted
# bugs stay far outside the seed band (BUILD_NOTES.md, The quality gate).
DEFAULT_CLIP_VARIANTS = ("ring-bf16", "ring-fp8", "fp8-attention", "qkv-kernel", "fp8-gemm", "fp8-gemm-row",
                         "stacked-gemm", "stacked-gemm-row", "quant-kernels", "fused-reduce", "ppermute", "production",
                         "ppermute@tp2", "production@tp2")


def _rounded(clips, dtype):
    """clip inputs rounded to the activation dtype, so that a one-ulp nudge is exact."""
    r = lambda x: np.asarray(x, np.float32).astype(dtype).astype(np.float32)  # noqa: E731
    return dataclasses.replace(clips, latent=r(clips.latent), tokens=r(clips.tokens))


class HeldOutClips:
    """The trained model (a weights directory) on `options.count` held-out clips."""

    name = "held-out clips"
    default_perturbations = DEFAULT_CLIP_PERTURBATIONS
    default_variants = DEFAULT_CLIP_VARIANTS

    def __init__(self, checkpoint: str, options: ClipOptions = ClipOptions()):
        self.checkpoint, self.options = checkpoint, options
        self.plans = self.clips = self.vae = None
        self.long_plans = self.long = None
        self.config: Config | None = None
        self._seed = 0

    def prepare(self, bench) -> tuple[object, object]:
        """Opens the weights (FileNotFoundError / WeightsError before anything runs), makes
        or loads the held-out plans, encodes the clips' inputs, restores the reference's
        params; returns (the reference engine, its params)."""
        from characters_jax.decoder.runtime import VaeRuntime
        from characters_jax.gate.clips import clip_inputs, make_plans
        from characters_jax.weights.dit import dit_checkpoint, restore_params

        cfg, o = bench.config, self.options
        self.config, self._seed = cfg, cfg.seed
        dit = dit_checkpoint(self.checkpoint, bench.given_config)  # every start-up check of the weights directory
        with bench.timer("plans"):
            bench.log(f"held-out plans: {o.count} x {o.seconds:g} s")
            self.plans = make_plans(cfg, o.plans_dir, o.count, o.seconds, self._seed)
        with bench.timer("init"):
            self.vae = VaeRuntime(cfg, checkpoint=self.checkpoint)
            self.clips = _rounded(clip_inputs(cfg, self.plans, self.vae, self._seed), R.act_dtype(cfg))
            engine = R.make_engine(cfg, bench.settings.tp)
            params = restore_params(dit, engine)
        return engine, params

    def add_long_clips(self, bench, count: int, seconds: float) -> None:
        """`count` more held-out clips of `seconds` (after the others), run beside them."""
        from characters_jax.gate.clips import clip_inputs, make_plans

        o = self.options
        with bench.timer("plans"):
            bench.log(f"held-out plans: {count} x {seconds:g} s (long clips)")
            self.long_plans = make_plans(self.config, o.plans_dir, count, seconds, self._seed, first=o.count)
        with bench.timer("init"):
            self.long = _rounded(clip_inputs(self.config, self.long_plans, self.vae, self._seed + o.count),
                                 R.act_dtype(self.config))

    def describe(self) -> str:
        o = self.options
        return f"weights {self.checkpoint}, {o.count} held-out clips x {o.seconds:g} s"

    def _perturbation(self, ulp_seed: int):
        """perturb(latent, tokens, i): both nudged one ulp of the activation dtype (None: no nudge)."""
        if not ulp_seed:
            return None
        dt = R.act_dtype(self.config)

        def nudge(latent, tokens, i):
            s = 1_000_003 * ulp_seed + 2 * i
            return R.nudge_ulp(latent, dt, s), R.nudge_ulp(tokens, dt, s + 1)

        return nudge

    def _clips(self, session, clips, nudge, shift: int, on_clip) -> Outputs:
        lats, frames = [], []
        for i in range(len(clips)):
            latent, tokens = clips.latent[i], clips.tokens[i]
            if nudge is not None:
                latent, tokens = nudge(latent, tokens, i)
            z = session(latent, tokens, int(clips.seed[i]) + shift)
            lats.append(z)
            frames.append(self.vae.decode_stream(z)[: clips.frames])
            on_clip(i)
        return Outputs(np.stack(lats), frames)

    def run(self, engine, params, ref_run: R.RefRun | None = None, log=None) -> Outputs:
        from characters_jax.gate.sessions import ClipSession

        log = log or (lambda msg: None)
        label = "variant" if ref_run is None else ref_run.label
        nudge, shift = self._perturbation(_ulp_seed(ref_run)), _seed_shift(ref_run)
        n, t0 = len(self.clips), time.perf_counter()
        every = max(1, n // 5)

        def progress(i):
            if (i + 1) % every == 0 or i + 1 == n:
                log(f"{label}: {i + 1}/{n} clips ({time.perf_counter() - t0:.1f} s)")

        session = ClipSession(engine, params)
        out = self._clips(session, self.clips, nudge, shift, progress)
        if self.long is not None:
            long = self._clips(session, self.long, nudge, shift, lambda i: None)
            log(f"{label}: {len(self.long)} long clips ({time.perf_counter() - t0:.1f} s)")
            out = dataclasses.replace(out, long=long)
        return out
