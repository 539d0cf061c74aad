"""A thread pool for gRPC handlers that counts its calls, so the worker can report how
saturated each pool is.

grpc's sync server runs every RPC's handler as one call on a pool (`grpc.server`'s, or the
one a behaviour names in `experimental_thread_pool`); a streaming RPC holds its thread until
the stream ends. `busy` is the number of calls running (threads taken), `queued` the number
waiting for a thread.
"""

from __future__ import annotations

import threading
from concurrent import futures


class RpcPool(futures.ThreadPoolExecutor):
    def __init__(self, name: str, threads: int):
        """name: the pool's label in the metrics and its threads' name prefix."""
        if threads < 1:
            raise ValueError(f"pool {name}: threads must be >= 1, got {threads}")
        super().__init__(max_workers=threads, thread_name_prefix=name)
        self.name, self.threads = name, threads
        self._count_lock = threading.Lock()
        self.queued = 0
        self.busy = 0

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        with self._count_lock:
            self.queued += 1
        try:
            return super().submit(self._run, fn, args, kwargs)
        except BaseException:
            with self._count_lock:
                self.queued -= 1
            raise

    def _run(self, fn, args, kwargs):
        with self._count_lock:
            self.queued -= 1
            self.busy += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with self._count_lock:
                self.busy -= 1
