"""Keeps a child process running: restarts it when it exits, until stopped.

Used by the worker for its decoder process. The child never outlives the worker, even
when the worker is killed hard: it is started without running Python code between fork and
exec (the parent holds JAX's threads, and a fork of a multithreaded process may deadlock),
with the supervising thread's id and its process id in its environment; the child's first
act (`die_with_parent`, called by the CLI) is to ask the kernel for SIGTERM when that parent
goes (PR_SET_PDEATHSIG), then to check that the parent is still the one that started it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from typing import Callable, Sequence

from characters_jax.processes import terminate

log = logging.getLogger("characters_jax.serving.supervisor")


PARENT_ENV = "CHARACTERS_PARENT_PID"  # set in a supervised child's environment: the pid it must not outlive
_PR_SET_PDEATHSIG = 1


def die_with_parent(environ=os.environ) -> None:
    """In a supervised child: SIGTERM when the supervising parent exits. If the parent is
    already gone (it died between the spawn and this call), exits at once. No-op for a
    process started by hand (no PARENT_ENV)."""
    expected = environ.get(PARENT_ENV)
    if not expected:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        return
    if os.getppid() != int(expected):
        os._exit(0)


REFUSED = 2  # the exit status of a command that refuses its arguments (argparse's, ours)


class Supervisor:
    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None, on_start: Callable[[int, int], None] | None = None, restart_delay_s: float = 0.5, max_delay_s: float = 10.0):
        """on_start(pid, restarts) is called each time the child starts. A child that exits
        with REFUSED (2: its command refused its arguments, config or weights) is not
        restarted: another start would only fail the same way; `refused` is then True."""
        self.name, self.argv, self.env = name, list(argv), env
        self.refused = False
        self.on_start = on_start
        self.restart_delay_s, self.max_delay_s = restart_delay_s, max_delay_s
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"supervise-{name}", daemon=True)

    @property
    def pid(self) -> int | None:
        p = self._proc
        return p.pid if p is not None else None

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        delay = self.restart_delay_s
        while not self._stop.is_set():
            t0 = time.monotonic()
            env = {**(os.environ if self.env is None else self.env), PARENT_ENV: str(os.getpid())}
            self._proc = subprocess.Popen(self.argv, env=env)
            log.info("child started", extra={"fields": {"child": self.name, "child_pid": self._proc.pid, "restarts": self.restarts}})
            if self.on_start:
                self.on_start(self._proc.pid, self.restarts)
            rc = self._proc.wait()
            if self._stop.is_set():
                break
            if rc == REFUSED:
                self.refused = True
                log.error("child refused to start; not restarting", extra={"fields": {"child": self.name, "rc": rc}})
                break
            log.warning("child exited; restarting", extra={"fields": {"child": self.name, "rc": rc, "delay_s": delay}})
            self.restarts += 1
            if time.monotonic() - t0 > 30:
                delay = self.restart_delay_s  # it ran a while: not a crash loop
            self._stop.wait(delay)
            delay = min(delay * 2, self.max_delay_s)

    def stop(self, timeout: float = 10.0) -> None:
        """Terminates the child (SIGTERM, then SIGKILL after `timeout`) and stops restarting."""
        self._stop.set()
        if self._proc is not None:
            terminate(self._proc, timeout)
        self._thread.join(timeout)
