"""Test set-up (before jax loads): 4 virtual CPU devices for the tensor-parallel mesh, and a
compilation cache for this run only.

The 4 virtual devices of a process share the CI machine's 2 cores with the other test
process, the services the tests start, and whatever else runs there. XLA:CPU ends the whole
process (SIGABRT, "Termination timeout ... Exiting to ensure a consistent program state")
when a collective's participants do not all arrive within its stuck warning plus
--xla_cpu_collective_call_terminate_timeout_seconds (by default 20 + 40 s); a starved device
thread can be that late on an overloaded machine. The tests (and the processes they start, which
inherit XLA_FLAGS) wait up to COLLECTIVE_TERMINATE_S instead, past pytest-timeout's limit, so
a late participant is only late; a collective that never completes still ends there, with
XLA's message in the log (`make test` leaves the processes' stderr uncaptured).

The cache is a fresh directory, so nothing from an earlier run is reused: the tests build
many generators of the same config, and their identical programs are compiled once. It is
set through the environment, so the processes the service tests start share it. Set
CHARACTERS_TEST_COMPILE_CACHE=0 to compile everything afresh."""

import os
import tempfile

COLLECTIVE_TERMINATE_S = 900
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
if "--xla_cpu_collective_call_terminate_timeout_seconds" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" --xla_cpu_collective_call_terminate_timeout_seconds={COLLECTIVE_TERMINATE_S}"
if os.environ.get("CHARACTERS_TEST_COMPILE_CACHE", "1") != "0":
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="characters-jax-test-xla-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def engine_latents():
    """run(cfg, tp=2, steps=3) -> (generator, [steps, ...] float32): a session of the
    generator of ``cfg`` (its [engine] table; a fixed reference image, prompt and seed),
    then ``steps`` steps of fixed audio."""
    import jax.numpy as jnp
    import numpy as np

    from characters_jax.engine.generator import DiTGenerator

    def run(cfg, tp=2, steps=3):
        gen = DiTGenerator(cfg, tp=tp)
        rs = np.random.RandomState(0)
        gen.start_session(rs.randn(cfg.video.grid_h, cfg.video.grid_w,
                                   cfg.model.latent_channels).astype(np.float32),
                          list(b"hi"), seed=1)
        audio = rs.randn(steps, cfg.model.audio_tokens_per_step, cfg.model.audio_feature_dim)
        return gen, np.stack([np.asarray(gen.step(jnp.asarray(a, jnp.float32)))
                              for a in audio])

    return run
