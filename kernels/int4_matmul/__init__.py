"""Weight-only INT4 matmul: the packed format and its jnp reference (``reference``), the fused
Pallas kernel (``kernel``) and the entry point that picks between them (``ops.int4_matmul``)."""

from maxlm.kernels.int4_matmul.kernel import VARIANTS, check_blocks, default_blocks, int4_matmul_pallas
from maxlm.kernels.int4_matmul.ops import IMPLS, int4_matmul
from maxlm.kernels.int4_matmul.reference import (check_shapes, dequantize_int4, int4_matmul_reference, pack_int4,
                                                 quantize_int4, unpack_int4)

__all__ = ["IMPLS", "VARIANTS", "check_blocks", "check_shapes", "default_blocks", "dequantize_int4", "int4_matmul",
           "int4_matmul_pallas", "int4_matmul_reference", "pack_int4", "quantize_int4", "unpack_int4"]
