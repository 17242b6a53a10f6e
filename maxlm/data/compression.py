"""Compressed sources, read transparently: gzip (``.gz``, Python's gzip) and zstd (``.zst``, the
``zstandard`` package when installed; otherwise a one-line error says how to get it).

A compressed file is streamed in chunks when listed (the JSONL newline scan) and decompressed whole,
once per process, when its documents are read: a compressed stream has no random access. That
suits ``clean``, ``train-tokenizer`` and ``prepare``, which read in order; for training, ``prepare``
compressed corpora first (or keep each file small), since shuffled reads may decompress a file
again after it left the cache.
"""

from __future__ import annotations

import collections
import gzip
import zlib
from collections.abc import Iterator

SUFFIXES = (".gz", ".zst")
_CHUNK = 1 << 24
_CACHE_BYTES = 1 << 30  # decompressed bytes kept per process (at least the file being read)


def kind(path: str) -> str | None:
    """"gz", "zst" or None (plain) from the file name."""
    lower = path.lower()
    return next((s[1:] for s in SUFFIXES if lower.endswith(s)), None)


def strip_suffix(path: str) -> str:
    """The name without its compression suffix: what the content is (a.jsonl.gz -> a.jsonl)."""
    return path[: -len(kind(path)) - 1] if kind(path) else path


def require_codec(path: str) -> None:
    """Fail early, in one line, when ``path`` needs a codec that is not installed."""
    if kind(path) == "zst":
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise ValueError(f"{path} is zstd-compressed and the zstandard package is not installed: "
                             "pip install zstandard") from None


def _corrupt(path: str, err: Exception) -> OSError:
    # Decompressors raise EOFError, zlib.error or their own types; callers count OSError as
    # "unreadable", so a corrupt file is one counted problem, never a crash.
    return OSError(f"corrupt {kind(path)} data: {' '.join(str(err).split()) or type(err).__name__}")


def _zstd_blocks(path: str) -> Iterator[bytes]:
    """zstd frames one after another; a truncated last frame is an error (zstandard's stream reader
    would just stop early, silently losing the tail)."""
    require_codec(path)
    import zstandard

    with open(path, "rb") as f:
        frame, fed = zstandard.ZstdDecompressor().decompressobj(), False
        while raw := f.read(1 << 16):  # small input steps bound the output of each step
            while raw:
                fed = True
                if out := frame.decompress(raw):
                    yield out
                if not frame.eof:
                    break
                raw = frame.unused_data  # the next frame starts here
                frame, fed = zstandard.ZstdDecompressor().decompressobj(), False
        if fed and not frame.eof:
            raise EOFError("the file ends inside a zstd frame (truncated)")


def _blocks(path: str, size: int) -> Iterator[bytes]:
    if kind(path) == "zst":
        yield from _zstd_blocks(path)
        return
    with gzip.open(path, "rb") if kind(path) == "gz" else open(path, "rb") as f:
        while block := f.read(size):
            yield block


def _errors() -> tuple[type, ...]:
    errors: tuple[type, ...] = (EOFError, zlib.error, gzip.BadGzipFile)
    try:
        import zstandard

        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors


def chunks(path: str, size: int = _CHUNK) -> Iterator[bytes]:
    """The (decompressed) content of ``path`` in blocks (of about ``size`` bytes)."""
    try:
        yield from _blocks(path, size)
    except _errors() as err:
        raise _corrupt(path, err) from None


def read_head(path: str, limit: int) -> bytes:
    """At most ``limit`` bytes of the (decompressed) content: a bounded read, never a whole bomb."""
    head, got = [], 0
    for block in chunks(path, min(limit, _CHUNK)):
        head.append(block)
        got += len(block)
        if got >= limit:
            break
    return b"".join(head)[:limit]


class Decompressed:
    """A per-process LRU of whole decompressed files, for reading lines at known offsets."""

    def __init__(self, budget: int = _CACHE_BYTES):
        self.budget, self.files = budget, collections.OrderedDict()

    def pread(self, path: str, length: int, offset: int) -> bytes:
        data = self.files.pop(path, None)
        if data is None:
            data = b"".join(chunks(path))
            while self.files and sum(map(len, self.files.values())) + len(data) > self.budget:
                self.files.popitem(last=False)
        self.files[path] = data
        return data[offset:offset + length]
