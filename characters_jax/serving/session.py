"""Session records and the worker's single session slot.

A `SessionRecord` moves NOT_READY -> READY -> RUNNING -> COMPLETED | FAILED | CANCELLED
(READY may also end CANCELLED or FAILED) with an end reason (an EndReason name). The
`SessionTable` holds at most one live session (a second gets `SlotBusy` ->
RESOURCE_EXHAUSTED) and the last finished ones for GetSession. State changes call the
table's listener (health status and metrics); `wait_idle` lets a drain wait for the slot.

Every session has a secret `token` (secrets.token_urlsafe, 256 bits) that only its creator
receives; `find` returns a session only to a caller that presents it (compared in constant
time), so a session id alone opens nothing. The token is left out of the record's repr.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import secrets
import threading
import time
import uuid
from typing import Callable

import grpc

from characters_jax.serving.conversation import Limits

LIVE = ("NOT_READY", "READY", "RUNNING")
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")
_NEXT = {
    "NOT_READY": ("READY", "FAILED", "CANCELLED"),
    "READY": ("RUNNING", "FAILED", "CANCELLED"),
    "RUNNING": TERMINAL,
}


class SlotBusy(Exception):
    pass


@dataclasses.dataclass
class SessionRecord:
    """Mutable record of one session; fields change only under the table's lock."""

    session_id: str
    seed: int
    prompt_tokens: int
    created_unix_ms: int
    limits: Limits
    state: str = "NOT_READY"
    status_code: grpc.StatusCode = grpc.StatusCode.OK
    status_message: str = ""
    end_reason: str = "END_REASON_UNSPECIFIED"
    steps: int = 0
    frames: int = 0
    token: str = dataclasses.field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    resumable: bool = False  # snapshotted and resumable (Session.resumable)
    snapshot_interval_s: float = 0.0  # its periodic snapshots (0: none)

    @property
    def live(self) -> bool:
        return self.state in LIVE


class SessionTable:
    def __init__(self, on_change: Callable[[SessionRecord, str | None, bool], None], keep_finished: int = 64):
        """on_change(record, old_state, worker_idle) is called after every state change."""
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._live: SessionRecord | None = None
        self._finished: collections.OrderedDict[str, SessionRecord] = collections.OrderedDict()
        self._keep = keep_finished
        self._on_change = on_change

    def reserve(self, seed: int, prompt_tokens: int, limits: Limits, resumed: SessionRecord | None = None) -> SessionRecord:
        """Takes the slot with a NOT_READY session (resumed: the record of a session that
        goes on from a snapshot: its id, token and creation time are kept). Raises SlotBusy."""
        with self._lock:
            if self._live is not None:
                raise SlotBusy(f"this worker is serving another session ({self._live.state}); one session per worker")
            rec = resumed or SessionRecord(uuid.uuid4().hex, seed, prompt_tokens, int(time.time() * 1000), limits)
            self._live = rec
        self._on_change(rec, None, False)
        return rec

    def get(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            if self._live is not None and self._live.session_id == session_id:
                return self._live
            return self._finished.get(session_id)

    def find(self, session_id: str, token: str) -> SessionRecord | None:
        """The session `session_id` if `token` is its token, else None (the id unknown or the
        token wrong: the caller cannot tell which)."""
        rec = self.get(session_id) if session_id else None
        expected = rec.token if rec is not None else secrets.token_urlsafe(32)  # compared all the same
        return rec if hmac.compare_digest(expected.encode(), token.encode()) and rec is not None else None

    @property
    def live(self) -> SessionRecord | None:
        with self._lock:
            return self._live

    def wait_idle(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for the slot to be free; returns whether it is."""
        with self._idle:
            return self._idle.wait_for(lambda: self._live is None, timeout)

    def transition(self, rec: SessionRecord, new: str, code: grpc.StatusCode = grpc.StatusCode.OK, message: str = "",
                   reason: str = "END_REASON_UNSPECIFIED", *, only_from: str | None = None) -> bool:
        """Moves rec to `new` if allowed from its current state (and, with `only_from`, only
        from that state); returns whether it moved. Entering a terminal state (with `reason`,
        an EndReason name) frees the slot."""
        with self._lock:
            old = rec.state
            if new not in _NEXT.get(old, ()) or (only_from is not None and old != only_from):
                return False
            rec.state, rec.status_code, rec.status_message = new, code, message
            idle = False
            if new in TERMINAL:
                rec.end_reason = reason
                if self._live is rec:
                    self._live = None
                    self._finished[rec.session_id] = rec
                    while len(self._finished) > self._keep:
                        self._finished.popitem(last=False)
                    idle = True
                    self._idle.notify_all()
        self._on_change(rec, old, idle)
        return True
