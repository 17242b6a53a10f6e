"""One forward, three modes: prefill + decode through the KV cache equals the full forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import model
from maxlm.config import ModelConfig
from maxlm.infer import generate
from maxlm.model import KVCache, attention
from maxlm.parallel import sharding

LLAMA = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=300, vocab_multiple=8,
             max_seq_len=64, dtype="float32")
GPT2 = dict(LLAMA, n_kv_heads=0, norm="layer", activation="gelu", position="learned", use_bias=True,
            tie_embeddings=True)
PROMPT_LENGTHS = (5, 11, 3, 8)  # a ragged batch: every row decodes at its own position
NEW_TOKENS = 32


def _tokens(cfg, rows):
    rng = np.random.default_rng(0)
    return rng.integers(0, cfg.vocab_size, (rows, max(PROMPT_LENGTHS) + NEW_TOKENS)).astype(np.int32)


def _prefill_inputs(tokens, lengths):
    width = max(lengths)
    prompt = np.zeros((len(lengths), width), np.int32)
    segments = np.zeros_like(prompt)
    for row, n in enumerate(lengths):
        prompt[row, :n], segments[row, :n] = tokens[row, :n], 1
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), prompt.shape)
    return prompt, segments, positions


def decode_errors(cfg, params, mesh=None):
    """Max |logits - full forward| over the prefill and each of NEW_TOKENS decode steps."""
    lengths = np.array(PROMPT_LENGTHS[:4], np.int32)
    tokens = _tokens(cfg, len(lengths))
    full = np.asarray(jax.jit(lambda p, t: model.forward(cfg, p, t)[0])(params, tokens))
    forward = jax.jit(lambda p, t, s, q, c: model.forward(cfg, p, t, s, q, c))
    cache = KVCache.create(cfg, len(lengths), int(lengths.max()) + NEW_TOKENS)
    if mesh is not None:
        names = sharding.logical_specs(model.abstract_params(cfg, boxed=True))
        params = jax.device_put(params, sharding.mesh_shardings(names, mesh))
        cache = jax.device_put(cache, jax.tree.map(
            lambda n: jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(n)), KVCache.logical_names(),
            is_leaf=lambda x: isinstance(x, tuple)))
    logits, cache = forward(params, *_prefill_inputs(tokens, lengths), cache)
    errors = [max(np.abs(np.asarray(logits)[r, :n] - full[r, :n]).max() for r, n in enumerate(lengths))]
    for i in range(NEW_TOKENS - 1):
        step = tokens[np.arange(len(lengths)), lengths + i][:, None]
        logits, cache = forward(params, step, np.ones_like(step), (lengths + i)[:, None], cache)
        want = full[np.arange(len(lengths)), lengths + i]
        errors.append(np.abs(np.asarray(logits)[:, 0] - want).max())
    assert np.array_equal(np.asarray(cache.lengths()), lengths + NEW_TOKENS - 1)
    return np.array(errors)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_decode_matches_full_forward_on_one_device(family):
    cfg = ModelConfig(**(LLAMA if family == "llama" else GPT2))
    params = model.init_params(cfg, jax.random.PRNGKey(1))
    errors = decode_errors(cfg, params)
    assert errors.max() < 1e-4, errors


@pytest.mark.parametrize("degrees", [dict(data=1, tensor=2), dict(data=2, tensor=2)], ids=["1x1x2x1", "2x1x2x1"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_decode_matches_full_forward_on_a_mesh(family, degrees):
    cfg = ModelConfig(**(LLAMA if family == "llama" else GPT2))
    params = model.init_params(cfg, jax.random.PRNGKey(1))
    shape = {"data": 1, "fsdp": 1, "tensor": 1, "pipeline": 1, **degrees}
    mesh = sharding.make_mesh(shape, jax.devices()[:shape["data"] * shape["tensor"]])
    with jax.set_mesh(mesh):
        errors = decode_errors(cfg, params, mesh)
    assert errors.max() < 1e-4, errors


def _window_reference(window, q, k, v, queries, keys, sliding_window, self_attention):
    """Attention masked by token index alone: key j is visible to query i iff i - window < j <= i."""
    t = q.shape[1]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    mask = jnp.asarray((j <= i) & (i - j < window))[None, None]
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sliding_window_decode_matches_a_reference_that_masks_by_window(family, monkeypatch):
    window = 6
    cfg = ModelConfig(**(LLAMA if family == "llama" else GPT2), sliding_window=window)
    params = model.init_params(cfg, jax.random.PRNGKey(2))
    monkeypatch.setitem(attention.IMPLS, "reference", functools.partial(_window_reference, window))
    reference_cfg = ModelConfig(**{**cfg.__dict__, "attention_impl": "reference"})
    tokens = _tokens(cfg, 4)
    want = np.asarray(model.forward(reference_cfg, params, tokens)[0])
    full = np.asarray(model.forward(cfg, params, tokens)[0])
    np.testing.assert_allclose(full, want, atol=1e-4)
    unwindowed = np.asarray(model.forward(ModelConfig(**{**cfg.__dict__, "sliding_window": 0}), params, tokens)[0])
    assert np.abs(unwindowed - want).max() > 1e-3  # the window really masks something
    errors = decode_errors(cfg, params)
    assert errors.max() < 1e-4, errors


def test_greedy_generation_follows_the_full_forward_argmax():
    cfg = ModelConfig(**LLAMA)
    params = model.init_params(cfg, jax.random.PRNGKey(3))
    prompts = [np.arange(1, 6), np.arange(7, 16), np.arange(2, 4)]
    out = generate.generate(cfg, params, prompts, 8, temperature=0.0)
    for prompt, new in zip(prompts, out):
        seq = list(prompt)
        for _ in range(8):
            logits = model.forward(cfg, params, jnp.asarray([seq], jnp.int32))[0][0, -1, :cfg.vocab_size]
            seq.append(int(jnp.argmax(logits)))
        assert list(new) == seq[len(prompt):]


def test_cache_shorter_than_a_token_position_drops_the_write():
    cfg = ModelConfig(**LLAMA)
    cache = KVCache.create(cfg, 1, 4)
    _, keys, where = cache.write(attention.Tokens(positions=jnp.array([[3, 4]]), segments=jnp.array([[1, 1]])))
    assert where.tolist() == [[3, 4]] and keys.segments.tolist() == [[0, 0, 0, 1]]
    with pytest.raises(ValueError, match="cache length 65"):
        KVCache.create(cfg, 1, 65)
