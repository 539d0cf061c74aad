"""The engine-serving contract (engine/interface.py): the worker uses its generator through
the `Generator` protocol only. DiTGenerator and FakeGenerator follow it; a generator's
`warmup` runs every program a session runs, so that no session compiles (a session before
the warm-up compiles: the negative control); the worker's composition
root (build_worker) warms its generator up through the protocol.

DiTGenerator on the tiny config, random weights of seed 0, one CPU device.
"""

import numpy as np
from jax import monitoring

from characters_jax.audio.features import AudioFrontEnd
from characters_jax.config import load_config
from characters_jax.demo.fakes import FakeGenerator, FakeWorker
from characters_jax.engine.generator import DiTGenerator
from characters_jax.engine.interface import Generator
from characters_jax.serving.warmup import WarmupReport

CFG = load_config("tiny")
SEED = 0
_COMPILES = [0]


def _count(name, *_args, **_kw):
    if name == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


monitoring.register_event_duration_secs_listener(_count)


def _session_compiles(gen, frontend, lengths) -> int:
    """XLA compilations during sessions of these prompt lengths, two steps each."""
    tokens = frontend.tokens(np.zeros(frontend.spec.window_samples, np.float32))
    latent = np.full((CFG.video.grid_h, CFG.video.grid_w, CFG.model.latent_channels), 0.1, np.float32)
    before = _COMPILES[0]
    for n in lengths:
        gen.start_session(latent, list(range(32, 32 + n)), seed=n)
        for _ in range(2):
            latent_out = gen.step(tokens)
        latent_out.block_until_ready()
    return _COMPILES[0] - before


class NoWarmup:
    """A generator without `warmup` and `compiled_programs`: not a Generator."""

    config = CFG
    step_index = 0

    def start_session(self, image_latent, prompt_tokens, seed=0):
        pass

    def step(self, audio_tokens):
        return audio_tokens


def test_the_generators_follow_the_protocol():
    assert isinstance(FakeGenerator(CFG), Generator)
    assert not isinstance(NoWarmup(), Generator)


def test_a_warmed_up_generator_compiles_nothing_in_a_session():
    frontend = AudioFrontEnd(CFG)
    frontend.tokens(np.zeros(frontend.spec.window_samples, np.float32))  # the front end's own program
    gen = DiTGenerator(CFG, tp=1, seed=SEED)
    assert isinstance(gen, Generator)
    smallest, *others = CFG.cache.prompt_buckets
    assert _session_compiles(gen, frontend, [smallest]) > 0  # the negative control: a session before the warm-up compiles
    gen.warmup()  # compiles what is left: the other buckets' prefill
    DiTGenerator(CFG, tp=1, seed=SEED).capture_state().arrays()  # another generator's programs are its own
    programs = gen.compiled_programs()
    assert programs == 1 + len(CFG.cache.prompt_buckets)  # the step and each bucket's prefill
    assert _session_compiles(gen, frontend, [0, 3, smallest + 1, *others]) == 0
    assert gen.compiled_programs() == programs


def test_the_worker_warms_its_generator_up_through_the_protocol():
    gen = FakeGenerator(CFG)
    with FakeWorker(CFG, generator=gen) as worker:
        assert gen.warmups == 1 and gen.sessions == 0
        assert isinstance(worker.server.warmup, WarmupReport) and worker.server.warmup.step_ms == 0.0
