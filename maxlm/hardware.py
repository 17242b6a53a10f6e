"""What the hardware offers. ``GPUS``: accelerators the stack knows by name, with dense bf16 peak
FLOP/s, memory and an assumed on-demand price per device-hour; the planner plans with them
(``maxlm.plan``, where ``--price_per_gpu_hour`` overrides the price) and the run doctor's cost line
prices a running job by its device kind. ``host_memory_problem``: whether the backend can keep
arrays in pinned host memory (host offload). No jax import at module level: the planner must set
XLA_FLAGS before jax starts."""

from __future__ import annotations

from typing import Any, Sequence

HOST = "pinned_host"  # the JAX memory kind host offload keeps state in

GPUS = {
    "a100": {"name": "NVIDIA A100 80GB SXM", "peak_flops": 312e12, "memory": 80e9, "price": 1.80},
    "h100": {"name": "NVIDIA H100 80GB SXM", "peak_flops": 989e12, "memory": 80e9, "price": 2.50},
    "h200": {"name": "NVIDIA H200 141GB SXM", "peak_flops": 989e12, "memory": 141e9, "price": 3.50},
}


def host_memory_problem(devices: Sequence[Any] | None = None) -> str | None:
    """Why these devices (default: jax's) cannot hold arrays in ``HOST`` memory, or None if they can."""
    if devices is None:
        import jax

        devices = jax.devices()
    device = list(devices)[0]
    try:
        kinds = sorted({m.kind for m in device.addressable_memories()})
    except Exception as err:  # noqa: BLE001 - a backend without the memories API
        return f"the {device.platform} backend reports no memory kinds ({type(err).__name__})"
    if HOST not in kinds:
        return f"the {device.platform} backend has no {HOST!r} memory (it has {', '.join(kinds)})"
    return None
