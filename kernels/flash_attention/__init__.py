"""Flash attention for NVIDIA GPUs in Pallas (forward and backward), with its jnp reference.

``api.flash_attention`` is the entry (custom_vjp over the three kernels of ``kernel.py``, shapes
padded to fit); ``schedule.py`` decides which block pairs run; ``reference.py`` is dense jnp.
A decode-shaped kernel (one query per row against a cache) belongs beside these as its own
module, reusing ``reference.py`` for its tests.
"""

from maxlm.kernels.flash_attention.api import BlockSizes, default_interpret, flash_attention
from maxlm.kernels.flash_attention.reference import attention_reference, reference_mask
from maxlm.kernels.flash_attention.schedule import block_tables, position_blocks, visited_pairs

__all__ = ["BlockSizes", "attention_reference", "block_tables", "default_interpret", "flash_attention",
           "position_blocks", "reference_mask", "visited_pairs"]
