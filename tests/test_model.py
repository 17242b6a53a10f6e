"""Model properties: closed-form size, causality, document isolation, remat, skipped steps."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lm_loss, random_batch, small_config, train_losses

from maxlm import model
from maxlm.parallel import sharding
from maxlm.train import optim, step, tasks

VARIANTS = {
    "llama_gqa": dict(n_kv_heads=2),
    "llama_tied_bias": dict(tie_embeddings=True, use_bias=True, head_dim=8),
    "gpt": dict(norm="layer", activation="gelu", position="learned", use_bias=True, tie_embeddings=True),
    "gpt_untied": dict(norm="layer", activation="gelu", position="learned", use_bias=True),
}


def init(cfg, seq_len=16):
    return nn.unbox(model.Transformer(cfg.model).init(jax.random.PRNGKey(0), jnp.zeros((1, seq_len), jnp.int32)))["params"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_param_count_matches_closed_form(variant):
    cfg = small_config(model=VARIANTS[variant])
    params = init(cfg)
    assert sum(x.size for x in jax.tree.leaves(params)) == model.param_count(cfg.model)
    # FLOPs use the same count: 6N, N without lookup-only tables.
    assert model.matmul_params(cfg.model) <= model.param_count(cfg.model)


def test_flops_per_token_gpt3():
    """GPT-3 175B: 6N ≈ 1.05e12 FLOPs per token, attention adds 12·L·H·Q·T."""
    from maxlm import config

    cfg = config.load("gpt175b.gin").model
    attention = 12 * 96 * 96 * 128 * 2048
    assert model.flops_per_token(cfg, 2048) - attention == pytest.approx(6 * 174.6e9, rel=2e-3)


@pytest.mark.parametrize("variant", ["llama_gqa", "gpt"])
def test_causal(variant):
    cfg = small_config(model=VARIANTS[variant])
    params = init(cfg)
    ids = np.random.default_rng(0).integers(0, 259, (1, 16))
    changed = ids.copy()
    changed[0, 10:] = (changed[0, 10:] + 1) % 259
    apply = jax.jit(lambda x: model.Transformer(cfg.model).apply({"params": params}, x)[0])
    a, b = apply(ids), apply(changed)
    np.testing.assert_allclose(a[0, :10], b[0, :10], atol=1e-5)
    assert not np.allclose(a[0, 10:], b[0, 10:])


@pytest.mark.parametrize("variant", ["llama_gqa", "gpt"])
def test_packed_documents_do_not_see_each_other(variant):
    """A document packed after another gets the same logits as when it stands alone."""
    cfg = small_config(model=VARIANTS[variant])
    params = init(cfg)
    rng = np.random.default_rng(1)
    doc_a, doc_b = rng.integers(0, 259, 9), rng.integers(0, 259, 7)
    packed = np.concatenate([doc_a, doc_b])[None]
    segments = np.array([[1] * 9 + [2] * 7])
    positions = np.concatenate([np.arange(9), np.arange(7)])[None]
    run = model.Transformer(cfg.model)
    together, _ = run.apply({"params": params}, packed, segments, positions)
    alone, _ = run.apply({"params": params}, doc_b[None])
    np.testing.assert_allclose(together[0, 9:], alone[0], atol=1e-5)


@pytest.mark.parametrize("policy", ["full", "save_dots", "save_named"])
def test_remat_policies_give_the_same_gradients(policy):
    batch = random_batch(np.random.default_rng(0), 2, 16)
    grads = {}
    for remat in ("none", policy):
        cfg = small_config(model=dict(remat=remat), train=dict(seq_len=16))
        params = init(cfg)
        grads[remat] = jax.grad(lambda p: lm_loss(cfg, p, batch)[0])(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads["none"], grads[policy])


def _one_step(cfg, batch):
    mesh = sharding.make_mesh(cfg.mesh.shape(1), jax.devices()[:1])
    opt = optim.make_optimizer(cfg.optim, cfg.train.steps)
    shardings = step.state_shardings(cfg, mesh, opt)
    with jax.set_mesh(mesh):
        state = step.init_state(cfg, opt, shardings)
        before = jax.tree.map(lambda x: np.array(x, copy=True), state)  # the step donates state
        train_step, _ = tasks.lm_steps(cfg, mesh, opt, shardings)
        after, metrics_ = train_step(state, step.device_batch(batch, mesh, tasks.LM_BATCH))
    return before, jax.device_get(after), jax.device_get(metrics_)


@pytest.mark.parametrize("dtype", ["float32"])
def test_non_finite_step_is_skipped_and_counted(dtype):
    cfg = small_config(num_devices=1, mesh=dict(data=1), model=dict(dtype=dtype))
    batch = random_batch(np.random.default_rng(0))
    batch["weights"][0, 3] = np.nan  # a poisoned batch: the loss is NaN
    before, after, m = _one_step(cfg, batch)
    assert int(m["skipped"]) == 1 and int(after.guard.skipped) == 1 and int(after.step) == 1
    jax.tree.map(np.testing.assert_array_equal, before.params, after.params)
    jax.tree.map(np.testing.assert_array_equal, before.opt_state, after.opt_state)
    if dtype == "float16":  # dynamic loss scaling halves the scale on overflow
        assert float(after.loss_scale.value) == float(before.loss_scale.value) / 2


def test_dynamic_loss_scale():
    scale, good = optim.update_loss_scale(jnp.float32(1024.0), jnp.int32(5), jnp.bool_(False))
    assert float(scale) == 512.0 and int(good) == 0
    scale, good = optim.update_loss_scale(jnp.float32(1024.0), jnp.int32(5), jnp.bool_(True))
    assert float(scale) == 1024.0 and int(good) == 6
    scale, good = optim.update_loss_scale(jnp.float32(1024.0), jnp.int32(1999), jnp.bool_(True))
    assert float(scale) == 2048.0 and int(good) == 0


def test_finite_step_is_applied():
    cfg = small_config(num_devices=1, mesh=dict(data=1), optim=dict(warmup_steps=0))  # lr > 0 at step 0
    before, after, m = _one_step(cfg, random_batch(np.random.default_rng(0)))
    assert int(m["skipped"]) == 0 and np.isfinite(m["loss"])
    assert not np.array_equal(before.params["embed"], after.params["embed"])


@pytest.mark.parametrize("name,lr", [("adafactor", 3e-2), ("lion", 3e-3)])
def test_other_optimizers_learn_sharded(name, lr):
    # Adafactor scales its steps by each parameter's RMS (0.02 at init): it takes a larger rate.
    cfg = small_config(mesh=dict(data=2, fsdp=2, tensor=2), optim=dict(name=name, learning_rate=lr))
    losses, _ = train_losses(cfg, jax.devices(), steps=6)
    assert losses[-1] < losses[0] - 0.05


def test_bfloat16_compute_tracks_float32():
    batch = random_batch(np.random.default_rng(0), 2, 16)
    losses = {}
    for dtype in ("float32", "bfloat16"):
        cfg = small_config(model=dict(dtype=dtype), train=dict(seq_len=16))
        loss, weight = lm_loss(cfg, init(cfg), batch)
        losses[dtype] = float(loss / weight)
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=1e-2)


def test_z_loss_adds_log_z_squared():
    logits = jnp.array([[[2.0, 0.0, -1.0]]])
    targets, weights = jnp.array([[0]]), jnp.ones((1, 1))
    plain, _ = model.cross_entropy(logits, targets, weights, vocab_size=3)
    with_z, _ = model.cross_entropy(logits, targets, weights, vocab_size=3, z_loss=1e-2)
    log_z = jax.nn.logsumexp(logits)
    assert float(with_z - plain) == pytest.approx(1e-2 * float(log_z) ** 2, rel=1e-5)


def test_padded_vocabulary_columns_are_ignored():
    logits = jnp.array([[[1.0, 2.0, 50.0]]])  # the third column is padding
    loss, _ = model.cross_entropy(logits, jnp.array([[1]]), jnp.ones((1, 1)), vocab_size=2)
    assert float(loss) == pytest.approx(float(jax.nn.logsumexp(jnp.array([1.0, 2.0])) - 2.0), rel=1e-6)


def test_schedules():
    from maxlm.config import OptimConfig

    for kind in ("cosine", "linear", "constant", "wsd"):
        lr = optim.schedule(OptimConfig(schedule=kind, learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1), 100)
        assert float(lr(0)) == 0.0 and float(lr(10)) == pytest.approx(1.0)
        end = {"constant": 1.0}.get(kind, 0.1)
        assert float(lr(100)) == pytest.approx(end, abs=1e-3)
    wsd = optim.schedule(OptimConfig(schedule="wsd", learning_rate=1.0, warmup_steps=10, decay_fraction=0.2), 100)
    assert float(wsd(80)) == pytest.approx(1.0) and float(wsd(90)) < 1.0


def test_weight_decay_mask_spares_norms_and_biases():
    cfg = small_config(model=VARIANTS["gpt"])
    mask = optim.decay_mask(init(cfg))
    assert mask["layers"]["attn"]["q_proj"]["kernel"] and not mask["layers"]["attn"]["q_proj"]["bias"]
    assert not mask["final_norm"]["scale"] and mask["embed"]
