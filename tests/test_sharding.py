"""The rules table, sharded training against one device, and golden sharding snapshots."""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import small_config, train_losses
from jax.sharding import PartitionSpec

from maxlm import config, model
from maxlm.parallel import sharding
from maxlm.train import step

GOLDEN = Path(__file__).parent / "golden"


def test_rules_map_and_fail_loudly():
    assert sharding.logical_to_spec(("batch", "length", "act_embed")) == PartitionSpec(("data", "fsdp"), None, None)
    assert sharding.logical_to_spec(("embed", "mlp")) == PartitionSpec("fsdp", "tensor")
    with pytest.raises(sharding.ShardingError, match="logical axis 'widgets'"):
        sharding.logical_to_spec(("embed", "widgets"))
    with pytest.raises(sharding.ShardingError, match=r"mesh axis \['fsdp'\] used twice"):
        sharding.logical_to_spec(("batch", "embed"))


MESHES = [dict(data=8), dict(data=1, fsdp=8), dict(data=2, fsdp=2, tensor=2), dict(data=1, fsdp=2, tensor=4)]


@pytest.fixture(scope="module")
def single_device_losses():
    cfg = small_config(num_devices=1, mesh=dict(data=1))
    return train_losses(cfg, jax.devices()[:1])[0]


@pytest.mark.slow
@pytest.mark.parametrize("degrees", MESHES, ids=lambda d: "x".join(str(d.get(a, 1)) for a in sharding.MESH_AXES))
def test_sharded_training_matches_one_device(degrees, single_device_losses):
    cfg = small_config(mesh=degrees)
    losses, state = train_losses(cfg, jax.devices())
    np.testing.assert_allclose(losses, single_device_losses, rtol=1e-5, atol=1e-5)
    assert losses[-1] < losses[0]
    # Parameters really are split: fsdp and tensor shrink what one device holds.
    embed = state.params["embed"]
    expected = embed.size // (degrees.get("fsdp", 1) * degrees.get("tensor", 1))
    assert embed.addressable_shards[0].data.size == expected


@pytest.mark.slow
def test_gradient_accumulation_matches_full_batch(single_device_losses):
    cfg = small_config(mesh=dict(data=2, fsdp=2, tensor=2), optim=dict(microbatches=2))
    losses, _ = train_losses(cfg, jax.devices())
    np.testing.assert_allclose(losses, single_device_losses, rtol=1e-5, atol=1e-5)


def _intended_devices(cfg):
    degrees = [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, cfg.mesh.pipeline]
    fixed = int(np.prod([d for d in degrees if d != -1]))
    return fixed * 8 if -1 in degrees else fixed


def sharding_snapshot(name: str) -> dict:
    cfg = config.load(name)
    names = step.param_names(cfg)
    shapes = model.abstract_params(cfg.model)
    snapshot = {"mesh": cfg.mesh.shape(_intended_devices(cfg)), "params": {}}
    for (path, logical), shape in zip(jax.tree_util.tree_flatten_with_path(names)[0], jax.tree.leaves(shapes)):
        key = "/".join(p.key for p in path)
        snapshot["params"][key] = {
            "shape": list(shape.shape), "logical": list(logical),
            "mesh": [list(a) if isinstance(a, tuple) else a for a in sharding.logical_to_spec(logical)]}
    return snapshot


@pytest.mark.parametrize("name", sorted(p.name for p in config.CONFIG_DIR.glob("*.gin")))
def test_golden_sharding_snapshot(name):
    """A silent change of any parameter's shape, logical names or mesh placement fails here.

    After an intended change, regenerate with MAXLM_UPDATE_GOLDEN=1 and review the diff."""
    path = GOLDEN / f"sharding_{name.removesuffix('.gin')}.json"
    snapshot = sharding_snapshot(name)
    if os.environ.get("MAXLM_UPDATE_GOLDEN"):
        path.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
    assert path.exists(), f"no golden snapshot {path.name}; run with MAXLM_UPDATE_GOLDEN=1"
    assert snapshot == json.loads(path.read_text())
