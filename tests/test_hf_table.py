"""maxlm.hf's two-way table: ``export_params(import_params(x)) == x`` and back, bit for bit, and
logits parity of an exported maxlm model loaded into Hugging Face transformers.

The reference names and shapes come from transformers itself (a model built on the meta device,
less a tied ``lm_head.weight``, as ``save_pretrained`` writes it), not from maxlm's table.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from maxlm import hf, model  # noqa: E402

ATOL = 1e-4
LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=301, max_position_embeddings=128, rope_theta=500000.0,
             tie_word_embeddings=False)
GPT2 = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=301, n_positions=128, bos_token_id=0, eos_token_id=0)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)

CASES = {  # name -> (family, transformers config overrides)
    "llama_gqa_untied": ("llama", {}),
    "llama_gqa_biases": ("llama", dict(attention_bias=True, mlp_bias=True, head_dim=32)),
    "llama_attention_bias_only": ("llama", dict(attention_bias=True, mlp_bias=False)),
    "llama_mlp_bias_only": ("llama", dict(attention_bias=False, mlp_bias=True)),
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    "gpt2": ("gpt2", {}),
}


def _hf_config(family: str, overrides: dict):
    if family == "llama":
        return transformers.LlamaConfig(**{**LLAMA, **overrides})
    return transformers.GPT2Config(**{**GPT2, **overrides})


def _case(name: str, vocab_multiple: int = 128):
    """(family, HF config dict, maxlm ModelConfig, HF name -> shape as save_pretrained writes it)."""
    family, overrides = CASES[name]
    cfg = _hf_config(family, overrides)
    with torch.device("meta"):
        net = transformers.AutoModelForCausalLM.from_config(cfg)
    shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    if cfg.tie_word_embeddings:
        del shapes["lm_head.weight"]
    hf_dict = cfg.to_dict()
    model_cfg = dataclasses.replace(hf.config_from_hf(hf_dict, dtype="float32"), vocab_multiple=vocab_multiple)
    return family, hf_dict, model_cfg, shapes


def _random_hf(shapes: dict, dtype=np.float32, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape in shapes.items()}


def _random_maxlm(model_cfg, hf_dict: dict, seed: int = 0, std: float = 1.0) -> dict:
    """A random maxlm tree, zero where Hugging Face has no place: vocabulary padding, the biases
    Llama's config switches off, and Llama's lm_head bias."""
    rng = np.random.default_rng(seed)
    abstract = model.abstract_params(model_cfg)

    def leaf(path, x):
        keys = [k.key for k in path]
        value = std * rng.standard_normal(x.shape)
        if keys[-1] == "scale":
            value = 1.0 + 0.1 * rng.standard_normal(x.shape)
        if keys[-1] == "bias" and hf_dict["model_type"] == "llama":
            on = hf_dict.get("attention_bias") if "attn" in keys else hf_dict.get("mlp_bias")
            if keys[0] == "lm_head" or not on:
                value[...] = 0
        return value.astype(np.float32)

    tree = jax.tree_util.tree_map_with_path(leaf, abstract)
    v = model_cfg.vocab_size
    tree["embed"][v:] = 0
    if "lm_head" in tree:
        tree["lm_head"]["kernel"][:, v:] = 0
    return tree


def _assert_same_bits(got: dict, want: dict) -> None:
    """Same keys, and each array the same dtype, shape and bytes."""
    got_flat = dict(jax.tree_util.tree_flatten_with_path(got)[0])
    want_flat = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    assert sorted(map(jax.tree_util.keystr, got_flat)) == sorted(map(jax.tree_util.keystr, want_flat))
    for path, w in want_flat.items():
        g = got_flat[path]
        assert isinstance(g, np.ndarray), (path, type(g))
        assert (g.dtype, g.shape) == (w.dtype, w.shape), (jax.tree_util.keystr(path), g.dtype, g.shape, w.dtype,
                                                           w.shape)
        assert g.tobytes() == w.tobytes(), jax.tree_util.keystr(path)


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("vocab_multiple", [128, 8])
@pytest.mark.parametrize("name", CASES)
def test_hf_to_maxlm_to_hf_is_bit_exact(name, vocab_multiple):
    _, hf_dict, model_cfg, shapes = _case(name, vocab_multiple)
    x = _random_hf(shapes)
    params = hf.import_params(x, model_cfg, hf_dict)
    expected = jax.tree.map(lambda s: s.shape, model.abstract_params(model_cfg))
    assert jax.tree.map(np.shape, params) == expected
    assert model_cfg.padded_vocab > model_cfg.vocab_size
    assert not params["embed"][model_cfg.vocab_size:].any()  # import zero-fills the padding
    _assert_same_bits(hf.export_params(params, model_cfg, hf_dict), x)


@pytest.mark.parametrize("vocab_multiple", [128, 8])
@pytest.mark.parametrize("name", CASES)
def test_maxlm_to_hf_to_maxlm_is_bit_exact(name, vocab_multiple):
    family, hf_dict, model_cfg, shapes = _case(name, vocab_multiple)
    params = _random_maxlm(model_cfg, hf_dict)
    exported = hf.export_params(params, model_cfg, hf_dict)
    assert {k: v.shape for k, v in exported.items()} == shapes  # transformers' own names and shapes
    _assert_same_bits(hf.import_params(exported, model_cfg, hf_dict), params)
    # jax arrays in, the same numpy arrays out
    _assert_same_bits(hf.export_params(jax.tree.map(jnp.asarray, params), model_cfg, hf_dict), exported)
    if hf_dict.get("attention_bias", False) == hf_dict.get("mlp_bias", False):
        # A family name stands for config_to_hf(model_cfg, family): same tensors.
        _assert_same_bits(hf.export_params(params, model_cfg, family), exported)
        _assert_same_bits(hf.import_params(exported, model_cfg, family), params)


@pytest.mark.parametrize("name", ["llama_gqa_biases", "gpt2"])
def test_bfloat16_round_trip(name):
    _, hf_dict, model_cfg, shapes = _case(name)
    x = _random_hf(shapes, ml_dtypes.bfloat16)
    _assert_same_bits(hf.export_params(hf.import_params(x, model_cfg, hf_dict, dtype=ml_dtypes.bfloat16),
                                       model_cfg, hf_dict), x)
    # fp32 in between is exact too; export's dtype casts back.
    params = hf.import_params(x, model_cfg, hf_dict)
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(params))
    _assert_same_bits(hf.export_params(params, model_cfg, hf_dict, dtype=ml_dtypes.bfloat16), x)


def test_export_drops_vocab_padding():
    _, hf_dict, model_cfg, _ = _case("llama_gqa_untied")
    params = _random_maxlm(model_cfg, hf_dict)
    padded = jax.tree.map(np.copy, params)
    padded["embed"][model_cfg.vocab_size:] = 1.0
    padded["lm_head"]["kernel"][:, model_cfg.vocab_size:] = 1.0
    exported = hf.export_params(padded, model_cfg, hf_dict)
    _assert_same_bits(exported, hf.export_params(params, model_cfg, hf_dict))
    _assert_same_bits(hf.import_params(exported, model_cfg, hf_dict), params)


def test_gpt2_c_attn_is_q_k_v_side_by_side():
    _, hf_dict, model_cfg, shapes = _case("gpt2")
    x = _random_hf(shapes)
    attn = hf.import_params(x, model_cfg, hf_dict)["layers"]["attn"]
    d, n, h = model_cfg.d_model, model_cfg.n_heads, model_cfg.dim_per_head
    fused = x["transformer.h.1.attn.c_attn.weight"]
    for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        np.testing.assert_array_equal(attn[proj]["kernel"][1], fused[:, i * d:(i + 1) * d].reshape(d, n, h))


# ------------------------------------------------------------------------------ configs and errors


@pytest.mark.parametrize("name", CASES)
def test_config_to_hf_round_trip(name):
    family, _, model_cfg, _ = _case(name)
    back = hf.config_from_hf(hf.config_to_hf(model_cfg, family), dtype="float32")
    assert back == dataclasses.replace(model_cfg, vocab_multiple=128)
    scaled = dataclasses.replace(model_cfg, rope_scaling_factor=8.0, rope_original_max_len=32)
    if family == "llama":
        assert hf.config_from_hf(hf.config_to_hf(scaled, family), dtype="float32") == scaled


def test_export_errors():
    family, hf_dict, model_cfg, _ = _case("llama_attention_bias_only")
    params = _random_maxlm(model_cfg, hf_dict)
    params["layers"]["mlp"]["up_proj"]["bias"][1, 3] = 0.5
    with pytest.raises(hf.HFExportError, match=r"'layers/mlp/up_proj/bias\[1\]' is nonzero.*mlp_bias=False"):
        hf.export_params(params, model_cfg, hf_dict)
    family, hf_dict, model_cfg, _ = _case("llama_gqa_biases")
    params = _random_maxlm(model_cfg, hf_dict)
    params["lm_head"]["bias"][0] = 1.0
    with pytest.raises(hf.HFExportError, match="'lm_head/bias' is nonzero"):
        hf.export_params(params, model_cfg, family)
    del params["lm_head"]
    with pytest.raises(hf.HFExportError, match="'lm_head/kernel' is missing"):
        hf.export_params(params, model_cfg, family)
    with pytest.raises(hf.HFExportError, match="has shape"):
        hf.export_params(_random_maxlm(model_cfg, hf_dict), dataclasses.replace(model_cfg, d_ff=128), family)
    with pytest.raises(hf.HFExportError, match="ModelConfig.norm = 'rms' does not fit gpt2"):
        hf.export_params(params, model_cfg, "gpt2")
    with pytest.raises(hf.HFExportError, match="'bert' is not supported"):
        hf.config_to_hf(model_cfg, "bert")
    with pytest.raises(hf.HFImportError, match="'model.norm.weight' is missing"):
        x = _random_hf(_case("llama_tied")[3])
        del x["model.norm.weight"]
        hf.import_params(x, _case("llama_tied")[2], "llama")


# ------------------------------------------------------------------------------ logits parity


@pytest.mark.parametrize("name,rope", [("llama_gqa_biases", LLAMA3_ROPE), ("llama_tied", None), ("gpt2", None)])
def test_exported_logits_match_transformers(name, rope):
    family, hf_dict, model_cfg, _ = _case(name)
    if rope:
        model_cfg = dataclasses.replace(model_cfg, rope_scaling_factor=rope["factor"],
                                        rope_original_max_len=rope["original_max_position_embeddings"])
    params = _random_maxlm(model_cfg, hf_dict, std=0.1)
    # Padding holds random values after maxlm's own init; export drops them and logits agree anyway.
    params["embed"][model_cfg.vocab_size:] = 3.0
    tensors = hf.export_params(params, model_cfg, family)

    config_cls = transformers.LlamaConfig if family == "llama" else transformers.GPT2Config
    net = transformers.AutoModelForCausalLM.from_config(
        config_cls.from_dict(hf.config_to_hf(model_cfg, family), attn_implementation="eager"))
    state = {k: torch.tensor(np.array(v)) for k, v in tensors.items()}
    missing, unexpected = net.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if model_cfg.tie_embeddings else set())
    net = net.to(torch.float32).eval()

    ids = np.random.default_rng(0).integers(0, model_cfg.vocab_size, size=(2, 96))
    with torch.no_grad():
        want = net(torch.from_numpy(ids)).logits.numpy()
    got = np.asarray(jax.jit(lambda p, x: model.forward(model_cfg, p, x)[0])(params, jnp.asarray(ids, jnp.int32)))
    diff = np.abs(got[..., :model_cfg.vocab_size] - want).max()
    print(f"{name} exported max abs logit diff {diff:.2e}")
    assert diff < ATOL and np.abs(want).max() > 0.1


def test_import_bare_base_model_names_and_family_mismatch():
    # LlamaModel / GPT2Model checkpoints (no head) name their tensors without "model." / "transformer.".
    _, hf_dict, model_cfg, shapes = _case("gpt2")
    x = _random_hf(shapes)
    bare = {k.removeprefix("transformer."): v for k, v in x.items()}
    _assert_same_bits(hf.import_params(bare, model_cfg, hf_dict), hf.import_params(x, model_cfg, hf_dict))
    llama_cfg = _case("llama_tied")[2]
    with pytest.raises(hf.HFImportError, match="ModelConfig.norm = 'rms' does not fit gpt2"):
        hf.import_params(x, llama_cfg, hf_dict)
    # A checkpoint deeper than the config: the extra layer's tensors are named, not dropped.
    with pytest.raises(hf.HFImportError, match=r"unexpected tensors transformer\.h\.1\.attn\.c_attn\.bias"):
        hf.import_params(x, dataclasses.replace(model_cfg, n_layers=1), hf_dict)
