"""The training entry point's malloc setting (maxlm.train.allocator)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from maxlm.train import allocator

ROOT = Path(__file__).resolve().parents[1]
needs_support = pytest.mark.skipif(not allocator._supported(), reason="needs Linux, glibc >= 2.35 and THP")


@needs_support
def test_environment_adds_the_tunable_and_keeps_others():
    assert allocator.environment({})["GLIBC_TUNABLES"] == allocator.TUNABLE
    env = allocator.environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + allocator.TUNABLE and env["X"] == "1"


def test_environment_respects_an_existing_setting_and_the_opt_out():
    assert allocator.environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None
    assert allocator.environment({allocator.OPT_OUT: "default"}) is None


@needs_support
def test_the_entry_point_reexecutes_itself_once_with_huge_pages(tmp_path):
    # A stand-in for an entry point: report the environment and pid after use_huge_pages().
    script = tmp_path / "entry.py"
    script.write_text("import os, sys\nprint(os.getpid(), flush=True)\n"
                      "from maxlm.train import allocator\nallocator.use_huge_pages()\n"
                      "print(os.getpid(), os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", allocator.OPT_OUT)}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, str(script), "a", "--b=c"], env=env, capture_output=True,
                         text=True, check=True, timeout=60).stdout.split("\n")
    # The first line printed twice (once per image), the same pid, the tunable set, argv intact.
    assert out[0] == out[1]
    assert out[2] == f"{out[0]} {allocator.TUNABLE} ['a', '--b=c']"


def test_train_help_runs_through_the_reexecution():
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-m", "maxlm.train", "--help"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "usage: python -m maxlm.train" in out.stdout and not out.stderr
