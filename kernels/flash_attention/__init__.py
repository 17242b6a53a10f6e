"""Flash attention for NVIDIA GPUs in Pallas (forward and backward), with its jnp reference."""
