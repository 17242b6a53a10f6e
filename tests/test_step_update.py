"""The train step's update (clipping with the guard's norm, inside a cond) equals optax's own chain."""

import jax
import numpy as np
import optax
import pytest

from maxlm.parallel import sharding
from maxlm.train import optim, step, tasks
from tests.helpers import random_batch, small_config


@pytest.mark.parametrize("grad_clip", [0.05, 0.0], ids=["clipped", "off"])
def test_one_step_matches_optax_clip_by_global_norm_then_adamw(grad_clip):
    # eps near the gradients' size makes Adam's step depend on their scale, so clipping shows
    # (with eps -> 0 the first step is ~lr * sign(g) whatever the clipping), and keeps a gradient
    # near zero from turning rounding into a visible difference.
    cfg = small_config(num_devices=1, optim=dict(grad_clip=grad_clip, warmup_steps=0, schedule="constant",
                                                 eps=1e-3))
    mesh = sharding.make_mesh(cfg.mesh.shape(1), jax.devices()[:1])
    optimizer = optim.make_optimizer(cfg.optim, cfg.train.steps)
    shardings = step.state_shardings(cfg, mesh, optimizer)
    batch = random_batch(np.random.default_rng(0), cfg.train.global_batch, cfg.train.seq_len)
    with jax.set_mesh(mesh):
        state = step.init_state(cfg, optimizer, shardings)
        params = jax.device_get(state.params)
        train_step, _ = tasks.lm_steps(cfg, mesh, optimizer, shardings)
        new_state, metrics = train_step(state, step.device_batch(batch, mesh, tasks.LM_BATCH))

    # The reference: the mean loss's gradients through optax's clip_by_global_norm and AdamW.
    loss_fn = tasks.lm_loss(step.model_forward(cfg, mesh), cfg.model.vocab_size)

    def mean_loss(p):
        loss_sum, weight, _ = loss_fn(p, batch, None)
        return loss_sum / weight
    with jax.set_mesh(mesh):
        grads = jax.grad(mean_loss)(params)
    o = cfg.optim
    chain = [optax.clip_by_global_norm(grad_clip)] if grad_clip else []
    reference = optax.chain(*chain, optax.adamw(o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps,
                                                weight_decay=o.weight_decay, mask=optim.decay_mask))
    updates, _ = reference.update(grads, reference.init(params), params)
    expected = optax.apply_updates(params, updates)

    norm = float(optax.tree.norm(grads))
    assert float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-5)
    if grad_clip == 0.05:
        assert norm > grad_clip  # the case really clips
    for got, want in zip(jax.tree.leaves(jax.device_get(new_state.params)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * cfg.optim.learning_rate)


def test_clip_factor_is_optax_scale():
    grads = {"a": np.full((3,), 2.0, np.float32), "b": np.full((4,), -1.0, np.float32)}
    norm = optax.tree.norm(grads)
    clipped, _ = optax.clip_by_global_norm(1.5).update(grads, optax.EmptyState())
    factor = optim.clip_factor(norm, 1.5)
    for got, want in zip(jax.tree.leaves(jax.tree.map(lambda g: g * factor, grads)), jax.tree.leaves(clipped)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert float(optim.clip_factor(norm, 0.0)) == 1.0 and float(optim.clip_factor(norm, 1e9)) == 1.0
