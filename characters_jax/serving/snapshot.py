"""A live session's snapshots, from the step boundary to the store.

At a boundary (between two steps, on the step loop's thread) the session's conversation is
exported (conversation.py: the speech timeline, playback, events, limits) and a copy of the
generator's step state is dispatched on the device, its host transfer started
(`Generator.capture_state`): the step loop goes on at once. The decoder's temporal state
after the boundary's last step comes back in order on the decoder stream (DecoderLink's
state request) and completes the `Boundary`; a writer thread of the session's own then
waits for the host copies, writes the snapshot to the store and reports it committed. One
snapshot is in progress at a time: a periodic one that falls due meanwhile waits for the
next boundary.

The kinds: PERIODIC (every [serve] snapshot_interval_s), REQUESTED (the client's
SnapshotRequest), MIGRATE (the worker drains: the step loop stops at the boundary and the
session ends MIGRATED once the snapshot is committed).

`SessionSnapshots` also holds the session's claim in the store (snapshot_store.py) from its
start to its end; a session that completes (or is closed) has its snapshots removed.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from characters_jax.serving.snapshot_store import Claim, SnapshotStore

log = logging.getLogger("characters_jax.serving.snapshot")

PERIODIC, REQUESTED, MIGRATE = "PERIODIC", "REQUESTED", "MIGRATE"
WRITER_JOIN_S = 60.0  # how long a session's end waits for a snapshot being written


@dataclasses.dataclass(frozen=True)
class Committed:
    """A snapshot in the store: its kind, step (the first step a resume generates), the
    client inputs it holds, its bytes, and its times: from the boundary to the commit and the
    write alone (seconds)."""

    kind: str
    step: int
    inputs: int
    bytes: int
    snapshot_s: float
    write_s: float


@dataclasses.dataclass
class Boundary:
    """A snapshot begun at a step boundary: its manifest fields, the conversation's arrays,
    the generator's capture in flight, and when it began (time.perf_counter)."""

    kind: str
    step: int
    t0: float
    manifest: dict
    arrays: dict[str, np.ndarray]
    capture: object


class SessionSnapshots:
    def __init__(self, store: SnapshotStore, claim: Claim, interval_s: float, metrics, now: Callable[[], float] = time.monotonic):
        """interval_s: periodic snapshots (0: none). `on_commit(Committed)`, set by the
        session: a PERIODIC or REQUESTED snapshot is in the store (called on the writer
        thread)."""
        self.store, self.claim, self.interval_s, self.metrics = store, claim, interval_s, metrics
        self.on_commit: Callable[[Committed], None] | None = None
        self._now = now
        self._next_due = now() + interval_s if interval_s > 0 else None
        self._lock = threading.Lock()
        self._in_progress = 0
        self._queue: queue.Queue[tuple[Boundary, list | None, str | None] | None] = queue.Queue()
        self._migration = threading.Event()
        self._migration_result: Committed | str | None = None
        self._writer = threading.Thread(target=self._write_loop, name=f"snapshots-{claim.session_id[:8]}", daemon=True)
        self._writer.start()

    @property
    def session_id(self) -> str:
        return self.claim.session_id

    def due(self) -> bool:
        """Whether a periodic snapshot is due at this boundary (none is in progress)."""
        with self._lock:
            return self._next_due is not None and self._in_progress == 0 and self._now() >= self._next_due

    def begin(self, kind: str, step: int, t0: float, manifest: dict, arrays: dict[str, np.ndarray], capture) -> Boundary:
        """A snapshot at the boundary before `step` (manifest: its fields; arrays: the
        conversation's, named 'conversation/...'; capture: the generator's). Completed by
        `decoder_state`."""
        with self._lock:
            self._in_progress += 1
            if self.interval_s > 0:
                self._next_due = self._now() + self.interval_s
        return Boundary(kind, step, t0, manifest, arrays, capture)

    def decoder_state(self, boundary: Boundary, arrays: list[np.ndarray] | None, error: str | None = None) -> None:
        """The decoder's state after the boundary's last step (DecoderLink, in order), or
        why it did not come: the boundary goes to the writer."""
        self._queue.put((boundary, arrays, error))

    def wait_migration(self, timeout: float) -> Committed | str:
        """The MIGRATE snapshot's outcome: Committed, or why it failed."""
        if not self._migration.wait(timeout):
            return f"the snapshot was not committed within {timeout:g} s"
        return self._migration_result

    def close(self, remove: bool) -> None:
        """The session ended: waits for a write in progress, removes the session's
        snapshots when `remove` (it completed or was closed), releases the claim."""
        self._queue.put(None)
        self._writer.join(WRITER_JOIN_S)
        try:
            if remove:
                self.store.remove(self.session_id, self.claim)
        except OSError:
            log.exception("could not remove the session's snapshots", extra={"fields": {"session_id": self.session_id}})
        finally:
            self.claim.release()

    # -- the writer ------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            boundary, decoder, error = item
            outcome: Committed | str
            try:
                if error is not None:
                    raise RuntimeError(error)
                outcome = self._write(boundary, decoder)
            except Exception as err:  # a failed snapshot never ends the session by itself
                outcome = f"{type(err).__name__}: {err}"
                self.metrics.snapshot_failures.labels(boundary.kind).inc()
                log.error("snapshot failed", extra={"fields": {"session_id": self.session_id, "kind": boundary.kind, "step": boundary.step,
                                                               "error": outcome}})
            finally:
                with self._lock:
                    self._in_progress -= 1
            if isinstance(outcome, Committed):
                self.metrics.snapshot_committed(outcome, self.store)
                log.info("snapshot committed", extra={"fields": {"session_id": self.session_id, "kind": outcome.kind, "step": outcome.step,
                                                                 "bytes": outcome.bytes, "snapshot_ms": round(outcome.snapshot_s * 1e3, 1),
                                                                 "write_ms": round(outcome.write_s * 1e3, 1)}})
            if boundary.kind == MIGRATE:
                self._migration_result = outcome
                self._migration.set()
            elif isinstance(outcome, Committed) and self.on_commit is not None:
                self.on_commit(outcome)

    def _write(self, boundary: Boundary, decoder: list[np.ndarray]) -> Committed:
        arrays = dict(boundary.arrays)
        arrays.update((f"generator/{name}", a) for name, a in boundary.capture.arrays().items())
        arrays.update((f"decoder/{i:03d}", np.asarray(a)) for i, a in enumerate(decoder))
        written = self.store.write(boundary.manifest, arrays)
        return Committed(boundary.kind, boundary.step, int(boundary.manifest["inputs"]), written.bytes,
                         time.perf_counter() - boundary.t0, written.write_s)
