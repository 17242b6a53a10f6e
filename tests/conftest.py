"""Test setup: 8 fake CPU devices, forced before anything imports jax."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after XLA_FLAGS on purpose)


def pytest_configure(config):
    assert jax.device_count() == 8, "tests expect 8 fake CPU devices; was jax imported before conftest?"
