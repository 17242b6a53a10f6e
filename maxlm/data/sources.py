"""Document sources: random access to raw documents, with every piece of bad input counted.

A source lists its documents up front (a directory walk; for JSONL a newline scan; for Parquet the
footer metadata) and reads a document only when asked for its index, so Grain can shuffle and
shard it. ``read(i)`` returns a ``Record`` that says what was wrong, if anything:

    unreadable      the path could not be opened or read (vanished, permission, broken link, corrupt)
    empty           nothing (or only whitespace) to read
    binary          a NUL byte in the first 8 KiB: not text
    oversized       longer than max_doc_bytes (a 100 MB line is counted here, never loaded whole)
    malformed_json  a JSONL line that does not parse
    missing_field   the JSONL field / Parquet column is absent, null or not a string
and, not a reason to drop: ``replaced`` counts invalid UTF-8 bytes decoded as U+FFFD (and lone
surrogates from JSON escapes such as ``"\\ud800"``, which no encoder accepts), and ``Utf8Tally``
lists where they were. A UTF-8 byte-order mark is not text: it is dropped, the record kept.
Files ending in ``.gz`` or ``.zst`` are decompressed as they are read (maxlm.data.compression).

A source that holds no document at all, and a directory that is an unfinished ``clean`` output
(it has ``audit/`` but no ``report.json``: the run was killed), are refused with a one-line
ValueError that names the source.

``clean`` and ``prepare`` turn these into report counts. The training pipeline, which reads raw
sources directly only for convenience, skips such documents and logs each kind with its count.
Each source has a stable ``__repr__`` (relative paths and a digest), part of the data fingerprint
stored with the iterator state.
"""

from __future__ import annotations

import codecs
import collections
import glob
import hashlib
import json
import logging
import os
import re
import sysconfig
from collections.abc import Iterator, Sequence

import numpy as np

from maxlm.data import compression
from maxlm.data.spec import SourceSpec, parse_source
from maxlm.storage import local_input

log = logging.getLogger("maxlm.data")

TEXT_SUFFIXES = (".py", ".txt", ".rst", ".md")
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
DEFAULT_MAX_DOC_BYTES = 32 << 20
DROP_KINDS = ("unreadable", "empty", "binary", "oversized", "malformed_json", "missing_field")
_BINARY_SNIFF = 8192
_INK = np.ones(256, dtype=np.uint8)  # 1 for a byte that is not JSON whitespace
_INK[[9, 10, 13, 32]] = 0
_U64 = np.uint64


class Problems:
    """Counts of bad input by kind, with the first few places (path or path:line) of each."""

    def __init__(self, examples: int = 5, keep_all: bool = False):
        self.counts: collections.Counter = collections.Counter()
        self.examples: dict[str, list[str]] = {}
        self._keep = examples
        self.entries: list[tuple[str, str, int, str]] | None = [] if keep_all else None

    def add(self, kind: str, where: str, n: int = 1, detail: str = "") -> None:
        self.counts[kind] += n
        if self.entries is not None:
            self.entries.append((kind, where, n, detail))
        shown = self.examples.setdefault(kind, [])
        if len(shown) < self._keep:
            shown.append(f"{where}: {detail}" if detail else where)

    def merge(self, other: "Problems") -> None:
        for kind, n in other.counts.items():
            self.counts[kind] += n
            shown = self.examples.setdefault(kind, [])
            shown.extend(other.examples.get(kind, [])[: self._keep - len(shown)])

    def to_dict(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())),
                "examples": {k: v for k, v in sorted(self.examples.items()) if v}}

    def __bool__(self) -> bool:
        return bool(self.counts)


class Record:
    """One document as read: text (None when dropped), the problem if any, and fixes made."""

    __slots__ = ("id", "text", "problem", "detail", "replaced")

    def __init__(self, id: str, text: str | None, problem: str | None = None, detail: str = "",
                 replaced: int = 0):
        self.id, self.text, self.problem, self.detail, self.replaced = id, text, problem, detail, replaced

    def __repr__(self) -> str:
        return f"Record({self.id!r}, problem={self.problem!r}, chars={len(self.text or '')})"


def decode(data: bytes) -> tuple[str, int]:
    """(text, invalid bytes replaced by U+FFFD); a leading byte-order mark is dropped."""
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - data.count("\ufffd".encode())


_SURROGATES = re.compile("[\ud800-\udfff]")


def fix_surrogates(text: str) -> tuple[str, int]:
    """(text with lone surrogates replaced by U+FFFD, how many): JSON may escape them, but no UTF-8
    encoder (nor the tokenizers) accepts them."""
    if text.isascii() or not _SURROGATES.search(text):
        return text, 0
    return _SURROGATES.subn("\ufffd", text)


class Utf8Tally:
    """Documents in which invalid UTF-8 was replaced by U+FFFD: counted, and where (path:line)."""

    KEEP = 1000  # places listed in a report; the counts cover all

    def __init__(self):
        self.docs = self.replaced = 0
        self.where: list[str] = []

    def add(self, rec: "Record") -> None:
        if rec.replaced:
            self.docs += 1
            self.replaced += rec.replaced
            if len(self.where) < self.KEEP:
                self.where.append(rec.id)

    def to_dict(self) -> dict:
        return {"docs": self.docs, "replaced": self.replaced, "where": self.where,
                "where_truncated": self.docs > len(self.where)}


def utf8_summary(tally: dict | None) -> str:
    """One summary line from ``Utf8Tally.to_dict()`` ("" when the input was clean UTF-8)."""
    if not tally or not tally["docs"]:
        return ""
    docs, where = tally["docs"], tally["where"]
    shown = ", ".join(where[:5]) + (f" ... ({docs:,} in all, listed in the report)" if docs > 5 else "")
    return (f"  invalid UTF-8: {tally['replaced']:,} bad sequence(s) in {docs:,} document(s) replaced by "
            f"U+FFFD, documents kept: {shown}")


def why(err: OSError) -> str:
    return err.strerror or " ".join(str(err).split()) or type(err).__name__


def looks_binary(data: bytes) -> bool:
    return b"\x00" in data[:_BINARY_SNIFF]


def _splitmix(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer (splitmix64 finaliser), vectorised."""
    with np.errstate(over="ignore"):
        x = (x + _U64(0x9E3779B97F4A7C15)).astype(_U64)
        x = ((x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)).astype(_U64)
        x = ((x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)).astype(_U64)
        return x ^ (x >> _U64(31))


def _path_key(relpath: str) -> int:
    digest = hashlib.sha1(relpath.replace(os.sep, "/").encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big")


class _Warner:
    """Training-time reads log each kind of bad input the first few times, then every 1000th."""

    def __init__(self):
        self.counts = collections.Counter()

    def __call__(self, spec: str, rec: Record) -> None:
        self.counts[rec.problem] += 1
        n = self.counts[rec.problem]
        if n <= 3 or n % 1000 == 0:
            log.warning("maxlm.data: %s: skipped %s (%s%s); %d such document(s) so far in this process",
                        spec, rec.id, rec.problem, f": {rec.detail}" if rec.detail else "", n)


class DocSource:
    """Base of the raw sources. Subclasses define __len__, read(i), keys() and __repr__."""

    spec: str
    problems: Problems  # found while listing (files that are never indexed)

    def __init__(self):
        self._warn = _Warner()

    def __getitem__(self, index: int) -> str:
        """The text for Grain; "" (skipped downstream, logged here) when the record is bad."""
        rec = self.read(int(index))
        if rec.problem:
            self._warn(self.spec, rec)
            return ""
        return rec.text

    def __len__(self) -> int:
        raise NotImplementedError

    def read(self, index: int) -> Record:
        raise NotImplementedError

    def keys(self) -> np.ndarray:
        """A stable uint64 per document, from its path (and line/row): the train/eval split key."""
        raise NotImplementedError

    def records(self) -> Iterator[Record]:
        for i in range(len(self)):
            yield self.read(i)

    def __getstate__(self):
        state = dict(self.__dict__)
        for key in [k for k in state if k.startswith("_open")]:
            state[key] = None  # file handles stay in the process that opened them
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)


class Subset:
    """Documents ``indices`` of a source (a train or eval split), as a Grain data source."""

    def __init__(self, source: DocSource, indices: np.ndarray, name: str):
        self.source, self.indices, self.name = source, np.asarray(indices, dtype=np.int64), name
        self.spec = source.spec

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> str:
        return self.source[int(self.indices[index])]

    def read(self, index: int) -> Record:
        return self.source.read(int(self.indices[index]))

    @property
    def relpaths(self) -> tuple[str, ...]:
        """For one-document-per-file sources: the files of this subset."""
        return tuple(self.source.relpaths[i] for i in self.indices)

    def __repr__(self) -> str:
        digest = hashlib.sha1(self.indices.tobytes()).hexdigest()[:8]
        return f"{self.source!r}[{self.name}: {len(self)} docs, {digest}]"


class TextFiles(DocSource):
    """One document per file (text or code). Empty, oversized and unreadable files are counted at
    listing; binary files and invalid UTF-8 when read."""

    def __init__(self, spec: str, root: str, relpaths: Sequence[str], problems: Problems | None = None,
                 max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES):
        super().__init__()
        self.spec, self.root, self.relpaths = spec, root, tuple(relpaths)
        self.pattern = _relative_pattern(spec, root)
        self.problems = problems or Problems()
        self.max_doc_bytes = max_doc_bytes

    def __len__(self) -> int:
        return len(self.relpaths)

    def read(self, index: int) -> Record:
        rel = self.relpaths[index]
        try:  # decompressed when the name ends in .gz or .zst
            data = compression.read_head(os.path.join(self.root, rel), self.max_doc_bytes + 1)
        except OSError as err:  # vanished or unreadable since listing, or corrupt
            return Record(rel, None, "unreadable", why(err))
        if len(data) > self.max_doc_bytes:
            return Record(rel, None, "oversized", f"> {self.max_doc_bytes} bytes")
        if looks_binary(data):
            return Record(rel, None, "binary")
        text, replaced = decode(data)
        if not text.strip():
            return Record(rel, None, "empty")
        return Record(rel, text, replaced=replaced)

    def keys(self) -> np.ndarray:
        return np.array([_path_key(p) for p in self.relpaths], dtype=_U64)

    def __repr__(self) -> str:
        # Relative paths keep the repr (and so a checkpoint's validity) independent of install
        # location; the digest makes any change to the file list visible.
        digest = hashlib.sha1("\n".join(self.relpaths).encode("utf-8", "surrogateescape")).hexdigest()[:12]
        return f"TextFiles({self.pattern!r}, num_files={len(self)}, digest={digest})"


def _relative_pattern(spec: str, root: str) -> str:
    """What a repr shows of a spec: the glob below its fixed root ("**/*.txt"), so the identity of
    a source does not change when its corpus moves to another directory or machine."""
    if spec == "stdlib":
        return "stdlib"
    parsed = parse_source(spec)
    expanded = local_input(parsed.path)
    rel = os.path.relpath(expanded, root) if root not in (".", "") else expanded
    return f"{parsed.kind}:{rel}"


def glob_root(expanded: str) -> str:
    """The directory part of a glob before its first wildcard ("raw/web" for "raw/web/*/*.jsonl")."""
    parts = expanded.split(os.sep)
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts) - 1)
    return os.sep.join(parts[:fixed]) or (os.sep if expanded.startswith(os.sep) else ".")


def input_paths(spec: str | SourceSpec) -> list[tuple[str, str]]:
    """(what, path) of everything a source may read: the glob's fixed directory, or the one file
    it names; an output must not be, contain or lie inside any of them (maxlm.data.atomic)."""
    spec = parse_source(spec) if isinstance(spec, str) else spec
    what = f"source {spec.text!r}"
    if spec.kind == "stdlib":
        return [(what, sysconfig.get_paths()["stdlib"])]
    expanded = local_input(spec.path)
    if spec.kind != "packed" and glob.has_magic(expanded):
        return [(what, glob_root(expanded))]
    return [(what, expanded)]


def _unfinished_clean(directory: str) -> bool:
    """A `clean` output whose run was killed (or still runs): audit/ exists, report.json not yet."""
    return (os.path.isdir(os.path.join(directory, "audit"))
            and not os.path.exists(os.path.join(directory, "report.json")))


def _list_files(spec: SourceSpec, max_doc_bytes: int) -> tuple[str, list[str], Problems]:
    """(root, sorted relative paths of files worth reading, listing problems) for a glob."""
    expanded = local_input(spec.path)
    root = glob_root(expanded)
    problems = Problems(keep_all=True)
    kept = []
    for path in sorted(glob.glob(expanded, recursive=True)):
        rel = os.path.relpath(path, root)
        try:
            st = os.stat(path)
        except OSError as err:  # a broken symlink, a path that vanished, a loop
            problems.add("unreadable", rel, detail=why(err))
            continue
        if os.path.isdir(path):
            continue  # a directory matched by '**' is not a document
        if not os.access(path, os.R_OK):
            problems.add("unreadable", rel, detail="permission denied")
        elif st.st_size == 0:
            problems.add("empty", rel)
        elif spec.kind == "files" and st.st_size > max_doc_bytes and not compression.kind(path):
            problems.add("oversized", rel, detail=f"{st.st_size} bytes > {max_doc_bytes}")
        else:  # a compressed file's size is known only when it is read
            kept.append(path)
    if not kept:
        found = sum(problems.counts.values())
        why_not = f" ({found} matched but none is usable: {dict(problems.counts)})" if found else ""
        raise ValueError(f"source {spec.text!r} matched no readable files{why_not} "
                         "(give a glob of files, e.g. 'files:corpus/**/*.txt')")
    for directory in sorted({os.path.dirname(p) for p in kept}):
        if _unfinished_clean(directory):
            raise ValueError(f"source {spec.text!r}: {directory or '.'} is an unfinished `clean` output "
                             "(audit/ but no report.json: the run was killed or is still running); "
                             "run clean again, or leave it out of the glob")
    for path in kept:
        compression.require_codec(path)
    return root, [os.path.relpath(p, root) for p in kept], problems


def stdlib_files(max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES) -> TextFiles:
    """The running interpreter's standard library: its .py and text files, no third-party code."""
    root = sysconfig.get_paths()["stdlib"]
    relpaths, problems = [], Problems(keep_all=True)
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        for name in files:
            path = os.path.join(directory, name)
            if not name.endswith(TEXT_SUFFIXES):
                continue
            if not (os.path.isfile(path) and os.access(path, os.R_OK)):
                problems.add("unreadable", os.path.relpath(path, root))
            elif os.path.getsize(path) == 0:
                problems.add("empty", os.path.relpath(path, root))
            else:
                relpaths.append(os.path.relpath(path, root))
    if not relpaths:
        raise ValueError(f"DataConfig.source = 'stdlib': no text files found under {root}")
    return TextFiles("stdlib", root, sorted(relpaths), problems, max_doc_bytes)


class _Handles:
    """A small per-process cache of open file descriptors (closed least recently used first)."""

    def __init__(self, limit: int = 64):
        self.limit, self.fds = limit, collections.OrderedDict()

    def pread(self, path: str, length: int, offset: int) -> bytes:
        fd = self.fds.pop(path, None)
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
            while len(self.fds) >= self.limit:
                os.close(self.fds.popitem(last=False)[1])
        self.fds[path] = fd
        return os.pread(fd, length, offset)

    def __del__(self):
        try:
            for fd in self.fds.values():
                os.close(fd)
        except Exception:  # at interpreter exit os may already be gone
            pass


def _get_field(obj, field: str):
    for part in field.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


class JsonlFiles(DocSource):
    """One document per line of JSON Lines files (plain, .gz or .zst), its text in ``field``. Lines
    are located by a newline scan over blocks (so a 100 MB line costs a scan, not a load); blank
    lines are not documents and are counted as ``blank_lines``. CRLF line ends are fine."""

    def __init__(self, spec: SourceSpec, max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES):
        super().__init__()
        self.spec, self.field, self.max_doc_bytes = spec.text, spec.field, max_doc_bytes
        self.root, self.relpaths, self.problems = _list_files(spec, max_doc_bytes)
        starts, lengths, lines, counts = [], [], [], []
        for rel in list(self.relpaths):
            try:
                s, n, no = self._scan(os.path.join(self.root, rel))
            except OSError as err:
                self.problems.add("unreadable", rel, detail=why(err))
                s = n = no = np.zeros(0, np.int64)
            starts.append(s), lengths.append(n), lines.append(no), counts.append(len(s))
        self.starts = np.concatenate(starts)
        self.lengths = np.concatenate(lengths)
        self.line_numbers = np.concatenate(lines).astype(np.int64)  # 1-based, for messages
        self.ends = np.cumsum(counts)  # documents in files [0..k]
        self._open_handles = None

    def _scan(self, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        newlines, marks, size, carry = [], [], 0, 0
        for block in compression.chunks(path):
            buf = np.frombuffer(block, dtype=np.uint8)
            nl = np.flatnonzero(buf == 10)
            # Non-whitespace bytes of each line that ends in this block (a newline byte counts 0, so
            # segments may include it); what follows the last newline carries into the next block.
            ink = _INK[buf]
            if len(nl):
                per_line = np.add.reduceat(ink, np.concatenate([[0], nl[:-1] + 1]), dtype=np.int64)
                tail = int(ink[nl[-1] + 1:].sum())
                per_line[-1] -= tail
                per_line[0] += carry
                carry = tail
            else:
                per_line = np.zeros(0, np.int64)
                carry += int(ink.sum())
            newlines.append(nl + size), marks.append(per_line)
            size += len(buf)
        if size == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
        newlines = np.concatenate(newlines)
        starts = np.concatenate([[0], newlines + 1])
        lengths = np.concatenate([newlines, [size]]) - starts
        numbers = np.arange(1, len(starts) + 1)
        # Whitespace-only lines (and a final newline's empty tail) are layout, not records.
        blank = np.concatenate([np.concatenate(marks), [carry]]) == 0
        counted = int(blank.sum()) - (1 if lengths[-1] == 0 else 0)  # the trailing newline is not a line
        if counted > 0:
            self.problems.add("blank_lines", os.path.relpath(path, self.root), n=counted)
        keep = ~blank
        return starts[keep].astype(np.int64), lengths[keep].astype(np.int64), numbers[keep]

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def _locate(self, index: int) -> tuple[str, str]:
        file_index = int(np.searchsorted(self.ends, index, side="right"))
        rel = self.relpaths[file_index]
        return rel, f"{rel}:{int(self.line_numbers[index])}"

    def read(self, index: int) -> Record:
        rel, where = self._locate(index)
        length = int(self.lengths[index])
        if length > self.max_doc_bytes:
            return Record(where, None, "oversized", f"{length} bytes > {self.max_doc_bytes}")
        if self._open_handles is None:  # plain files by pread; compressed ones decompressed once
            self._open_handles = (_Handles(), compression.Decompressed())
        path = os.path.join(self.root, rel)
        reader = self._open_handles[1 if compression.kind(rel) else 0]
        try:
            data = reader.pread(path, length, int(self.starts[index]))
        except OSError as err:
            return Record(where, None, "unreadable", why(err))
        text, replaced = decode(data)  # a byte-order mark before the first record is dropped
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as err:
            return Record(where, None, "malformed_json", err.msg)
        except RecursionError:  # "[[[[..." nested deeper than Python's stack
            return Record(where, None, "malformed_json", "nested too deeply")
        value = _get_field(obj, self.field)
        if not isinstance(value, str):
            got = "absent" if value is None else type(value).__name__
            return Record(where, None, "missing_field", f"{self.field!r} is {got}")
        if not value.strip():
            return Record(where, None, "empty")
        value, surrogates = fix_surrogates(value)
        return Record(where, value, replaced=replaced + surrogates)

    def keys(self) -> np.ndarray:
        per_file = np.array([_path_key(p) for p in self.relpaths], dtype=_U64)
        file_of = np.searchsorted(self.ends, np.arange(len(self)), side="right")
        with np.errstate(over="ignore"):
            return _splitmix(per_file[file_of] ^ _splitmix(self.line_numbers.astype(_U64)))

    def __repr__(self) -> str:
        h = hashlib.sha1("\n".join(self.relpaths).encode("utf-8", "surrogateescape"))
        h.update(self.lengths.tobytes())
        return (f"JsonlFiles({_relative_pattern(self.spec, self.root)!r}, field={self.field!r}, "
                f"num_files={len(self.relpaths)}, "
                f"num_docs={len(self)}, digest={h.hexdigest()[:12]})")


class ParquetFiles(DocSource):
    """One document per row of Parquet files, its text in ``field`` (a string column). Row groups
    are read whole and the last few kept per process, so sequential reading is fast."""

    def __init__(self, spec: SourceSpec, max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES):
        import pyarrow.parquet as pq

        super().__init__()
        self.spec, self.field, self.max_doc_bytes = spec.text, spec.field, max_doc_bytes
        self.root, relpaths, self.problems = _list_files(spec, max_doc_bytes)
        self.relpaths, groups = [], []  # groups: (file index, row group, rows, first row in file)
        for rel in relpaths:
            try:
                meta = pq.ParquetFile(os.path.join(self.root, rel))
            except Exception as err:  # pyarrow raises ArrowInvalid/OSError for corrupt files
                self.problems.add("unreadable", rel, detail=" ".join(str(err).split())[:200])
                continue
            if self.field not in meta.schema_arrow.names:
                self.problems.add("missing_field", rel, n=meta.metadata.num_rows,
                                  detail=f"no column {self.field!r} (has {meta.schema_arrow.names[:8]})")
                continue
            offset = 0
            for g in range(meta.num_row_groups):
                rows = meta.metadata.row_group(g).num_rows
                groups.append((len(self.relpaths), g, rows, offset))
                offset += rows
            self.relpaths.append(rel)
        self.groups = np.array(groups, dtype=np.int64).reshape(-1, 4)
        self.ends = np.cumsum(self.groups[:, 2]) if len(groups) else np.zeros(0, np.int64)
        self._open_cache = None

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def _group(self, g: int) -> list:
        import pyarrow.parquet as pq

        if self._open_cache is None:
            self._open_cache = collections.OrderedDict()
        if g in self._open_cache:
            self._open_cache.move_to_end(g)
            return self._open_cache[g]
        file_index, group = self.groups[g, 0], self.groups[g, 1]
        path = os.path.join(self.root, self.relpaths[file_index])
        column = pq.ParquetFile(path).read_row_group(int(group), columns=[self.field]).column(0)
        values = column.to_pylist()
        self._open_cache[g] = values
        while len(self._open_cache) > 4:
            self._open_cache.popitem(last=False)
        return values

    def read(self, index: int) -> Record:
        g = int(np.searchsorted(self.ends, index, side="right"))
        first = int(self.ends[g] - self.groups[g, 2])
        where = f"{self.relpaths[self.groups[g, 0]]}:row{int(self.groups[g, 3]) + index - first}"
        try:
            value = self._group(g)[index - first]
        except Exception as err:
            return Record(where, None, "unreadable", " ".join(str(err).split())[:200])
        replaced = 0
        if isinstance(value, bytes):
            value, replaced = decode(value)
        if not isinstance(value, str):
            got = "null" if value is None else type(value).__name__
            return Record(where, None, "missing_field", f"{self.field!r} is {got}")
        if len(value) > self.max_doc_bytes and len(value.encode("utf-8")) > self.max_doc_bytes:
            return Record(where, None, "oversized", f"> {self.max_doc_bytes} bytes")
        if not value.strip():
            return Record(where, None, "empty")
        return Record(where, value, replaced=replaced)

    def keys(self) -> np.ndarray:
        per_file = np.array([_path_key(p) for p in self.relpaths], dtype=_U64)
        rows = np.arange(len(self))
        g = np.searchsorted(self.ends, rows, side="right")
        in_file = rows - (self.ends[g] - self.groups[g, 2]) + self.groups[g, 3]
        with np.errstate(over="ignore"):
            return _splitmix(per_file[self.groups[g, 0]] ^ _splitmix(in_file.astype(_U64)))

    def __repr__(self) -> str:
        h = hashlib.sha1("\n".join(self.relpaths).encode("utf-8", "surrogateescape"))
        h.update(self.groups.tobytes())
        return (f"ParquetFiles({_relative_pattern(self.spec, self.root)!r}, column={self.field!r}, "
                f"num_files={len(self.relpaths)}, "
                f"num_docs={len(self)}, digest={h.hexdigest()[:12]})")


def open_source(spec: str | SourceSpec, max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES) -> DocSource:
    """A raw document source for a spec (``packed:`` sources are opened by maxlm.data.prepare).
    A source with no document at all is a ValueError (one line naming it and what was found)."""
    spec = parse_source(spec) if isinstance(spec, str) else spec
    if spec.kind == "stdlib":
        return stdlib_files(max_doc_bytes)
    if spec.kind == "files":
        root, relpaths, problems = _list_files(spec, max_doc_bytes)
        src = TextFiles(spec.text, root, relpaths, problems, max_doc_bytes)
    elif spec.kind == "jsonl":
        src = JsonlFiles(spec, max_doc_bytes)
    elif spec.kind == "parquet":
        src = ParquetFiles(spec, max_doc_bytes)
    else:
        raise ValueError(f"source {spec.text!r} holds packed rows, not documents: it trains as is "
                         "(use a raw source for clean, train-tokenizer and prepare)")
    if len(src) == 0:
        found = dict(src.problems.counts)
        raise ValueError(f"source {spec.text!r} holds no documents: {len(src.relpaths)} file(s) listed"
                         + (f", with {found}" if found else "") + " (check the glob and the field name)")
    return src


def get_source(spec: str, max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES) -> DocSource:
    return open_source(spec, max_doc_bytes)


def split(source: DocSource, eval_fraction: float) -> tuple[Subset, Subset]:
    """(train, eval): a document is held out when its id hashes below eval_fraction, so adding
    documents never moves an existing one between splits. Each split gets at least one document."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"DataConfig.eval_fraction = {eval_fraction} must lie in [0, 1)")
    n = len(source)
    if n < 2:
        raise ValueError(f"DataConfig.source = {source.spec!r} has {n} document(s); "
                         "at least 2 are needed to hold one out for evaluation")
    keys = source.keys()
    order = np.argsort(keys, kind="stable")
    held = int(np.sum(keys.astype(np.float64) / 2.0**64 < eval_fraction))
    held = min(max(held, 1), n - 1)
    mask = np.zeros(n, dtype=bool)
    mask[order[:held]] = True
    return Subset(source, np.flatnonzero(~mask), "train"), Subset(source, np.flatnonzero(mask), "eval")
