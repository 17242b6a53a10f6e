"""LoRA and QLoRA (issue 15, item 2): adapters in the linear seam, a frozen base without optimizer
state, merging, and config errors. PEFT's format is in test_lora_peft.py (against Hugging Face PEFT), the
training runs (LoRA SFT against full SFT, QLoRA, kill -9) in test_lora_sft.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config as config_lib
from maxlm import model
from maxlm.model import lora
from maxlm.parallel import sharding
from maxlm.train import optim, step

LLAMA = dict(vocab_size=259, vocab_multiple=8, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
             max_seq_len=64, dtype="float32", tie_embeddings=False)


def _cfg(**fields):
    return config_lib.ModelConfig(**{**LLAMA, "lora_rank": 8, **fields})


def _random_adapters(cfg, params, seed=1):
    """B is zero at initialisation (the model is the base's): make every adapter leaf nonzero."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64))
    return jax.tree_util.tree_map_with_path(
        lambda path, x: 0.2 * jax.random.normal(next(keys), x.shape) if lora.is_adapter(path) else x, params)


def _tokens(batch=2, length=24, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 259, (batch, length)), jnp.int32)


@pytest.mark.parametrize("targets,per_layer", [
    (r"attn/(q|v)_proj$", lambda d, n, k, h, f: (d + n * h) + (d + k * h)),
    ("attn/|mlp/", lambda d, n, k, h, f: (d + n * h) + 2 * (d + k * h) + (n * h + d) + 2 * (d + f) + (f + d)),
], ids=["q_v", "all_linear"])
def test_trainable_count_is_the_closed_form(targets, per_layer):
    cfg = _cfg(lora_targets=targets)
    d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_per_head, cfg.d_ff
    want = cfg.lora_rank * per_layer(d, n, k, h, f) * cfg.n_layers
    params = model.abstract_params(cfg)
    mask = lora.trainable(params)
    counted = sum(x.size for x, m in zip(jax.tree.leaves(params), jax.tree.leaves(mask)) if m)
    assert counted == want == lora.count(cfg)
    # the base is exactly the model without adapters
    base = model.abstract_params(dataclasses.replace(cfg, lora_rank=0))
    assert jax.tree.structure(lora.without_adapters(params)) == jax.tree.structure(base)


def test_fresh_adapters_leave_the_base_unchanged():
    cfg = _cfg(lora_targets="attn/|mlp/|lm_head")
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    base_cfg = dataclasses.replace(cfg, lora_rank=0)
    got = model.forward(cfg, params, _tokens())[0]
    want = model.forward(base_cfg, lora.without_adapters(params), _tokens())[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("base", ["dense", "int4"])
def test_merged_logits_equal_the_adapter_model(base):
    """fp32, atol 1e-5; over an INT4 base (QLoRA) the merged Linears become dense, the rest stay INT4."""
    cfg = _cfg(lora_targets="attn/|mlp/", **({"linear": "int4", "quant_group": 16} if base == "int4" else {}))
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    if base == "int4":  # real INT4 weights: RTN of a random dense model
        from maxlm.quant.apply import quantize_model

        dense_cfg = dataclasses.replace(cfg, linear="dense", lora_rank=0)
        dense = model.init_params(dense_cfg, jax.random.PRNGKey(0))
        quantized, _ = quantize_model(dense_cfg, dense, dataclasses.replace(cfg, lora_rank=0), "rtn")
        params = lora.with_base(params, quantized)
    params = _random_adapters(cfg, params)
    merged_cfg, merged = lora.merge(cfg, params)
    assert merged_cfg.lora_rank == 0 and not lora.adapters(merged)
    assert all(merged_cfg.linear_impl(p) == "dense" for p in cfg.lora_paths())
    for path in set(cfg.linear_inputs()) - set(cfg.lora_paths()):  # the rest keep their format
        assert merged_cfg.linear_impl(path) == cfg.linear_impl(path)
    ids = _tokens()
    want = np.asarray(model.forward(cfg, params, ids)[0])
    got = np.asarray(model.forward(merged_cfg, merged, ids)[0])
    base_only = np.asarray(model.forward(dataclasses.replace(cfg, lora_rank=0), lora.without_adapters(params), ids)[0])
    assert np.abs(want - base_only).max() > 0.1  # the adapters matter at this scale
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_optimizer_state_exists_only_for_adapters():
    cfg = config_lib.build(num_devices=8, model={**LLAMA, "lora_rank": 4}, train={"global_batch": 8, "seq_len": 16, "sample_tokens": 0})
    mesh = sharding.make_mesh(cfg.mesh.shape(8))
    optimizer = optim.make_optimizer(cfg.optim, cfg.train.steps)
    shardings = step.state_shardings(cfg, mesh, optimizer, lora.trainable)
    state = step.init_state(cfg, optimizer, shardings, trainable=lora.trainable)
    adapter_shapes = sorted(tuple(x.shape) for x in lora.adapters(state.params).values())
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sorted(tuple(x.shape) for x in moments) == sorted(adapter_shapes * 2)  # AdamW: mu and nu
    # one step changes the adapters and nothing else
    from helpers import random_batch
    from maxlm.train import tasks

    loss_fn = tasks.lm_loss(step.model_forward(cfg, mesh), cfg.model.vocab_size)
    train, _ = step.compile_steps(cfg, mesh, optimizer, shardings, loss_fn, tasks.LM_BATCH, lora.trainable)
    before = jax.device_get(state.params)
    batch = step.device_batch(random_batch(np.random.default_rng(0), 8, 16), mesh, tasks.LM_BATCH)
    for _ in range(2):  # B leaves zero, so A first moves in the second step
        state, _ = train(state, batch)
    after = jax.device_get(state.params)
    changed = jax.tree_util.tree_map_with_path(lambda p, a, b: (lora.is_adapter(p), bool(np.any(a != b))), before, after)
    flags = jax.tree.leaves(changed, is_leaf=lambda x: isinstance(x, tuple))
    assert not any(moved for is_ad, moved in flags if not is_ad), "the frozen base moved"
    assert any(moved for is_ad, moved in flags if is_ad), "no adapter trained"


def test_adapters_are_sharded_like_their_base_weights():
    cfg = config_lib.build(num_devices=8, model={**LLAMA, "lora_rank": 4, "lora_targets": "attn/|mlp/"},
                           mesh={"data": 1, "fsdp": 4, "tensor": 2}, train={"global_batch": 8, "seq_len": 16, "sample_tokens": 0})
    names = step.param_names(cfg)
    specs = jax.tree.map(lambda n: sharding.logical_to_spec(n), names, is_leaf=lambda x: isinstance(x, tuple))
    for path in cfg.model.lora_paths():
        node = specs["layers"]
        for key in path.split("/"):
            node = node[key]
        kernel, a, b = tuple(node["kernel"]), tuple(node["lora_a"]), tuple(node["lora_b"])
        n_in = len(a) - 2  # [layers, *in, r]
        assert a[:1 + n_in] == kernel[:1 + n_in] and a[-1] is None, (path, kernel, a)  # rank: replicated
        assert b[2:] == kernel[1 + n_in:] and b[1] is None, (path, kernel, b)
        assert any(x is not None for x in a + b), path  # actually split on this mesh


def test_dropout_only_in_training():
    cfg = _cfg(lora_dropout=0.5)
    params = _random_adapters(cfg, model.init_params(cfg, jax.random.PRNGKey(0)))
    ids = _tokens()
    plain = np.asarray(model.forward(cfg, params, ids)[0])
    again = np.asarray(model.forward(cfg, params, ids)[0])
    np.testing.assert_array_equal(plain, again)
    d1 = np.asarray(model.forward(cfg, params, ids, dropout_rng=jax.random.PRNGKey(1))[0])
    d2 = np.asarray(model.forward(cfg, params, ids, dropout_rng=jax.random.PRNGKey(2))[0])
    assert not np.allclose(d1, plain) and not np.allclose(d1, d2)
    no_dropout = dataclasses.replace(cfg, lora_dropout=0.0)
    np.testing.assert_array_equal(np.asarray(model.forward(no_dropout, params, ids, dropout_rng=jax.random.PRNGKey(1))[0]),
                                  plain)


@pytest.mark.parametrize("fields,fragment", [
    ({"lora_targets": "nothing"}, "ModelConfig.lora_targets = 'nothing' matches no Linear"),
    ({"lora_targets": "attn/(q"}, "does not compile"),
    ({"lora_rank": -1}, "ModelConfig.lora_rank must be >= 0"),
    ({"lora_dropout": 1.0}, "ModelConfig.lora_dropout = 1.0 must lie in [0, 1)"),
    ({"lora_alpha": 0.0}, "ModelConfig.lora_alpha must be positive"),
    ({"lora_targets": "lm_head", "tie_embeddings": True}, "a tied LM head has no weight of its own"),
])
def test_bad_lora_settings_are_one_line(fields, fragment):
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.build(num_devices=8, model={**LLAMA, "lora_rank": 8, **fields})
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_lora_dropout_refused_under_pipeline():
    with pytest.raises(config_lib.ConfigError, match="lora_dropout = 0.1 is not supported with MeshConfig.pipeline = 2"):
        config_lib.build(num_devices=8, model={**LLAMA, "lora_rank": 8, "lora_dropout": 0.1},
                         mesh={"data": 4, "pipeline": 2}, train={"global_batch": 8, "seq_len": 16, "sample_tokens": 0})
