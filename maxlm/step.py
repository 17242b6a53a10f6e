"""The pure training step and the state it threads: ``train_step(state, batch) -> (state, metrics)``.

Everything here is side-effect free and jitted once by ``compile_steps`` with explicit in/out
shardings derived from the logical names, the state donated. Data, checkpoints and logging live
outside, in ``train.py``.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxlm import optim, sharding
from maxlm.config import Config
from maxlm.model import Transformer, cross_entropy

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # batches consumed, skipped ones included
    params: Any
    opt_state: Any
    rng: jax.Array
    loss_scale: jax.Array  # dynamic loss scale (1.0 unless the compute dtype is float16)
    good_steps: jax.Array  # consecutive finite steps, for growing the loss scale
    skipped: jax.Array  # updates skipped: non-finite loss or gradient, or a spike
    bad_streak: jax.Array  # consecutive skipped steps (the loop rolls back when it grows too long)
    lr_scale: jax.Array  # multiplies every update; a rollback lowers it
    stats: jax.Array  # rolling [mean, variance] of the loss and of the grad norm, shape [2, 2]


def _init_params(cfg: Config, rng: jax.Array) -> Any:
    dummy = jnp.zeros((1, cfg.train.seq_len), jnp.int32)
    return Transformer(cfg.model).init(rng, dummy)["params"]


def param_names(cfg: Config) -> Any:
    """Tree of logical axis names of every parameter, from shapes alone."""
    boxed = jax.eval_shape(lambda: _init_params(cfg, jax.random.PRNGKey(0)))
    return sharding.logical_specs(boxed)


def _opt_state_names(opt_state: Any, params: Any, names: Any) -> Any:
    """Optimizer moments mirror the parameters: give each the names of the parameter whose path
    ends its own and whose shape it shares; anything else (counts, factored moments) is replicated."""
    by_path = {}
    for (path, leaf), n in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(names)):
        by_path[tuple(str(p) for p in path)] = (leaf.shape, n)

    def lookup(path, leaf):
        keys = tuple(str(p) for p in path)
        for start in range(len(keys)):
            hit = by_path.get(keys[start:])
            if hit and hit[0] == leaf.shape:
                return hit[1]
        return PartitionSpec(*(None,) * len(leaf.shape))
    return jax.tree_util.tree_map_with_path(lookup, opt_state)


def state_shardings(cfg: Config, mesh: Mesh, optimizer: optax.GradientTransformation) -> TrainState:
    """NamedShardings for every leaf of the TrainState (abstract: nothing is allocated)."""
    names = param_names(cfg)
    params = jax.eval_shape(lambda: nn.unbox(_init_params(cfg, jax.random.PRNGKey(0))))
    opt_state = jax.eval_shape(optimizer.init, params)
    replicated = NamedSharding(mesh, PartitionSpec())
    return TrainState(
        step=replicated, params=sharding.mesh_shardings(names, mesh),
        opt_state=sharding.mesh_shardings(_opt_state_names(opt_state, params, names), mesh),
        rng=replicated, loss_scale=replicated, good_steps=replicated, skipped=replicated,
        bad_streak=replicated, lr_scale=replicated, stats=replicated)


def init_state(cfg: Config, optimizer: optax.GradientTransformation, shardings: TrainState,
               params: Any = None) -> TrainState:
    """A fresh state, each array created directly on its shards (no host copy of the model).

    ``params``, when given (e.g. imported weights), replaces the random initialisation."""
    def init(rng, params):
        rng, init_rng = jax.random.split(rng)
        if params is None:
            params = nn.unbox(_init_params(cfg, init_rng))
        fp16 = cfg.model.dtype == "float16"
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=optimizer.init(params), rng=rng,
                          loss_scale=jnp.asarray(cfg.optim.loss_scale if fp16 else 1.0, jnp.float32),
                          good_steps=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32),
                          bad_streak=jnp.zeros((), jnp.int32), lr_scale=jnp.ones((), jnp.float32),
                          stats=jnp.zeros((2, 2), jnp.float32))
    jitted = jax.jit(init, in_shardings=(None, shardings.params if params is not None else None),
                     out_shardings=shardings)
    return jitted(jax.random.PRNGKey(cfg.train.seed), params)


def loss_and_weight(cfg: Config, params: Any, batch: dict[str, jax.Array]):
    logits = Transformer(cfg.model).apply({"params": params}, batch["inputs"],
                                          batch["segment_ids"], batch["positions"])
    return cross_entropy(logits, batch["targets"], batch["weights"], cfg.model.vocab_size,
                         cfg.train.z_loss)


def rolling_stats(cfg: Config, observed: jax.Array, stats: jax.Array, applied: jax.Array) -> jax.Array:
    """Exponential moving [mean, variance] of each observed value over ~spike_window steps."""
    beta = 1.0 - 1.0 / cfg.train.spike_window
    mean, var = stats[:, 0], stats[:, 1]
    delta = observed - mean
    new = jnp.stack([mean + (1 - beta) * delta, beta * (var + (1 - beta) * delta**2)], axis=1)
    first = jnp.stack([observed, jnp.zeros_like(observed)], axis=1)
    return jnp.where(applied == 0, first, new)


def spike_detected(cfg: Config, observed: jax.Array, stats: jax.Array, applied: jax.Array) -> jax.Array:
    """Loss or grad norm above its rolling mean by more than spike_sigmas standard deviations."""
    k = cfg.train.spike_sigmas
    if not k:
        return jnp.zeros((), bool)
    above = observed > stats[:, 0] + k * jnp.sqrt(stats[:, 1])
    return (applied >= cfg.train.spike_warmup) & jnp.any(above)


def make_train_step(cfg: Config, optimizer: optax.GradientTransformation) -> Callable:
    lr_schedule = optim.schedule(cfg.optim, cfg.train.steps)
    micro = cfg.optim.microbatches

    def grads_of(params, batch, scale, total_weight):
        def scaled_loss(p):
            loss_sum, weight = loss_and_weight(cfg, p, batch)
            return loss_sum * scale / total_weight, loss_sum
        return jax.grad(scaled_loss, has_aux=True)(params)

    def train_step(state: TrainState, batch: dict[str, jax.Array]):
        total_weight = jnp.maximum(jnp.sum(batch["weights"]), 1.0)
        scale = state.loss_scale
        if micro == 1:
            grads, loss_sum = grads_of(state.params, batch, scale, total_weight)
        else:
            # Microbatch j takes rows j, j+micro, ...: each stays spread over every data shard.
            def split(x):
                x = x.reshape(x.shape[0] // micro, micro, *x.shape[1:]).swapaxes(0, 1)
                return sharding.constrain(x, (None, "batch", "length"))

            def accumulate(carry, mb):
                g, l = grads_of(state.params, mb, scale, total_weight)
                return jax.tree.map(jnp.add, carry, (g, l)), None
            zeros = (jax.tree.map(jnp.zeros_like, state.params), jnp.zeros((), jnp.float32))
            (grads, loss_sum), _ = jax.lax.scan(accumulate, zeros, jax.tree.map(split, batch))
        grads = jax.tree.map(lambda g: g / scale, grads)
        loss = loss_sum / total_weight
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        applied = state.step - state.skipped
        observed = jnp.stack([loss, grad_norm])
        spike = spike_detected(cfg, observed, state.stats, applied)
        ok = finite & ~spike

        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        updates = jax.tree.map(lambda u: u * state.lr_scale.astype(u.dtype), updates)
        params = optax.apply_updates(state.params, updates)
        # A bad step is skipped, never applied: params and optimizer state stay as they were.
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
        new_scale, good = state.loss_scale, state.good_steps
        if cfg.model.dtype == "float16":
            new_scale, good = optim.update_loss_scale(state.loss_scale, state.good_steps, finite)
        bad = (~ok).astype(jnp.int32)
        new_state = state.replace(
            step=state.step + 1, params=keep(params, state.params),
            opt_state=keep(opt_state, state.opt_state), rng=jax.random.fold_in(state.rng, state.step),
            loss_scale=new_scale, good_steps=good, skipped=state.skipped + bad,
            bad_streak=(state.bad_streak + 1) * bad,
            stats=jnp.where(ok, rolling_stats(cfg, observed, state.stats, applied), state.stats))
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(applied) * state.lr_scale,
                   "skipped": bad, "spike": spike.astype(jnp.int32), "bad_streak": new_state.bad_streak,
                   "loss_scale": state.loss_scale, "tokens": total_weight}
        return new_state, metrics

    return train_step


def compile_steps(cfg: Config, mesh: Mesh, optimizer: optax.GradientTransformation,
                  shardings: TrainState) -> tuple[Callable, Callable]:
    """(train_step, eval_step) jitted with explicit shardings; train_step donates the state."""
    batch_sh = {k: sharding.batch_sharding(mesh) for k in BATCH_KEYS}
    replicated = NamedSharding(mesh, PartitionSpec())
    train = jax.jit(make_train_step(cfg, optimizer), in_shardings=(shardings, batch_sh),
                    out_shardings=(shardings, replicated), donate_argnums=0)
    evaluate = jax.jit(lambda params, batch: loss_and_weight(cfg, params, batch),
                       in_shardings=(shardings.params, batch_sh), out_shardings=replicated)
    return train, evaluate


def device_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This process's rows -> one global array per key, sharded over (data, fsdp)."""
    sh = sharding.batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sh, batch[k]) for k in BATCH_KEYS}
