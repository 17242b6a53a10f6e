"""Where the data commands write, and how an output appears: whole, or not at all.

An output (a directory for ``clean`` and ``prepare``, a file for ``train-tokenizer``) is built in a
hidden temporary sibling, ``.NAME.tmp-PID``, on the same filesystem, with its completion marker
(``report.json``, ``index.json``) written last, and renamed into place only when complete. So the
final path holds nothing, the previous finished output, or the new finished output: never half of
one. A killed run leaves only its hidden temporary, which globs skip (``*`` does not match a
leading dot) and readers refuse (no marker); the next run for the same path removes it once the
process that made it is gone.

An --out in a bucket (``gs://``, ``s3://``; ``maxlm.storage``) is built in a local temporary and
uploaded when complete, its marker last, so a reader that finds the marker finds everything; a
bucket directory that already holds anything is never replaced (choose a new --out).

Nothing the command did not create is deleted. An --out that is, contains or lies inside an input
is refused. An existing --out is replaced only with ``--overwrite``, only when it holds nothing but
what the command writes, and only after the new output is complete.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterable

from maxlm import storage


def _real(path: str) -> str:
    if storage.is_remote(path):
        return path.rstrip("/")
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def _within(inner: str, outer: str) -> bool:
    return os.path.commonpath([inner, outer]) == outer


def check_disjoint(out: str, inputs: Iterable[tuple[str, str]]) -> None:
    """Refuse (one line) an ``out`` that is, contains or lies inside an input path.

    ``inputs`` are (what, path) pairs such as ("source 'jsonl:raw/*.jsonl'", "raw")."""
    target = _real(out)
    for what, path in inputs:
        real = _real(path)
        if storage.is_remote(real) != storage.is_remote(target):
            continue  # a bucket and a local disk share nothing
        if target == real:
            relation = "is"
        elif _within(target, real):
            relation = "lies inside"
        elif _within(real, target):
            relation = "contains"
        else:
            continue
        raise ValueError(f"--out {out} {relation} the input {path} ({what}); writing there "
                         "could destroy or re-read the input, so choose an --out outside it")


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, read in 16 MiB blocks (shards and weights can be GBs)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def pid_alive(pid: int) -> bool:
    """Whether a process of this machine still runs (the owner of a temporary output)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class Output:
    """``with Output(final, ...) as tmp:`` build the output at ``tmp``; it is published at ``final``
    when the block ends normally (after ``marker`` was written), and removed on any exception.

    ``owned`` matches the top-level names the command writes: an existing directory holding
    anything else is never replaced. For a file output, pass ``marker=None, owned=None``."""

    def __init__(self, final: str, command: str, *, overwrite: bool, marker: str | None = None,
                 owned: str | None = None):
        self.remote = storage.is_remote(final)
        self.final = final.rstrip("/") if self.remote else os.path.abspath(os.path.expanduser(final))
        self.command, self.overwrite, self.marker = command, overwrite, marker
        self.owned = re.compile(owned) if owned else None
        self.is_dir = marker is not None
        parent, name = os.path.split(self.final)
        self.parent, self.name = parent, name
        self.tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}")
        self._old = os.path.join(parent, f".{name}.old-{os.getpid()}")

    def __enter__(self) -> str:
        if not self.name or self.name in (".", ".."):
            raise ValueError(f"--out {self.final!r} names no file or directory")
        if self.remote:
            return self._enter_remote()
        if os.path.isdir(self.parent):
            self._recover()
        self.replaces = self._check_existing()  # before anything is created, so a refusal leaves no trace
        os.makedirs(self.parent, exist_ok=True)
        if self.is_dir:
            os.mkdir(self.tmp)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self._discard()
            return False
        try:
            self._publish()
        except BaseException:
            self._discard()
            raise
        return False

    def _enter_remote(self) -> str:
        target = storage.path(self.final)
        if target.exists():
            if self.is_dir:
                raise ValueError(f"{self.final} already exists in the bucket; bucket outputs are never "
                                 "replaced (choose a new --out)")
            if not self.overwrite:
                raise ValueError(f"{self.final} already exists; pass --overwrite to replace it")
        self.tmp = tempfile.mkdtemp(prefix=f"maxlm-{self.name}-")
        if not self.is_dir:
            self.tmp = os.path.join(self.tmp, self.name)
        return self.tmp

    def _recover(self) -> None:
        """Deal with what killed runs for this path left: a dead run's temporary is removed; a
        previous output set aside by a dead --overwrite run is put back when nothing replaced it."""
        pattern = re.compile(rf"\.{re.escape(self.name)}\.(tmp|old)-(\d+)")
        for entry in sorted(os.listdir(self.parent)):
            m = pattern.fullmatch(entry)
            if not m:
                continue
            path, pid = os.path.join(self.parent, entry), int(m.group(2))
            if pid != os.getpid() and pid_alive(pid):
                raise ValueError(f"another run (pid {m.group(2)}) is writing {self.final} "
                                 f"now ({path}); wait for it, or remove {path} if that process is not ours")
            if m.group(1) == "old" and not os.path.lexists(self.final):
                os.rename(path, self.final)
            else:
                _remove(path)

    def _check_existing(self) -> bool:
        """True when a finished output is there to be replaced; refuse anything else."""
        final = self.final
        if not os.path.lexists(final):
            return False
        if not self.is_dir:
            if os.path.isdir(final):
                raise ValueError(f"--out {final} is a directory; give the path of a file")
            if not self.overwrite:
                raise ValueError(f"{final} already exists; pass --overwrite to replace it "
                                 "(the old file stays until the new one is complete)")
            return True
        if not os.path.isdir(final) or os.path.islink(final):
            raise ValueError(f"--out {final} exists and is not a directory")
        entries = sorted(os.listdir(final))
        if not entries:
            return False
        foreign = [e for e in entries if not self.owned.fullmatch(e)]
        if foreign:
            raise ValueError(f"--out {final} holds files this command did not write "
                             f"({', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}); "
                             "choose an empty or new directory")
        finished = self.marker in entries
        if not self.overwrite:
            state = "a finished" if finished else f"an unfinished (no {self.marker})"
            raise ValueError(f"{final} already holds {state} {self.command} output; "
                             "pass --overwrite to replace it (the old one stays until the new one is complete)")
        return True

    def _publish(self) -> None:
        if self.is_dir and not os.path.isfile(os.path.join(self.tmp, self.marker)):
            raise RuntimeError(f"internal error: {self.marker} was not written")
        if self.remote:  # one PUT per file, the marker last; then the local temporary goes
            if self.is_dir:
                storage.upload_tree(self.tmp, self.final, last=self.marker)
            else:
                storage.filesystem(self.final).put_file(self.tmp, self.final)
            self._discard()
        elif not self.is_dir:
            os.replace(self.tmp, self.final)  # atomic for a file, old or not
        elif self.replaces and os.path.lexists(self.final):
            os.rename(self.final, self._old)  # a kill between these two renames: _recover restores
            os.rename(self.tmp, self.final)
            _remove(self._old)
        else:
            try:
                os.rename(self.tmp, self.final)  # fails if someone filled the path meanwhile
            except OSError as err:
                raise ValueError(f"{self.final} was written by another run meanwhile "
                                 f"({err.strerror}); this run's output is discarded") from None

    def _discard(self) -> None:
        local = os.path.dirname(self.tmp) if self.remote and not self.is_dir else self.tmp
        if os.path.lexists(local):
            _remove(local)


def write_file(path: str, text: str, command: str) -> None:
    """One small file (a report) written whole: a temporary, then os.replace over any old one."""
    with Output(path, command, overwrite=True) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
