"""Checking the GPU path on a machine without a GPU: lower the kernel for CUDA to Triton IR, then
compile that IR to PTX/cubin for an sm_90 (H100/H200) target with the ``triton`` package.

Lowering catches whatever Pallas' Triton backend cannot express (a primitive, a non-power-of-two
tensor); compiling catches what Triton itself rejects (layouts, shared memory over the limit) and
shows the code a GPU would run (``asm["ptx"]``), e.g. that the dots became tensor-core ``mma``
and the dequantisation has no int->float convert. The pip ``triton`` is not the Triton inside
jaxlib, so agreement is strong evidence, not proof; the GPU run stays the final word.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp

from maxlm.kernels.int4_matmul.kernel import default_blocks, int4_matmul_pallas
from maxlm.kernels.int4_matmul.reference import PACK


def triton_ir(m: int, k: int, n: int, group: int, dtype=jnp.bfloat16, **blocks) -> str:
    """The kernel's Triton IR (text) for x [m, k] · W [k, n], lowered for CUDA here (``blocks`` may
    name a ``variant``; missing block settings come from ``default_blocks`` for it).

    The module is taken from Pallas' private ``lower_jaxpr_to_triton_module`` (jax 0.10-0.11);
    on jax >= 0.11 lowering then compiles through the GPU plugin, which fails without a GPU once
    the IR exists, so such a failure is ignored. NotImplementedError where the hook is gone."""
    try:
        from jax._src.pallas.triton import lowering  # noqa: PLC0415  (private; only this aid needs it)
        build = lowering.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError) as e:
        raise NotImplementedError(f"this jax {jax.__version__} has no Pallas Triton lowering hook: {e}") from e
    captured = []

    def capture(*args, **kwargs):
        result = build(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    params = {**default_blocks(m, k, n, blocks.get("variant", "dot")), **blocks}
    fn = jax.jit(functools.partial(int4_matmul_pallas, interpret=False, **params))
    args = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k // PACK, n), jnp.int32),
            jax.ShapeDtypeStruct((k // group, n), jnp.float32))
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(lowering, "lower_jaxpr_to_triton_module", capture))
        try:  # jax >= 0.11 asks which GPU it lowers for: say an H100 (sm_90), as no GPU is here
            from jax._src.pallas.triton import pallas_call_registration  # noqa: PLC0415
            gpu_info = getattr(pallas_call_registration, "gpu_info_lib", None)
        except ImportError:
            gpu_info = None
        if gpu_info is not None:
            h100 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H100)
            stack.enter_context(mock.patch.object(gpu_info, "get_gpu_info", lambda: h100))
        try:
            fn.trace(*args).lower(lowering_platforms=("cuda",))
        except Exception:
            if not captured:  # the kernel itself did not lower
                raise
    return captured[-1]


def compile_ir(ir: str, *, num_warps: int, num_stages: int, capability: int = 90):
    """Compile Triton IR text with the ``triton`` package for a CUDA target of ``capability``;
    returns triton's CompiledKernel (``.asm["ptx"]``, ``.metadata.shared`` bytes of smem)."""
    import triton  # noqa: PLC0415  (optional: only this check needs it)
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "int4_matmul.ttir")  # triton.compile picks the stage by suffix
        with open(path, "w") as f:
            f.write(ir)
        return triton.compile(path, target=GPUTarget("cuda", capability, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
