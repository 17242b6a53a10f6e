"""Compression after training: quantization (RTN, GPTQ, AWQ; INT8 and INT4 with layered policies)
and structured pruning (attention heads, whole layers). Works on a parameter tree and its
ModelConfig; ``python -m maxlm.quantize`` and ``python -m maxlm.prune`` are the command lines."""
