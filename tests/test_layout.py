"""The package layout's import direction: a package imports only from packages below it.

The order is the README's architecture table: a model's life from the foundation up. Command lines
(a package's ``__main__.py`` and ``cli.py``, and the top-level ``generate.py``) sit above every
library module: they open checkpoints and Hugging Face directories (``maxlm.hf.load``) for any
stage, so they may import any package; nothing imports them."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "maxlm"
# Lowest first; packages on one level do not import each other.
LEVELS = [("config", "posttrain_config", "rules", "cli_args", "storage", "hardware"), ("parallel",), ("model",), ("data",), ("infer",), ("eval",), ("train",), ("quant",),
          ("hf", "plan", "posttrain", "serve")]
ENTRY_POINTS = ("__main__.py", "cli.py")
TOP_LEVEL_COMMANDS = ("generate", "quantize", "prune", "sft", "distill", "dpo", "reward", "grpo", "doctor")  # maxlm/generate.py: ``python -m maxlm.generate``, ...
RANK = {name: i for i, level in enumerate(LEVELS) for name in level}


def _package(path: Path) -> str:
    part = path.relative_to(ROOT).parts[0]
    return part[:-3] if part.endswith(".py") else part


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "maxlm":
            parts = node.module.split(".")
            names = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
            yield from ((n, node.lineno) for n in names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "maxlm" and len(parts) > 1:
                    yield parts[1], node.lineno


MODULES = sorted(p for p in ROOT.rglob("*.py") if _package(p) != "__init__")


def _is_command(path: Path) -> bool:
    return path.name in ENTRY_POINTS or _package(path) in TOP_LEVEL_COMMANDS


def test_every_package_has_a_place_in_the_layout():
    assert {_package(p) for p in MODULES if not _is_command(p)} <= set(RANK)


def test_nothing_imports_a_command_line():
    for path in MODULES:
        for target, line in _imports(path):
            assert target not in TOP_LEVEL_COMMANDS, f"{path.relative_to(ROOT.parent)}:{line} imports maxlm.{target}"


@pytest.mark.parametrize("path", [p for p in MODULES if not _is_command(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    source = _package(path)
    for target, line in _imports(path):
        if target in ("__version__", "kernels") or target == source:
            continue
        assert RANK[target] < RANK[source] or (RANK[target] == RANK[source] == 0), (
            f"{path.relative_to(ROOT.parent)}:{line}: {source} (level {RANK[source]}) imports {target} "
            f"(level {RANK[target]})")
