"""The device mesh, and logical names turned into shardings (by ``maxlm.rules``, the one table).

``logical_to_spec`` maps a tuple of logical names to a ``PartitionSpec``; ``constrain`` pins an
activation's sharding by logical names; ``mesh_shardings`` turns a tree of logical specs into
``NamedSharding``s. The scaling-book notation of every layer sits next to the table in
``maxlm/rules.py``. ``in_memory`` and ``move`` handle host offload: a sharding whose memory kind
is ``HOST`` keeps each shard in the pinned host memory beside its device (JAX memory kinds).
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from maxlm.hardware import HOST  # the host memory kind offloaded state lives in (JAX memory kinds)
from maxlm.rules import MESH_AXES, spec_axes


class ShardingError(ValueError):
    """A logical name with no rule, or a mesh axis used twice in one spec."""


def logical_to_spec(names: Sequence[str | None]) -> PartitionSpec:
    """Map logical axis names to a mesh PartitionSpec; fail loudly instead of replicating."""
    try:
        return PartitionSpec(*spec_axes(names))
    except ValueError as err:
        raise ShardingError(str(err)) from None


def make_mesh(degrees: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh over (data, fsdp, tensor, pipeline) with the given degrees."""
    devices = list(devices if devices is not None else jax.devices())
    shape = tuple(degrees[a] for a in MESH_AXES)
    try:
        grid = mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, AssertionError, NotImplementedError):  # fake or irregular topologies
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin an activation's sharding by logical names; a no-op outside a mesh context."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names))


def logical_specs(boxed_tree: Any) -> Any:
    """Tree of logical PartitionSpecs (names, not mesh axes) from nn.LogicallyPartitioned boxes."""
    return jax.tree.map(lambda b: PartitionSpec(*b.names), boxed_tree,
                        is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))


def mesh_shardings(logical_tree: Any, mesh: Mesh) -> Any:
    """Tree of NamedShardings from a tree of logical PartitionSpecs."""
    return jax.tree.map(lambda names: NamedSharding(mesh, logical_to_spec(names)), logical_tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(("batch", "length")))


DEVICE = "device"


def in_memory(shardings: Any, kind: str | None) -> Any:
    """The shardings with memory kind ``kind`` (unchanged for None): same spec, other memory."""
    return shardings if kind is None else jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def on_host(s: Any) -> bool:
    return getattr(s, "memory_kind", None) == HOST


def move(tree: Any, shardings: Any, kind: str) -> Any:
    """Inside jit: each leaf whose sharding is in host memory copied to ``kind`` memory ("device"
    to use it, ``HOST`` to put it back); the others as they are. XLA schedules the copies
    (asynchronously where the backend can), so they overlap the computation around them."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind(kind)) if on_host(s) else x,
                        tree, shardings)
