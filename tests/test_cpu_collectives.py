"""The tensor-parallel mesh on CPU survives a late device: XLA:CPU's collective watchdog ends
the process when a participant is later than its termination timeout; the tests' processes
(and those they start) wait longer than any test may run."""

import os
import subprocess
import sys
import textwrap

from characters_jax.processes import child_env

# One psum over 4 host devices; device 3 reaches it `late` seconds after the others.
LATE_PARTICIPANT = textwrap.dedent("""
    import sys, time
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    late = float(sys.argv[1])

    def host_delay(i):
        if int(i) == 3:
            time.sleep(late)
        return np.float32(0)

    def body(x):
        i = jax.lax.axis_index("tp")
        x = x + jax.pure_callback(host_delay, jax.ShapeDtypeStruct((), jnp.float32), i)
        return jax.lax.psum(x, "tp")

    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P(), check_vma=False))
    print("sum", float(f(jnp.arange(4.0))[0]))
""")


def _run(late_s: float, xla_flags: str) -> subprocess.CompletedProcess:
    # No persistent compilation cache: the timeout is compiled into the program.
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", LATE_PARTICIPANT, str(late_s)], env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_suite_waits_for_a_late_participant():
    flags = child_env(4)["XLA_FLAGS"]
    assert "--xla_cpu_collective_call_terminate_timeout_seconds=900" in flags  # inherited by started processes
    done = _run(3.0, flags.replace("_terminate_timeout_seconds=900", "_terminate_timeout_seconds=900 "
                                   "--xla_cpu_collective_call_warn_stuck_timeout_seconds=1"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sum 6.0" in done.stdout
    assert "may be stuck" in done.stderr  # it really was late


def test_a_participant_later_than_the_watchdog_ends_the_process():
    """The control: the same program with the watchdog at 1 s (warning) + 1 s (termination)
    is aborted by XLA, as an xdist worker was (SIGABRT; the message names the late
    rendezvous). XLA's defaults are 20 s + 40 s."""
    aborted = _run(3.0, "--xla_force_host_platform_device_count=4 --xla_cpu_collective_call_warn_stuck_timeout_seconds=1 "
                        "--xla_cpu_collective_call_terminate_timeout_seconds=1")
    assert aborted.returncode == -6, (aborted.returncode, aborted.stderr[-2000:])
    assert "Termination timeout" in aborted.stderr and "only 3 of them arrived" in aborted.stderr
