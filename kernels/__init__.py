"""Pallas kernels, importable as ``maxlm.kernels``; independent of the rest of maxlm.

One folder per op, each with the kernel, a custom_vjp wrapper and a pure-jnp reference. The
attention seam (``maxlm.model.attention``) and the INT4 matmul will call into here.
"""
