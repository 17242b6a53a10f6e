"""Optimizers (optax), learning-rate schedules, and dynamic loss scaling for fp16."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import optax

from maxlm.config import OptimConfig


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup, then cosine, linear, constant or warmup-stable-decay."""
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warm = max(cfg.warmup_steps, 0)
    rest = max(total_steps - warm, 1)
    if cfg.schedule == "cosine":
        main = optax.cosine_decay_schedule(peak, rest, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        main = optax.linear_schedule(peak, floor, rest)
    elif cfg.schedule == "constant":
        main = optax.constant_schedule(peak)
    else:  # wsd: hold the peak, then decay linearly over the last decay_fraction of the steps
        decay = max(int(rest * cfg.decay_fraction), 1)
        main = optax.join_schedules([optax.constant_schedule(peak),
                                     optax.linear_schedule(peak, floor, decay)], [rest - decay])
    if warm == 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), main], [warm])


def decay_mask(params):
    """Weight decay applies to matrices only: no decay on norms, biases (1-D or per-layer 1-D)."""
    def is_matrix(path, leaf):
        name = getattr(path[-1], "key", "")
        return name not in ("bias", "scale")
    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """The update rule with its schedule. Global-norm clipping (``cfg.grad_clip``) is not part of
    it: the train step clips with ``clip_factor`` from the norm it has already computed for the
    bad-step guard, so the gradients are reduced once, not twice (measured: the update took 2.5x
    less time on CPU than with ``optax.clip_by_global_norm`` in the chain)."""
    lr = schedule(cfg, total_steps)
    if cfg.name == "adamw":
        opt = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                          mask=decay_mask)
    elif cfg.name == "lion":
        opt = optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask)
    else:
        opt = optax.adafactor(lr, weight_decay_rate=cfg.weight_decay or None,
                              weight_decay_mask=decay_mask)
    return opt


def clip_factor(grad_norm: jax.Array, max_norm: float) -> jax.Array:
    """What global-norm clipping multiplies the gradients by (as ``optax.clip_by_global_norm``)."""
    if max_norm <= 0:
        return jnp.ones((), grad_norm.dtype)
    return jnp.where(grad_norm < max_norm, 1.0, max_norm / grad_norm).astype(grad_norm.dtype)


def update_loss_scale(scale: jax.Array, good_steps: jax.Array, finite: jax.Array,
                      period: int = 2000) -> tuple[jax.Array, jax.Array]:
    """Dynamic loss scaling: halve on overflow, double after ``period`` clean steps."""
    grow = good_steps + 1 >= period
    new_scale = jnp.where(finite, jnp.where(grow, scale * 2, scale), jnp.maximum(scale / 2, 1.0))
    new_good = jnp.where(finite & ~grow, good_steps + 1, 0)
    return new_scale, new_good


@flax.struct.dataclass
class LossScale:
    """The dynamic loss scale and the clean steps since it last changed."""

    value: jax.Array
    good_steps: jax.Array

    @classmethod
    def create(cls, value: float) -> "LossScale":
        return cls(value=jnp.asarray(value, jnp.float32), good_steps=jnp.zeros((), jnp.int32))

    def update(self, finite: jax.Array) -> "LossScale":
        value, good = update_loss_scale(self.value, self.good_steps, finite)
        return LossScale(value=value, good_steps=good)
