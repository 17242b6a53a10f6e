"""Test setup: 8 fake CPU devices, forced before anything imports jax."""

import os
import sys
from pathlib import Path

# `python -m pytest` puts the working directory, the repository root, first on sys.path. There our
# top-level kernels/ folder (installed as maxlm.kernels) would shadow PyPI's `kernels`, which
# transformers >= 5.25 depends on and probes at import. maxlm itself is installed, so drop the root.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after XLA_FLAGS on purpose)


def pytest_configure(config):
    assert jax.device_count() == 8, "tests expect 8 fake CPU devices; was jax imported before conftest?"
