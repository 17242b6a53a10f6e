"""Document sources: the embedded stdlib corpus or a glob of text files, split train/eval by hash.

A source lists file paths up front (cheap) and reads a file only when Grain asks for its index, so
building a pipeline over thousands of files costs a directory walk, not a tokenisation pass.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from collections.abc import Sequence

TEXT_SUFFIXES = (".py", ".txt", ".rst", ".md")
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class TextFiles:
    """Random-access documents (Grain's data-source protocol): item i is the text of file i."""

    def __init__(self, spec: str, root: str, relpaths: Sequence[str]):
        self.spec = spec
        self.root = root
        self.relpaths = tuple(relpaths)

    def __len__(self) -> int:
        return len(self.relpaths)

    def __getitem__(self, index: int) -> str:
        path = os.path.join(self.root, self.relpaths[index])
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:  # vanished or unreadable since listing: an empty document, not a crash
            data = b""
        return data.decode("utf-8", errors="replace")

    def subset(self, relpaths: Sequence[str]) -> "TextFiles":
        return TextFiles(self.spec, self.root, relpaths)

    def __repr__(self) -> str:
        # Relative paths keep the repr (and so a checkpoint's validity) independent of install
        # location; the digest makes any change to the file list visible.
        digest = hashlib.sha1("\n".join(self.relpaths).encode()).hexdigest()[:12]
        return f"TextFiles(spec={self.spec!r}, num_files={len(self)}, digest={digest})"


def _readable_file(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.R_OK)


def stdlib_files() -> TextFiles:
    """The running interpreter's standard library: its .py and text files, no third-party code."""
    root = sysconfig.get_paths()["stdlib"]
    relpaths = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        for name in files:
            path = os.path.join(directory, name)
            if name.endswith(TEXT_SUFFIXES) and _readable_file(path):
                relpaths.append(os.path.relpath(path, root))
    if not relpaths:
        raise ValueError(f"DataConfig.source = 'stdlib': no text files found under {root}")
    return TextFiles("stdlib", root, sorted(relpaths))


def glob_files(pattern: str) -> TextFiles:
    """Files matching a glob (`**` recurses, `~` expands); relative paths are taken from the
    pattern's longest wildcard-free directory, so the split does not depend on where data lives."""
    expanded = os.path.expanduser(pattern)
    paths = sorted(p for p in glob.glob(expanded, recursive=True) if _readable_file(p))
    if not paths:
        raise ValueError(f"DataConfig.source = {pattern!r} matched no readable files "
                         "(give a glob of files, e.g. 'corpus/**/*.txt')")
    parts = expanded.split(os.sep)
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts) - 1)
    root = os.sep.join(parts[:fixed]) or (os.sep if expanded.startswith(os.sep) else ".")
    return TextFiles(pattern, root, [os.path.relpath(p, root) for p in paths])


def get_source(spec: str) -> TextFiles:
    return stdlib_files() if spec == "stdlib" else glob_files(spec)


def _unit_hash(relpath: str) -> float:
    """A stable number in [0, 1) per document (Python's hash() is salted per process)."""
    digest = hashlib.sha1(relpath.replace(os.sep, "/").encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split(files: TextFiles, eval_fraction: float) -> tuple[TextFiles, TextFiles]:
    """(train, eval): a document is held out when its path hashes below eval_fraction, so adding
    files never moves an existing document between splits. Each split gets at least one file."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"DataConfig.eval_fraction = {eval_fraction} must lie in [0, 1)")
    if len(files) < 2:
        raise ValueError(f"DataConfig.source = {files.spec!r} has {len(files)} file(s); "
                         "at least 2 are needed to hold one out for evaluation")
    ranked = sorted(files.relpaths, key=_unit_hash)
    held = sum(_unit_hash(p) < eval_fraction for p in ranked)
    held = min(max(held, 1), len(ranked) - 1)
    held_set = set(ranked[:held])
    train = [p for p in files.relpaths if p not in held_set]
    return files.subset(train), files.subset(sorted(held_set))
