"""The one table that maps logical axis names onto the mesh axes, and the checks it implies.

Every parameter and large activation names its axes logically (``embed``, ``heads``, ...). ``RULES``
is the only place in maxlm that says which mesh axis a logical axis is split over, so changing
``MeshConfig`` is all it takes to move between data, fully-sharded (ZeRO-3), tensor and pipeline
parallelism. It sits beside ``config.py`` at the bottom of the import graph because both the
config's divisibility checks (``divisibility_problem``) and the shardings (``maxlm.parallel``)
derive from it. Imports nothing but the standard library.

In scaling-book notation (subscripts are the mesh axes a dimension is split over; B batch, T length,
D d_model, F d_ff, N heads, K kv heads, H head_dim, V vocab, L layers):

    tokens[B_{data,fsdp}, T] · E[V_{tensor}, D_{fsdp}]         -> x[B_{data,fsdp}, T, D]
    x[B_{data,fsdp}, T, D] · Wq[D_{fsdp}, N_{tensor}, H]      -> q[B_{data,fsdp}, T, N_{tensor}, H]
        (Wk, Wv likewise with K_{tensor}); attention is local to each tensor shard
    ctx[B_{data,fsdp}, T, N_{tensor}, H] · Wo[N_{tensor}, H, D_{fsdp}] -> x[B_{data,fsdp}, T, D]  (reduce-scatter/all-reduce over tensor)
    x[B_{data,fsdp}, T, D] · Wup[D_{fsdp}, F_{tensor}]        -> h[B_{data,fsdp}, T, F_{tensor}]
    h[B_{data,fsdp}, T, F_{tensor}] · Wdown[F_{tensor}, D_{fsdp}] -> x[B_{data,fsdp}, T, D]   (all-reduce over tensor)
    x[B_{data,fsdp}, T, D] · Whead[D_{fsdp}, V_{tensor}]      -> logits[B_{data,fsdp}, T, V_{tensor}]
    KV cache  K[L_{pipeline}, B_{data,fsdp}, S, K_{tensor}, H] (as the activations it stores)
    stacked layers: W[L_{pipeline}, ...]

FSDP all-gathers each weight's D_{fsdp} shards just before use (XLA inserts the collective) and
reduce-scatters its gradient, so parameters, gradients and optimizer state are 1/fsdp per device.
"""

from __future__ import annotations

import math
from typing import Sequence

MESH_AXES = ("data", "fsdp", "tensor", "pipeline")

# logical name -> mesh axis (or axes, or None for replicated). The only table of its kind.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),  # activations' batch dimension
    "length": None,  # sequence positions (sequence parallelism would map this)
    "cache_length": None,  # KV-cache slots
    "act_embed": None,  # model dimension of activations, and 1-D vectors along it (norms, biases)
    "embed": "fsdp",  # model dimension of weight matrices: ZeRO-3 sharding
    "mlp": "tensor",  # Megatron column/row split of the MLP
    "heads": "tensor",  # Megatron split of attention heads
    "kv_heads": "tensor",
    "head_dim": None,
    "vocab": "tensor",
    "layers": "pipeline",
    "lora_rank": None,  # LoRA adapters' rank axis: small, replicated (A and B shard as their base weight)
}


def mesh_axes(name: str | None) -> tuple[str, ...]:
    """The mesh axes a logical name is split over (empty when replicated)."""
    if name is None:
        return ()
    target = RULES[name]
    return (target,) if isinstance(target, str) else tuple(target or ())


def divisibility_problem(sizes: dict[str, tuple[str, int]], degrees: dict[str, int]) -> str | None:
    """The first logical dimension whose size its mesh axes do not divide, as one line; else None.

    ``sizes`` maps logical names to (the config field that sets the size, the size); the axes each
    is split over come from ``RULES``, so no divisibility rule is restated by hand."""
    for name, (field, size) in sizes.items():
        for axis in mesh_axes(name):
            if size % degrees[axis]:
                return f"{field} = {size} is not divisible by MeshConfig.{axis} = {degrees[axis]}"
        axes = mesh_axes(name)
        product = math.prod(degrees[a] for a in axes)
        if len(axes) > 1 and size % product:
            return (f"{field} = {size} is not divisible by {'*'.join(axes)} = "
                    f"{'*'.join(str(degrees[a]) for a in axes)} = {product}")
    return None


def spec_axes(names: Sequence[str | None]) -> list[str | tuple[str, ...] | None]:
    """Mesh axes per logical name, failing loudly on an unknown name or an axis used twice."""
    spec, used = [], set()
    for name in names:
        if name is not None and name not in RULES:
            raise ValueError(f"logical axis {name!r} (in {tuple(names)}) has no rule; known: {sorted(RULES)}")
        axes = mesh_axes(name)
        twice = used.intersection(axes)
        if twice:
            raise ValueError(f"mesh axis {sorted(twice)} used twice in logical spec {tuple(names)}")
        used.update(axes)
        spec.append(None if name is None else RULES[name])
    return spec
