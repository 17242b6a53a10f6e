"""Fuzzing `python -m maxlm.train`'s config: every field, driven out of range, to the wrong type or
empty, is rejected before anything compiles with one line and exit 2, and the run directory's
existing files stay as they were."""

import dataclasses
import hashlib
import math
import subprocess
import sys

import pytest

from maxlm import config
from maxlm.train import pretrain

CHOICES = {"str": ["'nonsense'", "''", "3"], "bool": ["2", "'yes'"]}


def bad_values(key: str, kind: str) -> list[str]:
    """Gin literals that the field must refuse."""
    if kind in CHOICES:
        return CHOICES[kind]
    values = ["'text'", "None", "1e999" if kind == "float" else "1.5", "[1]"]
    low, high, what = config.RANGES.get(key, (-math.inf, math.inf, ""))
    if what == "positive":
        values += ["0", "-1"]
    elif what == ">= 0":
        values += ["-1"]
    elif what:
        values += [repr(low - 1), repr(high + 1)]
    return values


CASES = [(f"{cls.__name__}.{f.name}", value)
         for cls in config.SECTIONS.values() for f in dataclasses.fields(cls)
         for value in bad_values(f"{cls.__name__}.{f.name}", f.type)
         # Free-form strings (paths, sources, names) are checked where they are used.
         if not (f.type == "str" and f.name in ("source", "weights", "tokenizer", "run_dir", "init_params", "init_from",
                                                  "data", "eval_data"))
         # Where a string's default is empty, '' is that default (no tasks, no teacher, no layers).
         and not (value == "''" and f.default == "")]


def _hashes(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("run")
    (path / "config.gin").write_text("# an earlier run's config\n")
    (path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    return path


def test_fuzz_table_covers_every_config_field():
    fields = {key for key, _ in CASES}
    assert len(CASES) >= 250 and len(fields) >= 70, (len(CASES), len(fields))
    print(f"fuzz: maxlm.train {len(CASES)} inputs over {len(fields)} config fields")


@pytest.mark.parametrize("binding,value", CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_bad_field_is_one_line_and_exit_2(binding, value, run_dir, capsys):
    before = _hashes(run_dir)
    code = pretrain.main(["--config=tiny.gin", f"--run_dir={run_dir}", f"--gin_bindings={binding} = {value}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (binding, value, err)
    assert len(err) == 1 and err[0].startswith("maxlm.train: config error: tiny.gin: "), err
    assert "Traceback" not in err[0]
    assert _hashes(run_dir) == before


def test_the_real_entry_point_rejects_a_bad_field_in_one_line(run_dir):
    before = _hashes(run_dir)
    proc = subprocess.run([sys.executable, "-m", "maxlm.train", "--config=tiny.gin", f"--run_dir={run_dir}",
                           "--gin_bindings=OptimConfig.b1 = -0.5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "maxlm.train: config error: tiny.gin: OptimConfig.b1 = -0.5 must lie in [0, 1)"
    assert _hashes(run_dir) == before
