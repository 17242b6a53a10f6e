"""The memory allocator setting a training process runs with: glibc's malloc on huge pages.

XLA:CPU allocates its step's temporary buffers afresh on every step. glibc returns the large ones
to the kernel when they are freed, and the next step faults them back in, 4 KiB at a time: about
116,000 page faults per step of the 19M-parameter bench model, about 300 ms of kernel time per
step (scripts/README.md has the measurement). glibc's ``glibc.malloc.hugetlb=1`` tunable (glibc
2.35 and newer) makes malloc back its memory with transparent huge pages, which cuts those faults
about 100-fold. Tunables are read only when a process starts, so a command-line entry point calls
``use_huge_pages()`` first: it re-executes the same command line once with the tunable added.
GPU runs gain little (device memory has its own allocator) and lose nothing.

Opt out with ``MAXLM_ALLOCATOR=default``; a ``GLIBC_TUNABLES`` that already names
``glibc.malloc.hugetlb`` is left as it is.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "MAXLM_ALLOCATOR"
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _supported() -> bool:
    """Linux with glibc >= 2.35 and transparent huge pages not switched off."""
    if sys.platform != "linux":
        return False
    lib, version = platform.libc_ver()
    try:
        if lib != "glibc" or tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
            return False
        with open(THP) as f:
            return "[never]" not in f.read()
    except (OSError, ValueError):
        return False


def environment(env: dict[str, str] | None = None) -> dict[str, str] | None:
    """The environment to re-execute with, or None when the current one is already right."""
    env = dict(os.environ if env is None else env)
    tunables = env.get("GLIBC_TUNABLES", "")
    if env.get(OPT_OUT) == "default" or "glibc.malloc.hugetlb" in tunables or not _supported():
        return None
    env["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}" if tunables else TUNABLE
    return env


def use_huge_pages() -> None:
    """Re-execute this command line with huge-page malloc, unless it already runs with it.

    Call it first thing in a command-line ``main`` (never from a library call or a notebook): the
    process image is replaced, keeping its pid, arguments, standard streams and working directory."""
    env = environment()
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:  # cannot re-execute (an embedded interpreter): run on with the default
        pass
