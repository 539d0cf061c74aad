"""What the project's processes do to each other: a child's environment, stopping a child,
stopping on a signal, and the JSON state file a process writes once it is ready."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import threading

log = logging.getLogger("characters_jax.processes")


def host_device_flags(flags: str, count: int) -> str:
    """XLA_FLAGS with the host platform's device count set to `count`."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", flags).strip()
    return f"{flags} --xla_force_host_platform_device_count={count}".strip()


def child_env(device_count: int = 1, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with its own XLA host device count, plus `extra`."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = host_device_flags(env.get("XLA_FLAGS", ""), device_count)
    env.update(extra or {})
    return env


def terminate(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """Stops a child: SIGTERM (a worker drains), SIGKILL if it is still running after
    `timeout` seconds. Returns its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def stop_on_signals() -> threading.Event:
    """An event set by the first SIGTERM / SIGINT; later ones are logged and change nothing
    (a drain runs to its deadline, however often it is asked for). The handler takes no lock
    (the main thread it interrupts may hold the event's own, e.g. inside stop.wait()): it
    writes the signal's number to a pipe, and a watcher thread logs it and sets the event."""
    stop = threading.Event()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def handler(signum, _frame):
        try:
            os.write(write_fd, bytes([signum]))
        except BlockingIOError:  # the pipe is full: the watcher has signals enough to read
            pass

    def watch():
        while True:
            signum = os.read(read_fd, 1)[0]
            log.info("signal received", extra={"fields": {"signal": signal.Signals(signum).name, "draining": stop.is_set()}})
            stop.set()

    threading.Thread(target=watch, name="stop-on-signals", daemon=True).start()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def write_state_file(path: str | os.PathLike | None, data: dict) -> None:
    """Writes `data` as JSON to `path` atomically (a reader sees the old file or the new
    one); no path: nothing."""
    if not path:
        return
    tmp = pathlib.Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
