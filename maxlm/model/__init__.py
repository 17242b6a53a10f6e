"""The model: a decoder-only transformer as a pure function of a parameter pytree.

``linear`` is the seam every weight matmul goes through, ``attention`` the seam every attention
goes through (each implementation builds its own mask from positions and segment ids), ``cache``
the KV-cache interface and its dense implementation, ``layers`` the blocks, ``transformer`` the
one forward for training, prefill and decode, ``loss`` the vocab-masked token NLL, ``flops`` the
closed-form parameter and FLOP counts. Imports ``maxlm.config`` and ``maxlm.parallel.sharding``.
"""

from maxlm.model.cache import KVCache
from maxlm.model.flops import flops_per_token, matmul_params, param_count
from maxlm.model.loss import cross_entropy, token_nll
from maxlm.model.transformer import (Transformer, abstract_params, block_class, forward, forward_hidden,
                                     init_params)

__all__ = ["KVCache", "Transformer", "abstract_params", "block_class", "cross_entropy", "flops_per_token",
           "forward", "forward_hidden", "init_params", "matmul_params", "param_count", "token_nll"]
