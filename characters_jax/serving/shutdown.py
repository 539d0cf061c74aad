"""A hard deadline on a worker process's shutdown.

Draining and stopping are each bounded (the drain timeout, the server's stop grace), but a
thread stuck where nothing can reach it (a handler in a call that never returns) would
still keep the interpreter from exiting: Python joins its thread pools' threads at exit.
`exit_after` ends the process regardless once the deadline passes, so SIGTERM always ends
the worker within the [serve] table's drain_timeout_s plus a few seconds.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

log = logging.getLogger("characters_jax.serving.shutdown")

SLACK_S = 20.0  # beyond the drain timeout: ending the session, stopping the server and the decoder
EXIT_OVERRAN = 1


def exit_after(seconds: float) -> threading.Thread:
    """Ends this process with EXIT_OVERRAN `seconds` from now unless it has exited by then."""
    def deadline() -> None:
        time.sleep(seconds)
        log.error("shutdown overran its deadline; exiting", extra={"fields": {"deadline_s": seconds}})
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(EXIT_OVERRAN)

    thread = threading.Thread(target=deadline, name="shutdown-deadline", daemon=True)
    thread.start()
    return thread
