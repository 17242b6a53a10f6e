"""Closed forms of the model's size and cost: parameters, matmul parameters, FLOPs per token.

Training's MFU and the planner both read these (one definition each); a test checks
``param_count`` against the real tree (``abstract_params``)."""

from __future__ import annotations

from maxlm.config import ModelConfig
from maxlm.model import lora


def param_count(cfg: ModelConfig) -> int:
    """Closed-form parameter count (padded vocabulary included); equals the real tree's size, LoRA adapters included."""
    d, f, n, k, h, v = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.kv_heads, cfg.dim_per_head, cfg.padded_vocab
    norm = d * (2 if cfg.norm == "layer" else 1)
    attn = d * n * h + 2 * d * k * h + n * h * d
    mlp = (3 if cfg.activation == "swiglu" else 2) * d * f
    if cfg.use_bias:
        attn += n * h + 2 * k * h + d
        mlp += (2 if cfg.activation == "swiglu" else 1) * f + d
    layer = attn + mlp + 2 * norm
    total = v * d + cfg.n_layers * layer + norm
    if cfg.position == "learned":
        total += cfg.max_seq_len * d
    if not cfg.tie_embeddings:
        total += d * v + (v if cfg.use_bias else 0)
    return total + lora.count(cfg)


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: all but the lookup tables.

    A tied embedding table is also the output projection, so it stays in."""
    lookups = 0 if cfg.tie_embeddings else cfg.padded_vocab * cfg.d_model
    if cfg.position == "learned":
        lookups += cfg.max_seq_len * cfg.d_model
    return param_count(cfg) - lookups


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix B: 6N + 12·L·H·Q·T.

    6N counts the forward (2N) and backward (4N) matmuls; the second term is attention's
    score and context matmuls (L layers, H heads, Q head dim, T sequence length), not halved
    for causality, as in PaLM. Rematerialisation is not counted (this is model FLOPs, for MFU)."""
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layers * cfg.n_heads * cfg.dim_per_head * seq_len
