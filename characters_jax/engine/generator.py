"""DiTGenerator: the `Generator` of one worker, one session at a time.

Owns the mesh, the parameters and the donated step state (the engine's options are the
config's [engine] table); `start_session` prefills the sink
(reusing the state's buffers: no allocation per session or per prompt length beyond the
bucketed programs), `step` denoises one latent frame. Both dispatch asynchronously.

`compile_programs` compiles the generator's programs from abstract shapes (ShapeDtypeStructs
with their shardings) before any weight exists, so that XLA's autotuning has the device's
whole pool, and measures each program's memory (XLA's memory analysis); a generator made
with those programs runs them as compiled.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from concurrent import futures

import jax
import jax.numpy as jnp
import numpy as np

from characters_jax.config import Config
from characters_jax.engine import snapshot
from characters_jax.engine.step import Engine
from characters_jax.parallel.sharding import make_mesh


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Per-device bytes of one compiled program, from XLA's memory analysis: temporaries,
    generated code, and outputs not aliased to a donated argument."""

    temp: int
    code: int
    new_outputs: int

    @classmethod
    def of(cls, compiled) -> "ProgramMemory":
        m = compiled.memory_analysis()
        if m is None:  # a backend without the analysis
            return cls(0, 0, 0)
        return cls(int(m.temp_size_in_bytes), int(m.generated_code_size_in_bytes),
                   int(m.output_size_in_bytes) - int(m.alias_size_in_bytes))


def _shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest
    shard where devices differ)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shape, dtype=np.int64)) * leaf.dtype.itemsize
    return total


@dataclasses.dataclass(frozen=True)
class GeneratorMemory:
    """Per-device bytes of the generator: parameters and step state (from their shapes and
    shardings) and each program's `ProgramMemory` by name ('init_params', 'init_state',
    'step', 'prefill_<bucket>')."""

    params: int
    state: int
    programs: Mapping[str, ProgramMemory]

    @property
    def working(self) -> int:
        """What the programs need beside the parameters and state: the largest temporaries
        of any one program (they run one at a time), every program's code, and the largest
        output of a session program that is not a donated input (the latent)."""
        ms = self.programs.values()
        session = [m.new_outputs for n, m in self.programs.items() if not n.startswith("init")]
        return max((m.temp for m in ms), default=0) + sum(m.code for m in ms) + max(session, default=0)

    def largest_temp(self) -> tuple[str, int]:
        name = max(self.programs, key=lambda n: self.programs[n].temp)
        return name, self.programs[name].temp


@dataclasses.dataclass(frozen=True)
class Programs:
    """The generator's executables on `engine`'s mesh: the step, the prefill of each prompt
    bucket compiled, the init programs (init_params None when the weights are restored), their
    memory, and each one's compile time in seconds."""

    engine: Engine
    step: object
    prefill: Mapping[int, object]
    init_params: object | None
    init_state: object
    memory: GeneratorMemory
    compile_s: Mapping[str, float]


def compile_programs(engine: Engine, buckets=None, random_weights: bool = True, workers: int | None = None) -> Programs:
    """Compiles `engine`'s step, the prefill of each prompt bucket in `buckets` (default:
    all of the config's) and the init programs from abstract shapes: no array is allocated
    but XLA's autotuning scratch. `workers` threads compile at once (XLA compiles outside
    the GIL; default: one per program)."""
    buckets = tuple(engine.cfg.cache.prompt_buckets if buckets is None else buckets)
    params, state = engine.param_shapes(), engine.state_shapes()
    jobs = {"step": lambda: engine.step.lower(params, state, *engine.step_input_shapes()),
            "init_state": lambda: engine.init_state.lower()}
    for b in buckets:
        jobs[f"prefill_{b}"] = lambda b=b: engine.prefill.lower(params, state, *engine.prefill_input_shapes(b))
    if random_weights:
        jobs["init_params"] = lambda: engine.init_params.lower(engine.key_shape())

    def compile_one(lower):
        t0 = time.perf_counter()
        compiled = lower().compile()
        return compiled, time.perf_counter() - t0

    with futures.ThreadPoolExecutor(max_workers=workers or len(jobs), thread_name_prefix="compile") as pool:
        done = {name: pool.submit(compile_one, lower) for name, lower in jobs.items()}
        compiled = {name: f.result() for name, f in done.items()}
    exe = {name: c for name, (c, _) in compiled.items()}
    memory = GeneratorMemory(_shard_bytes(params), _shard_bytes(state),
                             {name: ProgramMemory.of(c) for name, c in exe.items()})
    return Programs(engine, exe["step"], {b: exe[f"prefill_{b}"] for b in buckets}, exe.get("init_params"),
                    exe["init_state"], memory, {name: s for name, (_, s) in compiled.items()})


class DiTGenerator:
    """The engine's `Generator` (engine/interface.py)."""

    def __init__(
        self,
        config: Config,
        tp: int = 1,
        cache_mode: str | None = None,
        cache_dtype: str | None = None,
        checkpoint: str | None = None,
        seed: int = 0,
        devices=None,
        programs: Programs | None = None,
    ):
        """programs: `compile_programs` of an engine for this config at `tp` (then `devices`
        is that engine's); None: the engine's jitted programs, compiled at their first call."""
        cache = {k: v for k, v in (("mode", cache_mode), ("dtype", cache_dtype)) if v is not None}
        self.config = config.replace(cache=cache) if cache else config
        self.programs = programs
        if programs is not None:
            if programs.engine.cfg != self.config or programs.engine.mesh.size != tp:
                raise ValueError("the compiled programs are of another config or tensor-parallel size")
            self.engine, self.mesh = programs.engine, programs.engine.mesh
        else:
            self.mesh = make_mesh(tp, devices)
            self.engine = Engine(self.config, self.mesh)
        if checkpoint:
            from characters_jax.weights.dit import restore_params

            self.params = restore_params(checkpoint, self.engine)
        elif programs is not None and programs.init_params is not None:
            self.params = programs.init_params(jax.random.key(seed))
        else:
            self.params = self.engine.init_params(jax.random.key(seed))
        self.state = programs.init_state() if programs is not None else self.engine.init_state()
        self._step_index = 0
        self._copier = snapshot.StateCopier(self.engine.state_shardings)
        self.weights_id = snapshot.weights_id(checkpoint, seed)

    @property
    def step_index(self) -> int:
        return self._step_index

    def _prefill(self, bucket: int):
        if self.programs is not None and bucket in self.programs.prefill:
            return self.programs.prefill[bucket]
        return self.engine.prefill

    def _step(self):
        return self.programs.step if self.programs is not None else self.engine.step

    def start_session(self, image_latent, prompt_tokens, seed: int = 0) -> None:
        """image_latent: [grid_h, grid_w, C] float32; prompt_tokens: int ids; seed: noise seed."""
        cfg = self.config
        expected = (cfg.video.grid_h, cfg.video.grid_w, cfg.model.latent_channels)
        if tuple(np.shape(image_latent)) != expected:
            raise ValueError(f"image_latent must have shape {expected}, got {tuple(np.shape(image_latent))}")
        padded, length = self.engine.pad_prompt(prompt_tokens)
        latent = jnp.asarray(image_latent, jnp.float32).reshape(cfg.video.tokens_per_frame, cfg.model.latent_channels)
        self.state = self._prefill(padded.size)(
            self.params, self.state, latent, jnp.asarray(padded), jnp.int32(length), jnp.uint32(seed % 2**32)
        )
        self._step_index = 0

    def step(self, audio_tokens) -> jax.Array:
        """audio_tokens: [audio_tokens_per_step, audio_feature_dim] float32 -> latent [gh, gw, C]."""
        self.state, latent = self._step()(self.params, self.state, audio_tokens)
        self._step_index += 1
        return latent

    def capture_state(self) -> snapshot.StateCapture:
        """A copy of the state after the steps taken so far, on its way to the host
        (engine/snapshot.py); returns at once, the next step runs meanwhile. Its program
        compiles at the first capture (the worker's warm-up captures once when snapshots
        are on); it needs the device memory of one more state while the copy lives."""
        return self._copier.capture(self.state, self._step_index)

    def restore_state(self, arrays, step_index: int) -> None:
        """Continues a session from `capture_state().arrays()` of a generator of the same
        `state_identity()`: the next step is step `step_index`. Raises ValueError naming
        the arrays that do not fit."""
        problems = snapshot.check_arrays(arrays, self.state_shapes())
        if problems:
            raise ValueError("the state does not fit this generator: " + "; ".join(problems))
        self.state = snapshot.restore(arrays, self.engine.state_shardings)
        self._step_index = int(step_index)

    def state_shapes(self) -> dict:
        """name -> (shape, dtype name) of the state's arrays."""
        return snapshot.state_shapes(self.engine.state_shapes())

    def state_identity(self) -> dict:
        """What this generator's state is valid for (engine/snapshot.py: identity)."""
        return snapshot.identity(self.config, self.mesh.size, self.engine.options, self.weights_id)

    def warmup(self) -> None:
        """Runs the prefill of every prompt bucket and the step once (compiling what is not
        compiled yet), so that no session compiles; returns once they have run."""
        cfg = self.config
        latent = np.zeros((cfg.video.grid_h, cfg.video.grid_w, cfg.model.latent_channels), np.float32)
        for n in cfg.cache.prompt_buckets:
            self.start_session(latent, [32] * n, 0)
        self.step(jnp.zeros((cfg.model.audio_tokens_per_step, cfg.model.audio_feature_dim), jnp.float32)).block_until_ready()

    def compiled_programs(self) -> int:
        """Number of compiled executables held by this worker's programs."""
        e = self.engine
        held = 0 if self.programs is None else 1 + len(self.programs.prefill)
        return held + sum(f._cache_size() for f in (e.prefill, e.step, self._copier.program))
