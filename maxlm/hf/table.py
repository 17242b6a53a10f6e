"""The two-way table: one row per Hugging Face tensor, per family, driving import and export.

A row is (maxlm path(s), HF name, HF shape, transform). A transform holds the map from HF's layout
to maxlm's (``to_maxlm``) and its inverse (``to_hf``) side by side, so each layout change is
written once and both directions use it:

    HF Llama                          HF GPT-2                   maxlm (layers stacked on axis 0)
    model.embed_tokens [V, D]         wte [V, D]                 embed [padded_vocab, D]
    -                                 wpe [P, D]                 pos_embed [max_seq_len, D]
    input_layernorm                   ln_1                       layers/attn_norm/{scale, bias}
    self_attn.{q,k,v}_proj [N*H, D]   attn.c_attn [D, 3*D]       layers/attn/{q,k,v}_proj/kernel [D, N|K, H]
    self_attn.o_proj [D, N*H]         attn.c_proj [D, D]         layers/attn/o_proj/kernel [N, H, D]
    post_attention_layernorm          ln_2                       layers/mlp_norm/{scale, bias}
    mlp.{gate,up}_proj [F, D]         mlp.c_fc [D, F]            layers/mlp/{gate,up}_proj/kernel [D, F]
    mlp.down_proj [D, F]              mlp.c_proj [F, D]          layers/mlp/down_proj/kernel [F, D]
    model.norm                        ln_f                       final_norm/{scale, bias}
    lm_head [V, D] (untied)           (tied to wte)              lm_head/kernel [D, padded_vocab]

* Llama's ``nn.Linear`` weights are [out, in] and are transposed; GPT-2's ``Conv1D`` weights are
  already [in, out]. Llama's q/k projections are in rotate-half order, which is maxlm's rope
  layout too, so no permutation is needed.
* Vocabulary padding: maxlm pads the vocabulary to a multiple of ``vocab_multiple``. Import
  zero-fills the rows (columns of ``lm_head``) past ``vocab_size``; export drops them, whatever they
  hold (no token id reaches them and the loss masks their logits), so ``import(export(p)) == p``
  exactly when they are zero.
* Layer stacking: a row whose maxlm path starts with ``layers/`` is one HF tensor per layer (``{i}``
  in its name) and one maxlm leaf with a leading ``layers`` axis.
* GPT-2's fused ``c_attn`` is one HF tensor holding q|k|v along its last axis: one row, three maxlm
  paths; import splits it, export concatenates.
* maxlm has one ``use_bias`` switch, HF Llama two (``attention_bias``, ``mlp_bias``) and no
  ``lm_head`` bias. A row with no HF name is such a bias: import makes zeros, export requires zeros
  (anything else could not be represented) and writes nothing.

numpy only: the same rows serve a lazily read safetensors checkpoint and an in-memory dict.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from maxlm.config import ModelConfig

# Non-parameter buffers that some checkpoints carry; they hold nothing to import.
IGNORED = re.compile(r"(^|\.)attn\.(masked_)?bias$|rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class Transform:
    """HF layout -> maxlm layout (``to_maxlm``) and back (``to_hf``), exact inverses."""

    to_maxlm: Callable[[Any], Any]
    to_hf: Callable[[Any], Any]

    def __rshift__(self, then: Transform) -> Transform:
        """``self``, then ``then``; the inverse undoes ``then`` first."""
        return Transform(lambda x: then.to_maxlm(self.to_maxlm(x)), lambda y: self.to_hf(then.to_hf(y)))


SAME = Transform(lambda x: x, lambda y: y)
# nn.Linear stores [out, in]; maxlm (like GPT-2's Conv1D) stores [in, out].
TRANSPOSE = Transform(lambda w: w.T, lambda w: w.T)
# HF names each layer's tensor; maxlm stacks them on a leading axis (for nn.scan).
STACK = Transform(lambda per_layer: np.stack(per_layer), lambda stacked: list(stacked))


def split_last(shape: tuple[int, ...]) -> Transform:
    """HF's flat last axis as maxlm's ``shape`` (e.g. N*H -> [N, H])."""
    return Transform(lambda x: x.reshape(*x.shape[:-1], *shape),
                     lambda y: y.reshape(*y.shape[:y.ndim - len(shape)], -1))


def split_first(shape: tuple[int, ...]) -> Transform:
    """HF's flat first axis as maxlm's ``shape`` (e.g. N*H -> [N, H])."""
    return Transform(lambda x: x.reshape(*shape, *x.shape[1:]),
                     lambda y: y.reshape(-1, *y.shape[len(shape):]))


def pad_vocab(m: ModelConfig, axis: int) -> Transform:
    """Zero rows up to ``padded_vocab`` along ``axis`` on import; dropped on export."""
    def pad(x):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, m.padded_vocab - m.vocab_size)
        return np.pad(x, widths)

    def unpad(y):
        index = [slice(None)] * y.ndim
        index[axis] = slice(0, m.vocab_size)
        return y[tuple(index)]
    return Transform(pad, unpad)


def fused(count: int, each: Transform) -> Transform:
    """One HF tensor holding ``count`` maxlm leaves side by side on its last axis (q|k|v)."""
    return Transform(lambda x: tuple(each.to_maxlm(part) for part in np.split(x, count, axis=-1)),
                     lambda ys: np.concatenate([each.to_hf(y) for y in ys], axis=-1))


@dataclasses.dataclass(frozen=True)
class Row:
    maxlm: str | tuple[str, ...]  # slash path(s); a tuple when one HF tensor holds several leaves
    hf: str | None  # None: HF has no such tensor (a zero bias in maxlm)
    shape: tuple[int, ...]  # HF's shape (of one layer's tensor)
    transform: Transform = SAME

    @property
    def paths(self) -> tuple[str, ...]:
        return self.maxlm if isinstance(self.maxlm, tuple) else (self.maxlm,)

    @property
    def layered(self) -> bool:
        return self.paths[0].startswith("layers/")

    def names(self, n_layers: int) -> list[str | None]:
        """The HF name of each layer's tensor (one name for a row outside the layer stack)."""
        if not self.layered:
            return [self.hf]
        return [None if self.hf is None else self.hf.format(i=i) for i in range(n_layers)]

    def to_maxlm(self, per_layer: list[np.ndarray]) -> tuple[np.ndarray, ...]:
        """HF tensors (one per layer, or one) -> one maxlm leaf per path."""
        outs = [self.transform.to_maxlm(x) for x in per_layer]
        outs = [out if isinstance(out, tuple) else (out,) for out in outs]
        leaves = [[out[j] for out in outs] for j in range(len(self.paths))]
        return tuple(STACK.to_maxlm(parts) if self.layered else parts[0] for parts in leaves)

    def to_hf(self, leaves: tuple[np.ndarray, ...]) -> list[np.ndarray]:
        """One maxlm leaf per path -> HF tensors (one per layer, or one)."""
        per_path = [STACK.to_hf(leaf) if self.layered else [leaf] for leaf in leaves]
        per_layer = zip(*per_path)
        return [self.transform.to_hf(parts if len(parts) > 1 else parts[0]) for parts in per_layer]


@dataclasses.dataclass(frozen=True)
class Table:
    family: str
    rows: list[Row]
    base: str  # prefix of HF's base model; checkpoints of the bare base model (no head) lack it
    tolerated: tuple[str, ...]  # tensors import may skip: a tied head's copy of the embedding


def _llama_rows(m: ModelConfig, hf: dict) -> list[Row]:
    d, n, k, h, f, v = m.d_model, m.n_heads, m.kv_heads, m.dim_per_head, m.d_ff, m.vocab_size
    layer = "model.layers.{i}."
    rows = [
        Row("embed", "model.embed_tokens.weight", (v, d), pad_vocab(m, 0)),
        Row("layers/attn_norm/scale", layer + "input_layernorm.weight", (d,)),
        Row("layers/attn/q_proj/kernel", layer + "self_attn.q_proj.weight", (n * h, d), TRANSPOSE >> split_last((n, h))),
        Row("layers/attn/k_proj/kernel", layer + "self_attn.k_proj.weight", (k * h, d), TRANSPOSE >> split_last((k, h))),
        Row("layers/attn/v_proj/kernel", layer + "self_attn.v_proj.weight", (k * h, d), TRANSPOSE >> split_last((k, h))),
        Row("layers/attn/o_proj/kernel", layer + "self_attn.o_proj.weight", (d, n * h), TRANSPOSE >> split_first((n, h))),
        Row("layers/mlp_norm/scale", layer + "post_attention_layernorm.weight", (d,)),
        Row("layers/mlp/gate_proj/kernel", layer + "mlp.gate_proj.weight", (f, d), TRANSPOSE),
        Row("layers/mlp/up_proj/kernel", layer + "mlp.up_proj.weight", (f, d), TRANSPOSE),
        Row("layers/mlp/down_proj/kernel", layer + "mlp.down_proj.weight", (d, f), TRANSPOSE),
        Row("final_norm/scale", "model.norm.weight", (d,)),
    ]
    if not m.tie_embeddings:
        rows.append(Row("lm_head/kernel", "lm_head.weight", (v, d), TRANSPOSE >> pad_vocab(m, 1)))
    attn_bias, mlp_bias = bool(hf.get("attention_bias")), bool(hf.get("mlp_bias"))
    if (attn_bias or mlp_bias) and not m.use_bias:
        raise ValueError("the Hugging Face config has attention_bias/mlp_bias but ModelConfig.use_bias is False")
    if m.use_bias:
        def attn(name: str) -> str | None:
            return layer + f"self_attn.{name}.bias" if attn_bias else None

        def mlp(name: str) -> str | None:
            return layer + f"mlp.{name}.bias" if mlp_bias else None
        rows += [
            Row("layers/attn/q_proj/bias", attn("q_proj"), (n * h,), split_last((n, h))),
            Row("layers/attn/k_proj/bias", attn("k_proj"), (k * h,), split_last((k, h))),
            Row("layers/attn/v_proj/bias", attn("v_proj"), (k * h,), split_last((k, h))),
            Row("layers/attn/o_proj/bias", attn("o_proj"), (d,)),
            Row("layers/mlp/gate_proj/bias", mlp("gate_proj"), (f,)),
            Row("layers/mlp/up_proj/bias", mlp("up_proj"), (f,)),
            Row("layers/mlp/down_proj/bias", mlp("down_proj"), (d,)),
        ]
        if not m.tie_embeddings:  # LlamaForCausalLM's lm_head never has a bias
            rows.append(Row("lm_head/bias", None, (v,), pad_vocab(m, 0)))
    return rows


def _gpt2_rows(m: ModelConfig) -> list[Row]:
    d, n, h, f, v = m.d_model, m.n_heads, m.dim_per_head, m.d_ff, m.vocab_size
    layer = "transformer.h.{i}."

    def qkv(leaf: str) -> tuple[str, ...]:
        return tuple(f"layers/attn/{p}_proj/{leaf}" for p in "qkv")
    return [
        Row("embed", "transformer.wte.weight", (v, d), pad_vocab(m, 0)),
        Row("pos_embed", "transformer.wpe.weight", (m.max_seq_len, d)),
        Row("layers/attn_norm/scale", layer + "ln_1.weight", (d,)),
        Row("layers/attn_norm/bias", layer + "ln_1.bias", (d,)),
        Row(qkv("kernel"), layer + "attn.c_attn.weight", (d, 3 * d), fused(3, split_last((n, h)))),
        Row(qkv("bias"), layer + "attn.c_attn.bias", (3 * d,), fused(3, split_last((n, h)))),
        Row("layers/attn/o_proj/kernel", layer + "attn.c_proj.weight", (d, d), split_first((n, h))),
        Row("layers/attn/o_proj/bias", layer + "attn.c_proj.bias", (d,)),
        Row("layers/mlp_norm/scale", layer + "ln_2.weight", (d,)),
        Row("layers/mlp_norm/bias", layer + "ln_2.bias", (d,)),
        Row("layers/mlp/up_proj/kernel", layer + "mlp.c_fc.weight", (d, f)),
        Row("layers/mlp/up_proj/bias", layer + "mlp.c_fc.bias", (f,)),
        Row("layers/mlp/down_proj/kernel", layer + "mlp.c_proj.weight", (f, d)),
        Row("layers/mlp/down_proj/bias", layer + "mlp.c_proj.bias", (d,)),
        Row("final_norm/scale", "transformer.ln_f.weight", (d,)),
        Row("final_norm/bias", "transformer.ln_f.bias", (d,)),
    ]


def table(model_cfg: ModelConfig, family: str, hf_config: dict[str, Any]) -> Table:
    """The rows of ``family`` ('llama' or 'gpt2') for this model; ``hf_config`` supplies what
    ModelConfig does not say (Llama's ``attention_bias`` and ``mlp_bias``)."""
    m = model_cfg
    tolerated = ("lm_head.weight",) if m.tie_embeddings else ()
    if family == "llama":
        return Table(family, _llama_rows(m, hf_config), "model.", tolerated)
    if family == "gpt2":
        return Table(family, _gpt2_rows(m), "transformer.", tolerated)
    raise ValueError(f"no table for family {family!r}")
