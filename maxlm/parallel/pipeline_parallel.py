"""Pipeline parallelism over the ``pipeline`` mesh axis: GPipe, optionally circular, as pure SPMD.

Nothing about the parameters changes. The stacked layer weights are the same tree the plain scan
uses, ``W[L_{pipeline}, ...]`` (the rules table already splits ``layers`` over ``pipeline``);
pipelining is only another way of executing them. With S stages, R circular repeats and
K = L / (S R) layers per stage and repeat, layer ``l = (r S + s) K + k`` runs on stage s in
repeat r: a microbatch passes through the stages in layer order, R times round the ring.
Each step views the weights as ``W[S_{pipeline}, R, K, ...]``. With R = 1 that is a free reshape
of the stored blocks; with R > 1 the stored contiguous blocks are not the round-robin ones, so each
group of K layers moves once per step to its stage (ppermutes, ``_round_robin``) and its gradient
moves back the same way.

The batch is split into M microbatches (microbatch j takes rows j, j + M, ..., so each stays spread
over the data and fsdp shards) held in one buffer ``buf[S_{pipeline}, M', b, T, D]``. Every stage
keeps its own copy, but only stage 0's is read: it holds the microbatches not yet started, then each
one's output after every pass round the ring, and at the end the results. M' = M, except that a
circular pipeline needs M' >= S slots (a microbatch must leave the ring before it re-enters), so
with M < S it runs S slots of which S - M are idle.

One loop of N = R M' + S - 1 iterations; at iteration t, work item i = t - s sits on stage s
(microbatch slot i mod M', repeat i div M'; items outside [0, R M') are bubbles)::

    recv    = roll(out, 1, stage axis)        # stage s receives stage s-1's output: collective-permute
    buf[:, (t - S) mod M'] = recv             # stage 0 files the item that left the ring (if t >= S)
    in[s]   = buf[0, t mod M'] if s == 0 else recv[s]
    out     = vmap over stages(scan over the stage's K layers of Block)(W[s, repeat], in[s])

``vmap(..., spmd_axis_name=pipeline)`` keeps the stage axis on the ``pipeline`` mesh axis through
every sharding constraint inside Block, so data, fsdp and tensor shard each stage exactly as they
shard the unpipelined model, and ``ModelConfig.remat`` applies per layer as in the plain scan. The
``roll`` of a stage-sharded array is the one collective-permute of the loop (activations, one
microbatch per stage per iteration); filing and reading ``buf`` are local. After the loop one more
roll delivers the last output, and stage 0's buffer is broadcast to the other stages, where the
final norm, the output head and the loss run replicated over ``pipeline`` (as the embedding does).
Idle stage-iterations compute on stale data that never reaches the output; their fraction is
``bubble_fraction``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxlm.config import MeshConfig, ModelConfig
from maxlm.parallel import sharding
from maxlm.rules import RULES

STAGE = "layers"  # the logical name of the stage axis: a stage is a group of layers


def stage_axis() -> str | None:
    """The mesh axis that stages are split over: wherever the rules table sends ``layers``."""
    target = RULES.get(STAGE)
    return target if isinstance(target, str) else None


def degree() -> int:
    """The pipeline degree of the mesh being traced under (1 with no mesh)."""
    mesh, axis = jax.sharding.get_abstract_mesh(), stage_axis()
    if mesh.empty or axis is None or axis not in mesh.axis_names:
        return 1
    return int(mesh.shape[axis])


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The loop's arithmetic: S stages, R repeats, M microbatches, K layers per stage and repeat."""

    stages: int
    repeats: int
    microbatches: int
    layers_per_stage: int = 1

    @property
    def slots(self) -> int:
        """Microbatch slots: a circular pipeline needs at least one per stage."""
        return self.microbatches if self.repeats == 1 else max(self.microbatches, self.stages)

    @property
    def iterations(self) -> int:
        return self.repeats * self.slots + self.stages - 1

    @property
    def bubble(self) -> float:
        """Idle fraction of all stage-iterations."""
        return 1.0 - self.repeats * self.microbatches / self.iterations


def bubble_fraction(degree: int, microbatches: int, repeats: int = 1) -> float:
    """GPipe's idle fraction, (degree - 1) / (repeats * microbatches + degree - 1).

    A circular pipeline (repeats > 1) with fewer microbatches than stages runs ``degree`` slots,
    so its bubble is larger than the formula's: 1 - repeats * microbatches / (repeats * degree +
    degree - 1)."""
    return Schedule(degree, repeats, microbatches).bubble


def check(n_layers: int, degree: int, repeats: int) -> int:
    """Layers per stage and repeat; a ValueError (one line naming the values) if they don't divide."""
    if repeats < 1 or n_layers % (degree * repeats):
        raise ValueError(f"ModelConfig.n_layers = {n_layers} is not divisible by MeshConfig.pipeline * "
                         f"MeshConfig.pipeline_repeats = {degree}*{repeats} = {degree * repeats}")
    return n_layers // (degree * repeats)


def layer_stack(mesh_cfg: MeshConfig, degree: int) -> Callable | None:
    """The model's layer-stack runner for a mesh: this pipeline when ``degree`` > 1, else None
    (the model's own scan). The step builder injects it into the model."""
    if degree <= 1:
        return None
    return functools.partial(run, microbatches=mesh_cfg.pipeline_microbatches,
                             repeats=mesh_cfg.pipeline_repeats)


def _layer_names(block: type[nn.Module], cfg: ModelConfig, x: jax.Array, ctx: Any) -> Any:
    """Logical axis names of one layer's parameters (a tree like the layer's params)."""
    row = lambda a: jax.ShapeDtypeStruct((1,) + a.shape[1:], a.dtype)
    boxed = jax.eval_shape(lambda a, c: block(cfg, parent=None).init(jax.random.PRNGKey(0), a, c),
                           row(x), jax.tree.map(row, ctx))["params"]
    return sharding.logical_specs(boxed)


def _round_robin(w: jax.Array, sched: Schedule, axis: str) -> jax.Array:
    """Stacked weights W[L_{pipeline}, ...] (stage d stores layer groups dR .. dR+R-1 of K layers)
    -> W[S_{pipeline}, R, K, ...] (stage s runs groups s, S+s, 2S+s, ...).

    With one repeat this is a reshape. With more, each stored group g goes to stage g mod S,
    slot g div S: one ppermute per (chunk, slot), each a partial permutation of the stages, so
    every device sends and receives exactly its own share, and autodiff sends the gradients
    back the same way (inverse ppermutes). Left to itself, XLA gathers every layer's gradient on
    every stage to undo the reshape."""
    s, r, k = sched.stages, sched.repeats, sched.layers_per_stage
    if r == 1:
        return w.reshape(s, 1, k, *w.shape[1:])

    def local(block):  # this stage's stored block [R K, ...] -> its round-robin groups [1, R, K, ...]
        chunks = block.reshape(r, k, *block.shape[1:])
        slots = [jnp.zeros_like(chunks[0]) for _ in range(r)]
        for chunk in range(r):
            for slot in range(r):
                pairs = [(d, (d * r + chunk) % s) for d in range(s) if (d * r + chunk) // s == slot]
                if pairs:  # stages that receive nothing from this one get zeros
                    slots[slot] = slots[slot] + jax.lax.ppermute(chunks[chunk], axis, pairs)
        return jnp.stack(slots)[None]
    spec = jax.sharding.PartitionSpec(axis)
    return jax.shard_map(local, in_specs=spec, out_specs=spec, axis_names={axis})(w)


def run(block: type[nn.Module], cfg: ModelConfig, params: Any, x: jax.Array, ctx: Any, layer_cache: Any,
        *, microbatches: int, repeats: int) -> tuple[jax.Array, None]:
    """The layer stack ``x[B, T, D] -> x[B, T, D]`` pipelined over the mesh's ``pipeline`` axis.

    The model's ``LayerStack`` signature: ``block`` is the layer class (``Block``, or
    ``nn.remat(Block, ...)``); ``params`` the stacked layer parameters exactly as the plain
    ``nn.scan`` stores them (leaves ``[L, ...]``); ``ctx`` the layers' ``LayerContext``. A batch
    that ``microbatches`` does not divide (e.g. one row when sampling) runs gcd(batch,
    microbatches) microbatches: same result, larger bubble. There is no pipelined KV cache:
    generation runs on a mesh without a pipeline axis."""
    if layer_cache is not None or ctx.keys is not None:
        raise ValueError("pipeline parallelism runs the training forward only; generate with a KV cache "
                         "on a mesh without a pipeline axis (MeshConfig.pipeline = 1)")
    stages, axis = degree(), stage_axis()
    per_stage = check(cfg.n_layers, stages, repeats)
    batch = x.shape[0]
    sched = Schedule(stages, repeats, math.gcd(batch, microbatches), per_stage)
    micro, slots = sched.microbatches, sched.slots
    params = nn.unbox(params)
    names = _layer_names(block, cfg, x, ctx)
    segment_ids, positions = ctx.queries.segments, ctx.queries.positions

    # W[L, ...] -> W[S, R, K, ...] with layer (r S + s) K + k at [s, r, k]; other dims keep their rules.
    def to_stages(w, layer_names):
        w = _round_robin(w, sched, axis)
        return sharding.constrain(w, (STAGE, None, None, *layer_names))
    weights = jax.tree.map(to_stages, params, names)

    # [B, ...] -> [M', B/M, ...]: microbatch j takes rows j, j+M, ...; slots past M are idle (zeros).
    def split(a):
        a = a.reshape(batch // micro, micro, *a.shape[1:]).swapaxes(0, 1)
        if slots > micro:
            a = jnp.concatenate([a, jnp.zeros((slots - micro,) + a.shape[1:], a.dtype)])
        return a
    act = (STAGE, "batch", "length", "act_embed")  # one microbatch per stage
    row_names = (STAGE, "batch", "length")
    segs, poss = split(segment_ids), split(positions)
    buf = jnp.broadcast_to(split(x)[None], (stages, slots, batch // micro) + x.shape[1:])
    buf = sharding.constrain(buf, (STAGE, None, "batch", "length", "act_embed"))
    stage_ids = jnp.arange(stages)

    def one_layer(h, layer_params, seg, pos):
        layer_ctx = ctx.replace(queries=ctx.queries.replace(positions=pos, segments=seg))
        h, _ = block(cfg, parent=None).apply({"params": layer_params}, h, layer_ctx)
        return h

    def stage_fn(stage_weights, h, seg, pos):  # one stage: its K layers in order
        h, _ = jax.lax.scan(lambda h, w: (one_layer(h, w, seg, pos), None), h, stage_weights)
        return h
    stages_fn = jax.vmap(stage_fn, spmd_axis_name=axis)

    def file_output(buf, recv, t):
        """Stage 0 files the item that left the ring at iteration t - 1 (item t - S)."""
        slot = (t - stages) % slots
        old = jax.lax.dynamic_index_in_dim(buf, slot, axis=1)
        new = jnp.where(t >= stages, recv[:, None], old)
        return jax.lax.dynamic_update_index_in_dim(buf, new, slot, axis=1)

    def stage_weights_at(t):
        if repeats == 1:
            return jax.tree.map(lambda w: w[:, 0], weights)
        rep = jnp.clip((t - stage_ids) // slots, 0, repeats - 1)  # each stage's current repeat
        pick = jax.vmap(lambda w, r: jax.lax.dynamic_index_in_dim(w, r, axis=0, keepdims=False),
                        spmd_axis_name=axis)
        return jax.tree.map(lambda w, n: sharding.constrain(pick(w, rep), (STAGE, None, *n)),
                            weights, names)

    def shift(out):
        return sharding.constrain(jnp.roll(out, 1, axis=0), act)

    def iteration(carry, t):
        out, buf = carry
        recv = shift(out)
        buf = file_output(buf, recv, t)
        fresh = jax.lax.dynamic_index_in_dim(buf, t % slots, axis=1, keepdims=False)
        inputs = sharding.constrain(
            jnp.where((stage_ids == 0)[:, None, None, None], fresh, recv), act)
        slot = (t - stage_ids) % slots  # the microbatch slot each stage works on
        seg = sharding.constrain(jnp.take(segs, slot, axis=0), row_names)
        pos = sharding.constrain(jnp.take(poss, slot, axis=0), row_names)
        out = sharding.constrain(stages_fn(stage_weights_at(t), inputs, seg, pos), act)
        return (out, buf), None

    out = sharding.constrain(jnp.zeros((stages,) + buf.shape[2:], x.dtype), act)
    (out, buf), _ = jax.lax.scan(iteration, (out, buf), jnp.arange(sched.iterations))
    buf = file_output(buf, shift(out), sched.iterations)
    # Stage 0's buffer holds the results: [M, B/M, T, D] -> [B, T, D], replicated over stages.
    y = buf[0, :micro].swapaxes(0, 1).reshape(x.shape)
    return sharding.constrain(y, ("batch", "length", "act_embed")), None
