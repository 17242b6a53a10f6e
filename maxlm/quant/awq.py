"""AWQ (Lin et al., 2023): activation-aware scaling, then round-to-nearest with searched clipping.

Inputs with large activations matter most, so before rounding each input row k of W is scaled up
by s_k and the input divided by s_k: x W = (x / s) (s W) exactly in real arithmetic, while the
rounding error of the important rows shrinks relative to them. ``search_scale`` tries
s = mean|x|^alpha (normalised by sqrt(max s * min s)) over a grid of alpha in [0, 1) and keeps the
alpha whose quantized outputs on calibration inputs are closest to the dense ones; alpha = 0 is
plain RTN, so the search never does worse than RTN on its sample. Linears that read the same input
(q/k/v, gate/up) share one s. ``clip_scales`` then shrinks each group's scale (max|w| times a
ratio in (0.5, 1]) where that lowers the group's output error, as AutoAWQ's ``auto_clip``.

Where s goes: it is folded into the op that produces the input, so the model code runs unchanged
and the fold is exact up to float rounding: the RMSNorm/LayerNorm scale (and bias) before q/k/v and
before gate/up, the up projection's output columns before down_proj (SwiGLU only: silu(g) * (u / s)
is linear in u; GELU is not, so that Linear is not scaled), and the v projection's output columns
before o_proj when every query head has its own kv head (with grouped-query attention one v head
feeds several o_proj rows, which would need tied scales; o_proj is then not scaled).
``maxlm.quant.apply`` performs the folds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from maxlm.quant.rtn import fake_quant, group_scales

GRID = 20  # alphas 0, 0.05, ..., 0.95 (AutoAWQ's n_grid)
CLIP_GRID = 20  # clip ratios 1, 0.95, ..., 0.55
CLIP_TOKENS = 512  # calibration rows the clip search looks at (AutoAWQ's n_sample_token)
CLIP_COLUMNS = 1024  # output columns searched at once (bounds the search's memory)


def _dot(a, b):
    return jnp.dot(a, b, precision=lax.Precision.HIGHEST)


def candidates(mean_abs: jax.Array, grid: int = GRID) -> jax.Array:
    """[grid, K] candidate scales, one row per alpha = i / grid."""
    alphas = jnp.arange(grid, dtype=jnp.float32) / grid
    s = jnp.maximum(mean_abs.astype(jnp.float32), 1e-4)[None, :] ** alphas[:, None]
    return s / jnp.sqrt(jnp.max(s, axis=1, keepdims=True) * jnp.min(s, axis=1, keepdims=True))


@functools.partial(jax.jit, static_argnames=("impl", "group", "grid"))
def _scale_losses(x, mean_abs, weights, impl: str, group: int, grid: int):
    x = x.astype(jnp.float32)
    refs = [_dot(x, w.astype(jnp.float32)) for w in weights]

    def loss(s):
        total = jnp.float32(0)
        for w, ref in zip(weights, refs):
            wq = fake_quant(w.astype(jnp.float32) * s[:, None], impl, group)
            total = total + jnp.sum(jnp.square(_dot(x / s, wq) - ref))
        return total
    return lax.map(loss, candidates(mean_abs, grid))


def search_scale(x: jax.Array, mean_abs: jax.Array, weights: list[jax.Array], impl: str, group: int,
                 grid: int = GRID) -> tuple[jax.Array, float, float, float]:
    """The per-input scale s [K] shared by ``weights`` (each [K, N_i], all reading inputs x
    [S, K] whose mean |x| per channel is ``mean_abs``): (s, best alpha, RTN's loss, best loss)."""
    losses = _scale_losses(x, mean_abs, tuple(weights), impl, group, grid)
    best = int(jnp.argmin(losses))
    return candidates(mean_abs, grid)[best], best / grid, float(losses[0]), float(losses[best])


@functools.partial(jax.jit, static_argnames=("impl", "group", "grid"))
def _clip(x, w, impl: str, group: int, grid: int):
    k, n = w.shape
    xg = x.astype(jnp.float32).reshape(x.shape[0], k // group, group)
    wg = w.astype(jnp.float32).reshape(k // group, group, n)
    ratios = 1.0 - jnp.arange(grid // 2, dtype=jnp.float32) / grid

    def err(ratio):  # [groups, n]: each group's own contribution to the output error
        d = wg - fake_quant(w, impl, group, ratio).reshape(k // group, group, n)
        return jnp.sum(jnp.square(jnp.einsum("sGg,Ggn->sGn", xg, d, precision=lax.Precision.HIGHEST)), axis=0)
    errs = lax.map(err, ratios)  # [ratios, groups, n]
    return group_scales(w, impl, group, ratios[jnp.argmin(errs, axis=0)])


def clip_scales(x: jax.Array, w: jax.Array, impl: str, group: int, grid: int = CLIP_GRID) -> jax.Array:
    """Scales [K // group, N] of w [K, N]: per group and output, max|w| / qmax shrunk by the ratio
    that best keeps that group's share of x w (x [S, K], its first ``CLIP_TOKENS`` rows used)."""
    x = x[:CLIP_TOKENS]
    parts = [_clip(x, w[:, i:i + CLIP_COLUMNS], impl, group, grid) for i in range(0, w.shape[1], CLIP_COLUMNS)]
    return jnp.concatenate(parts, axis=1)
