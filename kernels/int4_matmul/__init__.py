"""Weight-only INT4 matmul: the packed format and its jnp reference (``reference``)."""

from maxlm.kernels.int4_matmul.reference import (check_shapes, dequantize_int4, int4_matmul_reference, pack_int4,
                                                 quantize_int4, unpack_int4)

__all__ = ["check_shapes", "dequantize_int4", "int4_matmul_reference", "pack_int4", "quantize_int4", "unpack_int4"]
