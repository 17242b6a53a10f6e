"""The run directory: one writer at a time, writable before anything starts, and what earlier
processes left there read forgivingly.

``RunDirectory.open()`` takes an exclusive ``fcntl.flock`` on ``RUN_DIR/.lock`` before anything
is written. The kernel drops the lock when its process dies, so a ``kill -9`` never leaves a stale
lock; a second process gets one line naming the holder's pid and host. In a multi-process run only
the process that writes (process 0) takes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from maxlm.train.resilience import TrainingError

LOCK = ".lock"
# Orbax logs through absl; asyncio reports Orbax's failed write tasks when they are collected.
LIBRARY_LOGGERS = ("absl", "asyncio")


def check_writable(directory: Path) -> None:
    """Create and remove a probe file, so a read-only or full filesystem fails now, in one line."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
            pass
    except FileExistsError:
        raise TrainingError(f"{directory}: exists and is not a directory") from None
    except OSError as err:
        raise TrainingError(f"cannot write to {directory}: {err.strerror or err}") from None


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` all at once: a crash leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunDirectory:
    def __init__(self, path: str | Path, writer: bool, log: Callable[[str], None] = print):
        self.path = Path(path).expanduser()
        self.writer, self.log = writer, log
        self._lock_file = None

    def open(self) -> "RunDirectory":
        if self.path.exists() and not self.path.is_dir():
            raise TrainingError(f"run directory {self.path} is a file; choose another --run_dir")
        if not self.writer:
            return self
        check_writable(self.path)
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

    def close(self) -> None:
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
            (self.path / "checkpoints").rename(aside)
            self.log(f"--fresh: moved the existing checkpoints to {aside}")

    def previous_progress(self) -> int:
        """The last step an earlier process of this run logged (steps past the checkpoint are redone).
        Malformed lines of metrics.jsonl (a crash mid-write, an edit) are skipped and reported."""
        rows, bad = read_jsonl(self.path / "metrics.jsonl")
        if bad:
            self.log(f"{self.path / 'metrics.jsonl'}: skipped {len(bad)} malformed line(s) "
                     f"(line {', '.join(map(str, bad[:5]))}{', ...' if len(bad) > 5 else ''})")
        return max((r["step"] for r in rows if isinstance(r.get("step"), int)), default=0)

    @contextlib.contextmanager
    def library_log(self) -> Iterator[None]:
        """Send the libraries' own error logs (Orbax writes a traceback per failed thread) to
        RUN_DIR/library.log while the run lasts: the user gets one line, the details are kept."""
        loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
        handler = _QuietFileHandler(self.path / "library.log", delay=True) if self.writer else logging.NullHandler()
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
            write_atomic(self.path / "config.gin", text)


class _QuietFileHandler(logging.FileHandler):
    def handleError(self, record) -> None:  # a full disk must not print logging's own traceback
        pass


def read_jsonl(path: Path) -> tuple[list[dict], list[int]]:
    """(the JSON objects of a JSONL file, line numbers that are not one); ([], []) if it is missing."""
    if not path.exists():
        return [], []
    rows, bad = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
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
