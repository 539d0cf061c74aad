"""The snapshot store: a directory that every worker of a deployment mounts
([serve] snapshot_dir), where live sessions' snapshots are written and resumed from.

Layout, one directory per session and per snapshot:
  <root>/<session_id>/<step, 12 digits>/manifest.json   the snapshot's description (JSON)
  <root>/<session_id>/<step, 12 digits>/arrays.bin      its arrays, back to back
  <root>/<session_id>/claim                             held (flock) by the worker running the session
A snapshot is written into a hidden directory beside its final name and renamed into place,
so a reader sees a whole snapshot or none. The manifest is self-describing: the format
version, the kind and step, what the state is valid for (`identity`: the config's generative
sections, tp, engine options, weights), every array's name, dtype, shape, offset and CRC-32,
the session's own record (the owner's token only as its SHA-256), and the manifest's own
CRC-32. Reading checks them all, in an order that tells nothing to a caller without the
session's token:
  NOT_FOUND            no such session or snapshot, or the token is wrong (one message)
  DATA_LOSS            a manifest that does not parse or whose checksum fails, an array
                       file too short, an array whose CRC-32 fails (named)
  FAILED_PRECONDITION  another format version, or a state for another config, tp, engine or
                       weights (every field that differs, named)
  ABORTED              the session is live on a worker (its claim is held)
A session is claimed (flock on its claim file) by the worker running it, from its start to
its end: a snapshot is resumed by one worker at a time, and a worker that dies releases its
claim with its process. Claim files are never removed while a session's snapshots exist.

Limits (`prune`): the latest `keep_per_session` snapshots of each session; sessions whose
newest snapshot is older than `keep_s` and that no worker claims are removed; beyond
`max_bytes` the unclaimed sessions are removed oldest first. A session that completes is
removed by its worker (`remove`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import hmac
import json
import logging
import os
import pathlib
import re
import secrets
import shutil
import time
import zlib

import numpy as np

from characters_jax.decoder.tensors import dtype_of
from characters_jax.engine.snapshot import differences

log = logging.getLogger("characters_jax.serving.snapshot_store")

FORMAT = "characters-jax-snapshot/1"
_SESSION_ID = re.compile(r"^[0-9a-f]{32}$")
_STEP_DIR = re.compile(r"^\d{12}$")
MANIFEST, ARRAYS, CLAIM = "manifest.json", "arrays.bin", "claim"


class SnapshotError(Exception):
    """A snapshot that cannot be written or resumed; `code` is the gRPC status name."""

    code = "INTERNAL"


class SnapshotNotFound(SnapshotError):
    code = "NOT_FOUND"


class SnapshotCorrupt(SnapshotError):
    code = "DATA_LOSS"


class SnapshotMismatch(SnapshotError):
    code = "FAILED_PRECONDITION"


class SnapshotLive(SnapshotError):
    code = "ABORTED"


class StoreFull(SnapshotError):
    code = "RESOURCE_EXHAUSTED"


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _crc(buf) -> str:
    return f"{zlib.crc32(buf) & 0xFFFFFFFF:08x}"


def _manifest_crc(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    return _crc(json.dumps(body, sort_keys=True).encode())


@dataclasses.dataclass(frozen=True)
class Written:
    """A committed snapshot: its directory, its bytes (manifest and arrays) and the seconds
    its write took."""

    path: pathlib.Path
    bytes: int
    write_s: float


class Snapshot:
    """A snapshot found in the store: its checked manifest (`SnapshotStore.read`), and its
    arrays by name once `load` has read and checked them."""

    def __init__(self, manifest: dict, path: pathlib.Path, where: str):
        self.manifest, self.path, self.where = manifest, path, where
        self.arrays: dict[str, np.ndarray] = {}

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def load(self) -> dict[str, np.ndarray]:
        """Reads the arrays, checking each one's CRC-32 (SnapshotCorrupt names the first
        that fails)."""
        self.arrays = _read_arrays(self.path, self.manifest["arrays"], self.where)
        return self.arrays

    def group(self, prefix: str) -> dict[str, np.ndarray]:
        """The loaded arrays named '<prefix>/<name>', by <name>."""
        return {k[len(prefix) + 1 :]: v for k, v in self.arrays.items() if k.startswith(prefix + "/")}


class Claim:
    """The flock a worker holds on a session while it runs it (`SnapshotStore.claim`)."""

    def __init__(self, fd: int, session_id: str):
        self._fd, self.session_id = fd, session_id

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


class SnapshotStore:
    def __init__(self, root: str | os.PathLike, max_bytes: int = 0, keep_s: float = 0.0, keep_per_session: int = 2):
        """max_bytes: the store's size limit (0: none); keep_s: remove sessions whose newest
        snapshot is older (0: never by age); keep_per_session: snapshots kept per session."""
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.keep_s, self.keep_per_session = int(max_bytes), float(keep_s), max(1, int(keep_per_session))

    # -- paths -------------------------------------------------------------------------------
    def _session_dir(self, session_id: str) -> pathlib.Path:
        if not _SESSION_ID.match(session_id or ""):
            raise SnapshotNotFound(_not_found(session_id))
        return self.root / session_id

    def steps(self, session_id: str) -> list[int]:
        """The session's committed snapshots' steps, ascending."""
        d = self._session_dir(session_id)
        try:
            return sorted(int(p.name) for p in d.iterdir() if _STEP_DIR.match(p.name))
        except FileNotFoundError:
            return []

    # -- claims ------------------------------------------------------------------------------
    def claim(self, session_id: str, holder: str) -> Claim:
        """Claims the session for this process (until Claim.release or the process ends).
        Raises SnapshotLive when a worker holds it."""
        d = self._session_dir(session_id)
        d.mkdir(exist_ok=True)
        fd = os.open(d / CLAIM, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SnapshotLive(f"session {session_id} is live on a worker: a snapshot is resumed by one worker at a time "
                               "(resume it once that session has ended or moved)") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"holder": holder, "pid": os.getpid(), "since_unix": time.time()}).encode())
        return Claim(fd, session_id)

    def claimed(self, session_id: str) -> bool:
        """Whether a worker (this process included, through another claim) holds the session."""
        try:
            claim = self.claim(session_id, "probe")
        except SnapshotLive:
            return True
        except (SnapshotNotFound, OSError):
            return False
        claim.release()
        return False

    # -- writing -----------------------------------------------------------------------------
    def write(self, manifest: dict, arrays: dict[str, np.ndarray]) -> Written:
        """Commits a snapshot (manifest: the caller's fields, with `session.session_id` and
        `step`; the store adds the format, the array index and the checksums), then prunes
        the session's older snapshots and the store. Raises StoreFull when the store's
        limit leaves no room even after pruning."""
        t0 = time.perf_counter()
        session_id, step = manifest["session"]["session_id"], int(manifest["step"])
        d = self._session_dir(session_id)
        size = sum(int(np.asarray(a).nbytes) for a in arrays.values())
        if self.max_bytes:
            self.prune(need_bytes=size)
            if self.usage() + size > self.max_bytes:
                raise StoreFull(f"the snapshot store at {self.root} holds {self.usage()} bytes; a snapshot of {size} bytes would pass "
                                f"its limit of {self.max_bytes} (serve.snapshot_max_gib) and every session in it is live")
        d.mkdir(exist_ok=True)
        tmp = d / f".tmp-{step:012d}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            index, offset = [], 0
            with open(tmp / ARRAYS, "wb") as f:
                for name, a in arrays.items():
                    a = np.asarray(a)
                    a = a if a.flags.c_contiguous else a.copy()  # (ascontiguousarray would make a 0-d array 1-d)
                    buf = memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
                    f.write(buf)
                    index.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape), "offset": offset,
                                  "nbytes": int(a.nbytes), "crc32": _crc(buf)})
                    offset += int(a.nbytes)
                f.flush()
                os.fsync(f.fileno())
            full = {**manifest, "format": FORMAT, "arrays": index, "written_unix": time.time()}
            full["manifest_crc32"] = _manifest_crc(full)
            with open(tmp / MANIFEST, "w") as f:
                json.dump(full, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            final = d / f"{step:012d}"
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in self.steps(session_id)[: -self.keep_per_session]:
            shutil.rmtree(d / f"{old:012d}", ignore_errors=True)
        written = Written(final, offset + (final / MANIFEST).stat().st_size, time.perf_counter() - t0)
        if self.max_bytes or self.keep_s:
            self.prune()
        return written

    # -- reading -----------------------------------------------------------------------------
    def read(self, session_id: str, token: str, step: int | None, identity: dict) -> "Snapshot":
        """The snapshot of `session_id` at `step` (None: its latest), for the holder of the
        session's token, its manifest checked against this worker's `identity` (module
        docstring); its arrays are read and checked by `Snapshot.load`."""
        d = self._session_dir(session_id)
        steps = self.steps(session_id)
        chosen = steps[-1] if step is None and steps else step
        path = d / f"{chosen:012d}" if chosen is not None else None
        if path is None or not (path / MANIFEST).is_file():
            raise SnapshotNotFound(_not_found(session_id, step))
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            stored = manifest["session"]["token_sha256"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise SnapshotCorrupt(f"snapshot {chosen} of session {session_id}: its manifest does not read ({type(err).__name__})") from None
        if not hmac.compare_digest(str(stored).encode(), token_digest(token).encode()):
            raise SnapshotNotFound(_not_found(session_id, step))
        where = f"snapshot {chosen} of session {session_id}"
        if manifest.get("manifest_crc32") != _manifest_crc(manifest):
            raise SnapshotCorrupt(f"{where}: the manifest's checksum does not match its contents")
        if manifest.get("format") != FORMAT:
            raise SnapshotMismatch(f"{where}: format {manifest.get('format')!r}; this worker reads {FORMAT!r}")
        diff = differences(manifest.get("identity", {}), identity)
        if diff:
            raise SnapshotMismatch(f"{where} was taken on another setup: " + "; ".join(diff))
        return Snapshot(manifest, path, where)

    # -- limits ------------------------------------------------------------------------------
    def usage(self) -> int:
        """Bytes of committed snapshots in the store."""
        return sum(size for _, _, size in self._sessions())

    def _sessions(self) -> list[tuple[str, float, int]]:
        """(session_id, newest snapshot's mtime, bytes) of every session directory."""
        out = []
        for d in self.root.iterdir() if self.root.is_dir() else ():
            if not _SESSION_ID.match(d.name):
                continue
            try:
                newest, size = d.stat().st_mtime, 0
                for snap in d.iterdir():
                    if _STEP_DIR.match(snap.name):
                        for f in snap.iterdir():
                            st = f.stat()
                            size += st.st_size
                            newest = max(newest, st.st_mtime)
            except FileNotFoundError:  # removed meanwhile
                continue
            out.append((d.name, newest, size))
        return out

    def prune(self, need_bytes: int = 0) -> list[str]:
        """Removes unclaimed sessions past keep_s, then, oldest first, until `need_bytes`
        more fit under max_bytes. Returns the sessions removed."""
        removed = []
        now = time.time()
        sessions = sorted(self._sessions(), key=lambda x: x[1])
        total = sum(size for *_, size in sessions)
        for session_id, newest, size in sessions:
            expired = self.keep_s > 0 and now - newest > self.keep_s
            over = self.max_bytes > 0 and total + need_bytes > self.max_bytes
            if (expired or over) and self._remove_unclaimed(session_id):
                removed.append(session_id)
                total -= size
        if removed:
            log.info("snapshot store pruned", extra={"fields": {"sessions_removed": len(removed), "bytes": total}})
        return removed

    def _remove_unclaimed(self, session_id: str) -> bool:
        try:
            claim = self.claim(session_id, "prune")
        except (SnapshotLive, SnapshotNotFound, OSError):
            return False
        try:
            self._remove_dir(session_id)
        finally:
            claim.release()
        return True

    def remove(self, session_id: str, claim: Claim) -> None:
        """Removes a session's snapshots; the caller holds its claim (the session ended)."""
        if claim.session_id != session_id or not claim.held:
            raise ValueError("remove needs the session's own claim")
        self._remove_dir(session_id)

    def _remove_dir(self, session_id: str) -> None:
        d = self._session_dir(session_id)
        graveyard = self.root / f".removed-{session_id}-{secrets.token_hex(4)}"
        try:
            os.rename(d, graveyard)  # readers see it gone at once
        except FileNotFoundError:
            return
        shutil.rmtree(graveyard, ignore_errors=True)


def _not_found(session_id: str, step: int | None = None) -> str:
    which = "its latest snapshot" if step is None else f"snapshot {step}"
    return (f"no {which} of session {session_id!r} in the snapshot store, or its session_token is missing or wrong "
            "(snapshots are removed once their session completes)")


def _read_arrays(path: pathlib.Path, index: list[dict], where: str) -> dict[str, np.ndarray]:
    try:
        raw = np.fromfile(path / ARRAYS, dtype=np.uint8)
    except OSError as err:
        raise SnapshotCorrupt(f"{where}: {ARRAYS} does not read ({err.strerror})") from None
    need = sum(int(e["nbytes"]) for e in index)
    if raw.size != need:
        raise SnapshotCorrupt(f"{where}: {ARRAYS} is {raw.size} bytes, the manifest lists {need}")
    out = {}
    for e in index:
        buf = raw[e["offset"] : e["offset"] + e["nbytes"]]
        if _crc(buf.data) != e["crc32"]:
            raise SnapshotCorrupt(f"{where}: array {e['name']}: its CRC-32 does not match (damaged)")
        try:
            out[e["name"]] = buf.view(dtype_of(e["dtype"])).reshape(e["shape"]).copy()
        except ValueError as err:
            raise SnapshotCorrupt(f"{where}: array {e['name']}: {err}") from None
    return out
