"""The peer environments that check maxlm against software nobody here wrote: vLLM and
lm-evaluation-harness, each in its own virtual environment (their pins clash with ours), built by
``scripts/setup_peer_envs.sh`` under ``$MAXLM_PEER_ENVS`` (default ``~/.cache/maxlm/peer-envs``)."""

import functools
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("MAXLM_PEER_ENVS", "~/.cache/maxlm/peer-envs")).expanduser()
IMPORTS = {"vllm": "vllm", "lmeval": "lm_eval"}


def peer_env(**extra: str) -> dict[str, str]:
    """The environment a peer runs in: ours plus PYTHONSAFEPATH, so a peer started from this
    checkout does not import our top-level ``kernels/`` folder in place of the PyPI ``kernels``
    package that transformers imports."""
    return {**os.environ, "PYTHONSAFEPATH": "1", **extra}


def peer_python(name: str) -> Path | None:
    """The python of peer environment ``name`` ('vllm' or 'lmeval') if it is built, else None."""
    python = ROOT / name / "bin" / "python"
    return python if python.is_file() else None


@functools.cache
def _imports(python: Path, module: str) -> bool:
    """Whether ``python`` imports ``module``: asked once per test process (importing vllm takes
    tens of seconds)."""
    return subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, check=False).returncode == 0


def require_peer(name: str) -> Path:
    """The peer's python, or skip the test saying how to build it. In CI (CI=true) a missing peer
    environment fails instead: .ci/run builds both, so its absence is a broken CI, not a skip."""
    python = peer_python(name)
    if python is not None and _imports(python, IMPORTS[name]):
        return python
    reason = (f"the {name} peer environment is not built at {ROOT / name} "
              "(run: bash scripts/setup_peer_envs.sh)")
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)
