"""Test setup: 8 fake CPU devices, forced before anything imports jax."""

import gc
import os
import sys
from pathlib import Path

# `python -m pytest` from the repository root puts the root first on sys.path, where our top-level
# kernels/ folder would shadow PyPI's `kernels` package, which transformers >= 5.25 imports. Tests
# still import `tests.*` from the root, so it moves to the end of the path instead of leaving it.
ROOT = str(Path(__file__).resolve().parents[1])
sys.path[:] = [p for p in sys.path if p not in ("", ".", ROOT)] + [ROOT]

# MAXLM_TEST_ON_GPU=1 (scripts/gpu_check.sh) runs the kernel tests compiled on the GPU instead.
ON_GPU = os.environ.get("MAXLM_TEST_ON_GPU") == "1"
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
if not ON_GPU:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the whole run, shared by the xdist workers and every
# subprocess they start (they inherit the environment): a resumed run, a killed-and-restarted one,
# its uninterrupted reference and the next test's tiny model compile the same programs, and on 2
# cores compiling is a large part of the suite. The directory is this run's own and is removed at
# the end, so no run is faster or different because of an earlier one; set JAX_COMPILATION_CACHE_DIR
# yourself to keep one between runs.
_OWN_CACHE = None
if not ON_GPU and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _OWN_CACHE = tempfile.mkdtemp(prefix="maxlm-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402  (after XLA_FLAGS on purpose)


def pytest_configure(config):
    if ON_GPU:
        assert jax.default_backend() == "gpu", "MAXLM_TEST_ON_GPU=1 but jax sees no GPU"
        return
    assert jax.device_count() == 8, "tests expect 8 fake CPU devices; was jax imported before conftest?"


def pytest_unconfigure(config):
    if _OWN_CACHE:  # only the process that made it (the xdist controller, or a plain pytest run)
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if ON_GPU:  # only the kernels' own tests run there; the rest needs the CPU mesh
        import pytest

        skip = pytest.mark.skip(reason="cpu_only: needs the 8 fake CPU devices")
        for item in items:
            if "cpu_only" in item.keywords:
                item.add_marker(skip)


import pytest  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_code_after_each_file():
    """jax keeps every executable a process compiles, so a pytest worker that runs thirty files grew
    to 6 GB by the end of the suite; beside a vLLM server and a training subprocess that left CI's
    24 GiB machine short, and a worker killed there hangs pytest-xdist's --dist loadfile (see
    scripts/test.sh). Dropping the caches after each file bounds a worker by its largest file."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def sft_start(tmp_path_factory):
    """dpo_tiny.gin's and reward_tiny.gin's start: sft_tiny.gin trained 250 steps, partly able to
    uppercase a word (once per test process: the DPO and reward-model tests share it)."""
    from maxlm import config
    from maxlm.posttrain import build_task
    from maxlm.train import pretrain

    run = tmp_path_factory.mktemp("sft_start") / "sft_upper_250"
    cfg = config.load("sft_tiny.gin", [f"TrainConfig.run_dir={str(run)!r}", "TrainConfig.steps=250",
                                       "TrainConfig.peak_flops=1e12", "SFTConfig.eval_prompts=0"], num_devices=8)
    pretrain.train(cfg, build_task=build_task)
    return run
