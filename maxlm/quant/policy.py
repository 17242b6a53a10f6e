"""Which weights a quantization touches, as ModelConfig settings (``linear_rules``, the groups and
``embedding``), so that init, abstract shapes, checkpoints and loading all follow from the config.

    all       every Linear of every layer at --bits (attention and MLP); the LM head and the
              embedding stay unless asked (``lm_head``, ``embedding``)
    ffn-only  the MLP Linears only, at --bits
    layered   a mix as practitioners ship it: attention projections unquantized, MLP INT8 (one
              scale per output channel), the embedding table INT4 in groups (a lookup reads one
              row, so its error does not compound through matmuls). A tied embedding is also the
              LM head, the most sensitive matmul, so a tied table goes to INT8 instead.
"""

from __future__ import annotations

import dataclasses

from maxlm.config import ModelConfig

POLICIES = ("all", "ffn-only", "layered")
DEFAULT_GROUP = 128


def impl_of(bits: int) -> str:
    return {4: "int4", 8: "int8"}[bits]


def quantized_config(cfg: ModelConfig, policy: str, bits: int | None, group: int | None = None,
                     lm_head: bool = False, embedding: str | None = None) -> ModelConfig:
    """``cfg`` with the rules of ``policy``. ``group``: inputs per scale of INT4 (default 128) and,
    when given with 8 bits, of INT8 (default: one scale per output channel)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
    changes: dict = {"int8_group": 0}
    if policy == "layered" or bits == 4:
        changes["quant_group"] = group or DEFAULT_GROUP
    if policy == "layered":
        rules = (("^mlp/", "int8"),)
        changes["embedding"] = "int8" if cfg.tie_embeddings else "int4"
    else:
        impl = impl_of(bits)
        rules = (("^mlp/", impl),) if policy == "ffn-only" else (("^(attn|mlp)/", impl),)
        if bits == 8:
            changes["int8_group"] = group or 0
        if lm_head and not cfg.tie_embeddings:
            rules += (("^lm_head$", impl),)
        elif lm_head:  # the head is the table: quantize the table
            changes["embedding"] = impl
    if embedding is not None:
        changes["embedding"] = embedding
    return dataclasses.replace(cfg, linear="dense", linear_rules=rules, **changes)
