"""The device mesh and the one table that maps logical axis names onto it.

Every parameter and large activation names its axes logically (``embed``, ``heads``, ...). ``RULES``
below is the only place in maxlm that mentions mesh axes, so changing ``MeshConfig`` is all it takes
to move between data, fully-sharded (ZeRO-3) and tensor parallelism.

In scaling-book notation (subscripts are the mesh axes a dimension is split over; B batch, T length,
D d_model, F d_ff, N heads, K kv heads, H head_dim, V vocab, L layers):

    tokens[B_{data,fsdp}, T] · E[V_{tensor}, D_{fsdp}]         -> x[B_{data,fsdp}, T, D]
    x[B_{data,fsdp}, T, D] · Wq[D_{fsdp}, N_{tensor}, H]      -> q[B_{data,fsdp}, T, N_{tensor}, H]
        (Wk, Wv likewise with K_{tensor}); attention is local to each tensor shard
    ctx[B_{data,fsdp}, T, N_{tensor}, H] · Wo[N_{tensor}, H, D_{fsdp}] -> x[B_{data,fsdp}, T, D]  (reduce-scatter/all-reduce over tensor)
    x[B_{data,fsdp}, T, D] · Wup[D_{fsdp}, F_{tensor}]        -> h[B_{data,fsdp}, T, F_{tensor}]
    h[B_{data,fsdp}, T, F_{tensor}] · Wdown[F_{tensor}, D_{fsdp}] -> x[B_{data,fsdp}, T, D]   (all-reduce over tensor)
    x[B_{data,fsdp}, T, D] · Whead[D_{fsdp}, V_{tensor}]      -> logits[B_{data,fsdp}, T, V_{tensor}]
    stacked layers: W[L_{pipeline}, ...]

FSDP all-gathers each weight's D_{fsdp} shards just before use (XLA inserts the collective) and
reduce-scatters its gradient, so parameters, gradients and optimizer state are 1/fsdp per device.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "pipeline")

# logical name -> mesh axis (or axes, or None for replicated). The only table of its kind.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),  # activations' batch dimension
    "length": None,  # sequence positions (sequence parallelism would map this)
    "act_embed": None,  # model dimension of activations, and 1-D vectors along it (norms, biases)
    "embed": "fsdp",  # model dimension of weight matrices: ZeRO-3 sharding
    "mlp": "tensor",  # Megatron column/row split of the MLP
    "heads": "tensor",  # Megatron split of attention heads
    "kv_heads": "tensor",
    "head_dim": None,
    "vocab": "tensor",
    "layers": "pipeline",
}


class ShardingError(ValueError):
    """A logical name with no rule, or a mesh axis used twice in one spec."""


def logical_to_spec(names: Sequence[str | None], rules: dict[str, Any] = RULES) -> PartitionSpec:
    """Map logical axis names to a mesh PartitionSpec; fail loudly instead of replicating."""
    spec, used = [], set()
    for name in names:
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise ShardingError(f"logical axis {name!r} (in {tuple(names)}) has no rule; "
                                f"known: {sorted(rules)}")
        target = rules[name]
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        twice = used.intersection(axes)
        if twice:
            raise ShardingError(f"mesh axis {sorted(twice)} used twice in logical spec {tuple(names)}")
        used.update(axes)
        spec.append(target)
    return PartitionSpec(*spec)


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
