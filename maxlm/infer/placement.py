"""Where an inference model's parameters live: a mesh of ``tensor`` devices on the ``tensor`` axis
(heads and MLP columns split across them, as in training), every other axis of degree 1, and the
parameters' shardings on it from their logical axis names."""

from __future__ import annotations

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
