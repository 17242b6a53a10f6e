"""The run directory: one writer at a time, writable before anything starts, and what earlier
processes left there read forgivingly.

``RunDirectory.open()`` takes an exclusive ``fcntl.flock`` on ``RUN_DIR/.lock`` before anything
is written. The kernel drops the lock when its process dies, so a ``kill -9`` never leaves a stale
lock; a second process gets one line naming the holder's pid and host. In a multi-process run only
the process that writes (process 0) takes it.

A run directory in a bucket (``gs://``, ``s3://``; see ``maxlm.storage``) is locked by a lock object
with a lease instead (object stores have no flock), and the records that grow line by line
(metrics.jsonl, TensorBoard events, library.log) are written to a local mirror (``local``) and
uploaded whole by ``sync()``: at most every ``MAXLM_REMOTE_SYNC_S`` seconds (default 30), and when
the run ends. The lease lasts ``MAXLM_LEASE_S`` seconds (default 60): a restart after a ``kill -9``
is refused, in one line naming the holder, until the dead holder's lease has lapsed. A ``kill -9`` loses at most that window of records, never a checkpoint: a resumed run
redoes those steps, as it redoes the steps after its checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from maxlm import storage
from maxlm.train.resilience import TrainingError

LOCK = ".lock"
# Orbax logs through absl; asyncio reports Orbax's failed write tasks when they are collected.
LIBRARY_LOGGERS = ("absl", "asyncio", "gcsfs", "s3fs")


def check_writable(directory: Path) -> None:
    """Create and remove a probe file, so a read-only or full filesystem fails now, in one line."""
    if storage.is_remote(directory):
        probe = directory / f".probe-{os.getpid()}"
        try:
            probe.write_text("")
            probe.unlink()
        except Exception as err:  # noqa: BLE001 - fsspec raises OSError, botocore and google errors
            raise TrainingError(f"cannot write to {directory}: {type(err).__name__}: "
                                f"{' '.join(str(err).split())[:200]}") from None
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
            pass
    except FileExistsError:
        raise TrainingError(f"{directory}: exists and is not a directory") from None
    except OSError as err:
        raise TrainingError(f"cannot write to {directory}: {err.strerror or err}") from None


SYNC_SECONDS = float(os.environ.get("MAXLM_REMOTE_SYNC_S", "30"))
# A bucket run directory's lock lease: a killed holder's lock lapses this long after it died.
LEASE_SECONDS = float(os.environ.get("MAXLM_LEASE_S", "60"))


class RunDirectory:
    def __init__(self, path: str | Path, writer: bool, log: Callable[[str], None] = print):
        self.path = storage.path(path)
        self.remote = storage.is_remote(self.path)
        # Where the growing records are written: the run directory itself, or its local mirror.
        self.local = Path(tempfile.mkdtemp(prefix="maxlm-run-")) if self.remote else self.path
        self.writer, self.log = writer, log
        self._lock_file = None
        self._lease: storage.LeaseLock | None = None
        self._sent: dict[str, tuple[int, int]] = {}
        self._history: list[dict] | None = None
        self._synced_at = 0.0

    def open(self) -> "RunDirectory":
        if self.path.exists() and not self.path.is_dir():
            raise TrainingError(f"run directory {self.path} is a file; choose another --run_dir")
        if self.remote:
            self._fetch("metrics.jsonl")  # the history a resumed run appends to
        if not self.writer:
            return self
        check_writable(self.path)
        if self.remote:
            self._lease = storage.LeaseLock(self.path / LOCK, lease_s=LEASE_SECONDS)
            try:
                self._lease.acquire()
            except storage.LockHeld as err:
                self._lease = None
                raise TrainingError(f"run directory {self.path} is in use by another maxlm.train ({err}); "
                                    "wait for it to finish, or choose another --run_dir") from None
            return self
        self._lock_file = open(self.path / LOCK, "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            holder = self._lock_file.read().strip() or "unknown"
            self._lock_file.close()
            self._lock_file = None
            raise TrainingError(f"run directory {self.path} is in use by another maxlm.train ({holder}); "
                                "wait for it to finish, or choose another --run_dir") from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self._lock_file.flush()
        return self

    def _fetch(self, name: str) -> None:
        source = self.path / name
        if source.exists():
            (self.local / name).write_bytes(source.read_bytes())
            stat = (self.local / name).stat()
            self._sent[name] = (stat.st_size, stat.st_mtime_ns)

    def sync(self, force: bool = False) -> None:
        """Upload the local mirror's new or changed files to the bucket (whole: objects cannot be
        appended to). No-op for a local run directory, or within SYNC_SECONDS of the last upload."""
        if not (self.remote and self.writer) or (not force and time.monotonic() - self._synced_at < SYNC_SECONDS):
            return
        for file in sorted(p for p in self.local.rglob("*") if p.is_file()):
            name, stat = str(file.relative_to(self.local)), file.stat()
            if self._sent.get(name) != (stat.st_size, stat.st_mtime_ns):
                (self.path / name).parent.mkdir(parents=True, exist_ok=True)
                (self.path / name).write_bytes(file.read_bytes())
                self._sent[name] = (stat.st_size, stat.st_mtime_ns)
        self._synced_at = time.monotonic()

    def close(self) -> None:
        if self.remote:
            try:
                self.sync(force=True)
            finally:
                if self._lease is not None:
                    self._lease.release()
                    self._lease = None
                shutil.rmtree(self.local, ignore_errors=True)
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def __enter__(self) -> "RunDirectory":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def set_aside_checkpoints(self) -> None:
        """--fresh: move the existing checkpoints aside (never delete them)."""
        if self.writer and (self.path / "checkpoints").exists():
            aside = self.path / f"checkpoints_replaced_{time.strftime('%Y%m%d-%H%M%S')}"
            storage.move_tree(self.path / "checkpoints", aside)
            self.log(f"--fresh: moved the existing checkpoints to {aside}")

    def history(self) -> list[dict]:
        """What earlier processes of this run logged in metrics.jsonl, read once (the loop's resume
        and the run doctor both start from it). Malformed lines (a crash mid-write, an edit) are
        skipped and reported."""
        if self._history is None:
            self._history, bad = read_jsonl(self.local / "metrics.jsonl")
            if bad:
                self.log(f"{self.path / 'metrics.jsonl'}: skipped {len(bad)} malformed line(s) "
                         f"(line {', '.join(map(str, bad[:5]))}{', ...' if len(bad) > 5 else ''})")
        return self._history

    def previous_progress(self) -> int:
        """The last step an earlier process of this run logged (steps past the checkpoint are redone)."""
        return max((r["step"] for r in self.history() if isinstance(r.get("step"), int)), default=0)

    @contextlib.contextmanager
    def library_log(self) -> Iterator[None]:
        """Send the libraries' own error logs (Orbax writes a traceback per failed thread) to
        RUN_DIR/library.log while the run lasts: the user gets one line, the details are kept."""
        loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
        handler = _QuietFileHandler(self.local / "library.log", delay=True) if self.writer else logging.NullHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        saved = [logger.propagate for logger in loggers]
        for logger in loggers:
            logger.addHandler(handler)
            logger.propagate = False
        try:
            yield
        finally:
            for logger, propagate in zip(loggers, saved):
                logger.removeHandler(handler)
                logger.propagate = propagate
            handler.close()

    def write_config(self, text: str) -> None:
        if self.writer:
            storage.write_atomic(self.path / "config.gin", text)


class _QuietFileHandler(logging.FileHandler):
    def handleError(self, record) -> None:  # a full disk must not print logging's own traceback
        pass


def read_jsonl(path: Path) -> tuple[list[dict], list[int]]:
    """(the JSON objects of a JSONL file, line numbers that are not one); ([], []) if it is missing."""
    if not path.exists():
        return [], []
    rows, bad = [], []
    for number, line in enumerate(path.read_bytes().decode(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad.append(number)
    return rows, bad
