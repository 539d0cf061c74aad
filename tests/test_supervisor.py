"""The supervised child: started without a fork of the multithreaded worker, and gone when
its parent is killed hard."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

# A parent that holds JAX's threads (as the worker does), supervises one child that reports
# its pid on a file, then waits to be killed.
PARENT = textwrap.dedent("""
    import sys, time, pathlib, warnings
    warnings.simplefilter("always")
    import jax, jax.numpy as jnp
    jnp.ones(4).block_until_ready()   # the runtime's threads exist
    from characters_jax.serving.supervisor import Supervisor
    child = [sys.executable, "-c", {child!r}, sys.argv[1]]
    Supervisor("child", child).start()
    time.sleep(600)
""")
CHILD = textwrap.dedent("""
    import os, sys, time, pathlib
    from characters_jax.serving.supervisor import die_with_parent
    {guard}
    pathlib.Path(sys.argv[1]).write_text(str(os.getpid()))
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _start(tmp_path, guard: str):
    pidfile = tmp_path / "child.pid"
    script = PARENT.format(child=CHILD.format(guard=guard))
    with open(tmp_path / "parent.err", "w") as err:  # a file: the child inherits it, a pipe would stay open
        parent = subprocess.Popen([sys.executable, "-c", script, str(pidfile)], stderr=err,
                                  env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert _wait(lambda: pidfile.exists() and pidfile.read_text(), 120), "the child never started"
    return parent, int(pidfile.read_text())


@pytest.mark.parametrize("guarded", [True, False], ids=["die_with_parent", "unguarded-control"])
def test_a_child_does_not_outlive_a_killed_parent(tmp_path, guarded):
    parent, child = _start(tmp_path, "die_with_parent()" if guarded else "")
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        gone = _wait(lambda: not _alive(child), 10)
        assert gone == guarded, "the guarded child must exit with its parent; the unguarded control stays"
        stderr = (tmp_path / "parent.err").read_text()
        assert "fork()" not in stderr, stderr  # no fork of the multithreaded parent
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
