"""The pure training step, for any task: ``train_step(state, batch) -> (state, metrics)``.

A task supplies ``loss_fn(params, batch, rng) -> (loss_sum, weight, aux)`` (``maxlm.train.tasks``;
rng is None in evaluation);
this module turns it into one jitted update with explicit in/out shardings and the state donated.
What every task shares lives here once: microbatch accumulation, dynamic loss scaling, the bad-step
guard (``maxlm.train.resilience``), global-norm clipping, and a trainable mask: frozen
parameters are not differentiated, have no optimizer state and never change.

Host offload (``OptimConfig.offload_state``, ``OptimConfig.offload_params``): ``state_shardings``
gives the optimizer state (and the parameters) the ``pinned_host`` memory kind, so between steps
they live in host memory; the jitted step takes and returns them there (its in/out shardings), and
inside it copies them to the device where they are used and back when they are updated
(``sharding.move``), copies XLA schedules around the computation. The numbers are the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxlm import model
from maxlm.config import Config
from maxlm.model import lora
from maxlm.parallel import pipeline_parallel, sharding
from maxlm.train import optim, resilience

LossFn = Callable[[Any, dict[str, jax.Array], jax.Array], tuple[jax.Array, jax.Array, dict[str, jax.Array]]]


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # batches consumed, skipped ones included
    params: Any  # the whole model, frozen parts included
    opt_state: Any  # for the trainable parameters only
    loss_scale: optim.LossScale  # dynamic loss scale (1.0 unless the compute dtype is float16)
    guard: resilience.Guard  # the bad-step guard's counters and statistics


# A task's own parameters (``TaskParams``) sit beside the model's in ``TrainState.params`` under
# this key: trained, checkpointed and restored with them. The model's forward ignores the key.
TASK_PARAMS = "task"


@dataclasses.dataclass(frozen=True)
class TaskParams:
    """Parameters a task trains beside the model (distillation's feature projections): ``init(rng)``
    makes the tree, ``names`` gives each leaf's logical axes (a PartitionSpec of names, as the
    model's ``param_names``). A warm start never carries them: they start fresh (``init_state``)."""

    init: Callable[[jax.Array], Any]
    names: Any


def model_part(params: Any) -> Any:
    """``params`` (or a tree shaped like them) without the task's own parameters."""
    return {k: v for k, v in params.items() if k != TASK_PARAMS}


def model_forward(cfg: Config, mesh: Mesh) -> Callable:
    """``forward(params, tokens, segment_ids, positions, cache, dropout_rng)`` for this mesh: the
    layer stack runs as a pipeline when the mesh has a pipeline axis, as a scan otherwise. A
    ``dropout_rng`` (a training step's; evaluation passes None) reaches the model only when it has
    dropout (LoRA's)."""
    stack = pipeline_parallel.layer_stack(cfg.mesh, mesh.shape["pipeline"])
    has_dropout = bool(cfg.model.lora_rank and cfg.model.lora_dropout)

    def forward(params, tokens, segment_ids=None, positions=None, cache=None, dropout_rng=None):
        return model.forward(cfg.model, params, tokens, segment_ids, positions, cache, stack=stack,
                             dropout_rng=dropout_rng if has_dropout else None)
    return forward


# ---- the trainable mask: a tree of bools like the params; None marks the other part's leaves


def split(params: Any, mask: Any) -> tuple[Any, Any]:
    """(trainable, frozen): each the params tree with the other part's leaves set to None."""
    trainable = jax.tree.map(lambda p, m: p if m else None, params, mask)
    frozen = jax.tree.map(lambda p, m: None if m else p, params, mask)
    return trainable, frozen


def merge(trainable: Any, frozen: Any) -> Any:
    return jax.tree.map(lambda t, f: f if t is None else t, trainable, frozen, is_leaf=lambda x: x is None)


def trainable_mask(params: Any, trainable: Callable[[Any], Any] | None) -> Any:
    """The task's mask over ``params`` (all True without one). A task's own parameters
    (``TASK_PARAMS``) always train, whatever the mask says of the model's (LoRA's, say)."""
    if trainable is None:
        return jax.tree.map(lambda _: True, params)
    mask = trainable(params)
    if isinstance(params, dict) and TASK_PARAMS in params:
        mask = {**mask, TASK_PARAMS: jax.tree.map(lambda _: True, params[TASK_PARAMS])}
    return mask


# ---- shardings and the initial state


def param_names(cfg: Config) -> Any:
    """Tree of logical axis names of every parameter, from shapes alone."""
    return sharding.logical_specs(model.abstract_params(cfg.model, boxed=True))


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


def state_shardings(cfg: Config, mesh: Mesh, optimizer: optax.GradientTransformation,
                    trainable: Callable[[Any], Any] | None = None,
                    task_params: TaskParams | None = None) -> TrainState:
    """NamedShardings for every leaf of the TrainState (abstract: nothing is allocated); with
    host offload the optimizer state's (``OptimConfig.offload_state``) and the parameters'
    (``OptimConfig.offload_params``) are in ``pinned_host`` memory."""
    names = param_names(cfg)
    params = model.abstract_params(cfg.model)
    if task_params is not None:
        names = {**names, TASK_PARAMS: task_params.names}
        params = {**params, TASK_PARAMS: jax.eval_shape(task_params.init, jax.random.PRNGKey(0))}
    train_params, _ = split(params, trainable_mask(params, trainable))
    opt_state = jax.eval_shape(optimizer.init, train_params)
    train_names, _ = split(names, trainable_mask(params, trainable))
    replicated = NamedSharding(mesh, PartitionSpec())
    host = lambda offload: sharding.HOST if offload else None
    opt_names = _opt_state_names(opt_state, train_params, train_names)
    return TrainState(
        step=replicated,
        params=sharding.in_memory(sharding.mesh_shardings(names, mesh), host(cfg.optim.offload_params)),
        opt_state=sharding.in_memory(sharding.mesh_shardings(opt_names, mesh), host(cfg.optim.offload_state)),
        loss_scale=jax.tree.map(lambda _: replicated, optim.LossScale.create(1.0)),
        guard=jax.tree.map(lambda _: replicated, resilience.Guard.create()))


def init_state(cfg: Config, optimizer: optax.GradientTransformation, shardings: TrainState,
               params: Any = None, trainable: Callable[[Any], Any] | None = None,
               task_params: TaskParams | None = None) -> TrainState:
    """A fresh state, each array created directly on its shards (no host copy of the model).

    ``params``, when given (e.g. imported weights), replaces the random initialisation; a base
    without the model's LoRA adapters gets fresh ones (``maxlm.model.lora``), and given ones
    without the task's own parameters (``task_params``) get fresh ones too."""
    fresh_task = task_params is not None and (params is None or TASK_PARAMS not in params)
    base_only = params is not None and cfg.model.lora_rank and not lora.adapters(params)

    def init(rng, params):
        if params is not None:  # given in host memory when offloaded: computed with on the device
            params = sharding.move(params, given, sharding.DEVICE)
        if params is None or base_only:
            fresh = model.init_params(cfg.model, jax.random.split(rng)[1])
            params = fresh if params is None else lora.with_base(fresh, params)
        if fresh_task:  # from the half of the key the model's initialisation leaves unused
            params = {**params, TASK_PARAMS: task_params.init(jax.random.split(rng)[0])}
        train_params, _ = split(params, trainable_mask(params, trainable))
        fp16 = cfg.model.dtype == "float16"
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=optimizer.init(train_params),
                           loss_scale=optim.LossScale.create(cfg.optim.loss_scale if fp16 else 1.0),
                           guard=resilience.Guard.create())
        return sharding.move(state, shardings, sharding.HOST)  # offloaded parts straight to the host
    given = lora.without_adapters(shardings.params) if base_only else shardings.params
    given = model_part(given) if fresh_task else given
    jitted = jax.jit(init, in_shardings=(None, given if params is not None else None),
                     out_shardings=shardings)
    return jitted(jax.random.PRNGKey(cfg.train.seed), params)


def device_params(params: Any, shardings: TrainState) -> Any:
    """The state's parameters in device memory (a copy if offloaded, else themselves), for code
    outside the step that computes with them (sampling, evaluation tasks)."""
    return sharding.move(params, shardings.params, sharding.DEVICE)


# ---- the step


def _accumulate(loss_fn: LossFn, trainable: Any, frozen: Any, batch: dict, rng: jax.Array,
                scale: jax.Array, total_weight: jax.Array, micro: int, batch_spec: dict):
    """Gradients of the weighted-mean loss w.r.t. the trainable params, summed over microbatches,
    with the summed loss and aux metrics. Microbatch j takes rows j, j+micro, ... (each stays
    spread over every data shard)."""
    def grads_of(mb, key):
        def scaled(t):
            loss_sum, _, aux = loss_fn(merge(t, frozen), mb, key)
            return loss_sum * scale / total_weight, (loss_sum, aux)
        return jax.grad(scaled, has_aux=True)(trainable)

    if micro == 1:
        return grads_of(batch, rng)

    def split_rows(key, x):
        x = x.reshape(x.shape[0] // micro, micro, *x.shape[1:]).swapaxes(0, 1)
        return sharding.constrain(x, (None, *batch_spec[key]))
    micro_batches = {k: split_rows(k, v) for k, v in batch.items()}

    def body(carry, xs):
        mb, key = xs
        g, (l, aux) = grads_of(mb, key)
        return jax.tree.map(jnp.add, carry, (g, (l, aux))), None
    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grads_of, jax.tree.map(lambda x: x[0], micro_batches), rng))
    (grads, out), _ = jax.lax.scan(body, zeros, (micro_batches, jax.random.split(rng, micro)))
    return grads, out


def make_train_step(cfg: Config, optimizer: optax.GradientTransformation, loss_fn: LossFn,
                    batch_spec: dict[str, tuple[str, ...]], trainable: Callable[[Any], Any] | None = None,
                    weight_key: str = "weights", shardings: TrainState | None = None) -> Callable:
    """``train_step(state, batch)`` for a task's ``loss_fn``. The loss is normalised by the
    batch's total weight (``batch[weight_key]`` summed, e.g. the loss-bearing tokens).

    ``shardings`` (``state_shardings``'), when any of them is in host memory: the step copies
    those parts of the state to the device at its start and the new ones back at its end."""
    lr_schedule = optim.schedule(cfg.optim, cfg.train.steps)
    seed_key = jax.random.PRNGKey(cfg.train.seed)

    def train_step(state: TrainState, batch: dict[str, jax.Array]):
        if shardings is None:
            return device_step(state, batch)
        # Host offload: the step uses the state on the device and returns it to the host.
        new_state, metrics = device_step(sharding.move(state, shardings, sharding.DEVICE), batch)
        return sharding.move(new_state, shardings, sharding.HOST), metrics

    def device_step(state: TrainState, batch: dict[str, jax.Array]):
        mask = trainable_mask(state.params, trainable)
        train_params, frozen = split(state.params, mask)
        total_weight = jnp.maximum(jnp.sum(batch[weight_key]), 1.0)
        rng = jax.random.fold_in(seed_key, state.step)  # a function of the step: exact on resume
        grads, (loss_sum, aux) = _accumulate(loss_fn, train_params, frozen, batch, rng, state.loss_scale.value,
                                             total_weight, cfg.optim.microbatches, batch_spec)
        grads = jax.tree.map(lambda g: g / state.loss_scale.value, grads)
        loss = loss_sum / total_weight
        grad_norm = optax.tree.norm(grads)
        ok, finite, spike, guard = resilience.judge(cfg.train, state.guard, state.step, loss, grad_norm)

        clip = optim.clip_factor(grad_norm, cfg.optim.grad_clip)

        def apply(params, opt_state):
            # Clipping, the update, the learning-rate scale and the step are elementwise given
            # two scalars, so XLA fuses them into the update's pass over each parameter.
            clipped = jax.tree.map(lambda g: g * clip.astype(g.dtype), grads)
            updates, opt_state = optimizer.update(clipped, opt_state, params)
            updates = jax.tree.map(lambda u: u * guard.lr_scale.astype(u.dtype), updates)
            return optax.apply_updates(params, updates), opt_state

        # A bad step is skipped, never applied: params and optimizer state stay as they were. A
        # cond, not a where per leaf: the update runs only when applied, and no extra pass selects
        # between old and new (with clipping outside the optimizer: ~2.5x faster update on CPU).
        new_train, opt_state = jax.lax.cond(ok, apply, lambda p, s: (p, s), train_params, state.opt_state)
        loss_scale = state.loss_scale.update(finite) if cfg.model.dtype == "float16" else state.loss_scale
        new_state = state.replace(step=state.step + 1, params=merge(new_train, frozen),
                                  opt_state=opt_state, loss_scale=loss_scale, guard=guard)
        applied = state.step - state.guard.skipped
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(applied) * state.guard.lr_scale,
                   "skipped": (~ok).astype(jnp.int32), "spike": spike.astype(jnp.int32),
                   "bad_streak": guard.bad_streak, "loss_scale": state.loss_scale.value,
                   "tokens": total_weight, **{k: v / total_weight for k, v in aux.items()}}
        return new_state, metrics

    return train_step


def compile_steps(cfg: Config, mesh: Mesh, optimizer: optax.GradientTransformation, shardings: TrainState,
                  loss_fn: LossFn, batch_spec: dict[str, tuple[str, ...]],
                  trainable: Callable[[Any], Any] | None = None,
                  weight_key: str = "weights") -> tuple[Callable, Callable]:
    """(train_step, eval_step) jitted with explicit shardings; train_step donates the state.
    ``eval_step(params, batch) -> (loss_sum, weight)``; ``weight_key`` as ``make_train_step``'s.
    Parts of the state in host memory (``shardings``' memory kinds) stay there between calls."""
    batch_sh = batch_shardings(batch_spec, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    train = jax.jit(make_train_step(cfg, optimizer, loss_fn, batch_spec, trainable, weight_key, shardings),
                    in_shardings=(shardings, batch_sh), out_shardings=(shardings, replicated), donate_argnums=0)

    def evaluate(params, batch):  # no rng: deterministic
        return loss_fn(sharding.move(params, shardings.params, sharding.DEVICE), batch, None)[:2]
    evaluate = jax.jit(evaluate, in_shardings=(shardings.params, batch_sh), out_shardings=replicated)
    return train, evaluate


def batch_shardings(batch_spec: dict[str, tuple[str, ...]], mesh: Mesh) -> dict[str, NamedSharding]:
    return {k: NamedSharding(mesh, sharding.logical_to_spec(names)) for k, names in batch_spec.items()}


def device_batch(batch: dict[str, np.ndarray], mesh: Mesh, batch_spec: dict[str, tuple[str, ...]]) -> dict[str, jax.Array]:
    """This process's rows -> one global array per key, sharded by the batch spec."""
    shardings = batch_shardings(batch_spec, mesh)
    return {k: jax.make_array_from_process_local_data(shardings[k], batch[k]) for k in batch_spec}
