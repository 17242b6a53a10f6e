"""What the command lines share: a parser whose every error is one line and exit status 2,
numbers checked as they are parsed, and the exception for a user's mistake found later."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable


class UserError(Exception):
    """A mistake in the command line or its inputs: one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors as one line ``maxlm.X: error: ... (see --help)`` (``prog`` is
    ``python -m maxlm.X``) instead of the usage block."""

    def error(self, message: str):
        name = self.prog.removeprefix("python -m ").split()[0]
        self.exit(2, f"{name}: error: {' '.join(message.split())} (see --help)\n")


def number(kind: type, check: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``kind(text)``, refused with "TEXT WHAT" unless ``check`` passes."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}")
        if not check(value):
            raise argparse.ArgumentTypeError(f"{text} {what}")
        return value
    return parse


def check_new_dir(out: str, prog: str) -> Path:
    """``--out``: a directory to create, which must not exist yet, in a writable parent."""
    path = Path(out).expanduser()
    if not out.strip():
        raise UserError("--out: an empty path is not allowed")
    if os.path.lexists(path):
        raise UserError(f"{out}: --out already exists; {prog} never overwrites (choose another --out)")
    parent = path.resolve().parent
    if not parent.is_dir():
        raise UserError(f"{out}: --out's directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UserError(f"{out}: cannot write in {parent}")
    return path.resolve()


def run_command(prog: str, command: Callable[[Any], int], args: Any) -> int:
    """``command(args)``, with a UserError as one line on stderr and exit status 2."""
    try:
        return command(args)
    except UserError as err:
        print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
