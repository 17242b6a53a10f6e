"""Where an inference model's parameters live: a mesh of ``tensor`` devices on the ``tensor`` axis
(heads and MLP columns split across them, as in training), every other axis of degree 1, and the
parameters' shardings on it from their logical axis names.

On a CPU host the cores can be the tensor axis too (``use_cpu_cores`` before jax starts, then
``auto_tensor``): each core then streams its own half of the weights and KV cache through its
own cache, which is what bounds a batched decode step. It costs a small sync per layer, so it pays
under load (a server) rather than for one stream."""

from __future__ import annotations

import os
from typing import Any

import jax

from maxlm import model
from maxlm.config import ModelConfig
from maxlm.parallel import sharding


def inference_mesh(tensor: int = 1) -> jax.sharding.Mesh:
    """The first ``tensor`` devices, all on the ``tensor`` axis."""
    devices = jax.devices()
    if not 1 <= tensor <= len(devices):
        raise ValueError(f"--tensor = {tensor} must lie in [1, {len(devices)}] (the devices jax sees)")
    return sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": tensor, "pipeline": 1}, devices[:tensor])


def param_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh) -> Any:
    names = sharding.logical_specs(model.abstract_params(cfg, boxed=True))
    return sharding.mesh_shardings(names, mesh)


def cpu_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def use_cpu_cores() -> None:
    """Give jax one CPU device per core, unless XLA_FLAGS or jax's config already set a count. Only
    takes effect before jax creates its backends (the first ``jax.devices()``)."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    if jax.config.jax_num_cpu_devices < 0:
        jax.config.update("jax_num_cpu_devices", cpu_cores())


def auto_tensor(cfg: ModelConfig) -> int:
    """``--tensor auto``: 1 on accelerators (as vLLM's default); on a CPU backend, the most devices
    (at most the cores) that the heads, kv heads and MLP width all divide by. Quantized layers
    stay on one device: their packed groups are not split by this rule."""
    if jax.default_backend() != "cpu" or cfg.linear != "dense" or cfg.linear_rules or cfg.embedding != "dense":
        return 1
    most = min(cpu_cores(), len(jax.devices()))
    return max(t for t in range(1, most + 1) if not (cfg.n_heads % t or cfg.kv_heads % t or cfg.d_ff % t))
