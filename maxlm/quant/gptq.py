"""GPTQ (Frantar et al., 2022): quantize a weight one input row at a time, each row's rounding
error spread over the rows not yet quantized through the inverse Hessian of the layer's inputs.

For a Linear y = x W with W [K, N] (maxlm's layout: the paper's "columns" are our input rows) and
calibration inputs X [M, K], the layer-wise objective ||X W - X Q||^2 has Hessian H = 2 X^T X.
``quantize`` follows the paper's Algorithm 1 and the reference implementation's choices: dead
inputs (H_ii = 0) are zeroed, H is damped by ``damp`` times its mean diagonal, the upper Cholesky
factor U of H^-1 gives the update of row i, ``W[j] -= U[i, j] (w_i - q_i) / U[i, i]`` for j > i,
applied within blocks of 128 rows and lazily to the rows after the block. Group scales are found
from the current (already updated) rows when the group's first row is reached, at its block's
start, as the reference does. With ``act_order`` rows go by decreasing H_ii; since maxlm's format
keeps groups in input order (no g_idx), the group scales are then fixed from the original W first
(the reference's ``static_groups``). One jitted program per weight shape.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from maxlm.quant.rtn import group_scales, quantize_values

BLOCK = 128  # rows per lazy-update block


class GPTQError(ValueError):
    """The Hessian is not positive definite even after dampening (one line for the user)."""


def hessian(x: jax.Array) -> jax.Array:
    """2 X^T X in fp32 of inputs x [..., K] (summed over every leading axis)."""
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    return 2.0 * jnp.dot(x2.T, x2, precision=lax.Precision.HIGHEST)


def block_size(k: int, group: int, static: bool) -> int:
    """Rows per block: at most 128, dividing K, and (with groups found on the fly) a multiple or a
    divisor of the group, so that every group's scales are found at the start of a block."""
    for b in range(min(BLOCK, k), 0, -1):
        if k % b == 0 and (static or b % group == 0 or group % b == 0):
            return b
    return 1


@functools.partial(jax.jit, static_argnames=("impl", "group", "act_order"))
def _gptq(w: jax.Array, h: jax.Array, damp: jax.Array, impl: str, group: int, act_order: bool):
    k, n = w.shape
    w, h = w.astype(jnp.float32), h.astype(jnp.float32)
    dead = jnp.diag(h) == 0
    h = h + jnp.diag(dead.astype(jnp.float32))
    w = jnp.where(dead[:, None], 0.0, w)
    static = act_order or group >= k
    block = block_size(k, group, static)
    scales = group_scales(w, impl, group) if static else jnp.ones((k // group, n), jnp.float32)
    perm = jnp.argsort(-jnp.diag(h), stable=True) if act_order else jnp.arange(k)
    w, h = w[perm], h[perm][:, perm]
    h = h + damp * jnp.mean(jnp.diag(h)) * jnp.eye(k, dtype=jnp.float32)
    hinv = jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(h), True), jnp.eye(k, dtype=jnp.float32))
    u = jnp.linalg.cholesky(hinv).T  # upper: H^-1 = U^T U; U[i, j < i] is exactly 0
    row_group = perm // group

    def block_step(b, carry):
        w, q, scales = carry
        i1 = b * block
        if not static:  # the groups that start in this block, from the rows as they stand now
            if block % group == 0:
                fresh = group_scales(lax.dynamic_slice(w, (i1, 0), (block, n)), impl, group)
                scales = lax.dynamic_update_slice(scales, fresh, (i1 // group, 0))
            else:
                fresh = group_scales(lax.dynamic_slice(w, ((i1 // group) * group, 0), (group, n)), impl, group)
                updated = lax.dynamic_update_slice(scales, fresh, (i1 // group, 0))
                scales = jnp.where(i1 % group == 0, updated, scales)
        w1 = lax.dynamic_slice(w, (i1, 0), (block, n))
        u1 = lax.dynamic_slice(u, (i1, i1), (block, block))
        s1 = scales[lax.dynamic_slice(row_group, (i1,), (block,))]

        def row_step(i, c):
            w1, q1, e1 = c
            qi = quantize_values(w1[i][None], s1[i][None], impl)[0]
            err = (w1[i] - qi.astype(jnp.float32) * s1[i]) / u1[i, i]
            return w1 - jnp.outer(u1[i], err), q1.at[i].set(qi), e1.at[i].set(err)

        _, q1, e1 = lax.fori_loop(0, block, row_step, (w1, jnp.zeros((block, n), jnp.int8),
                                                         jnp.zeros((block, n), jnp.float32)))
        later = (jnp.arange(k) >= i1 + block).astype(jnp.float32)
        u_rows = lax.dynamic_slice(u, (i1, 0), (block, k)) * later[None]
        w = w - jnp.dot(u_rows.T, e1, precision=lax.Precision.HIGHEST)
        return w, lax.dynamic_update_slice(q, q1, (i1, 0)), scales

    _, q, scales = lax.fori_loop(0, k // block, block_step, (w, jnp.zeros((k, n), jnp.int8), scales))
    return q[jnp.argsort(perm)], scales, jnp.all(jnp.isfinite(u))


def quantize(w: jax.Array, h: jax.Array, impl: str, group: int, damp: float = 0.01,
             act_order: bool = False) -> tuple[jax.Array, jax.Array]:
    """GPTQ of w [K, N] under Hessian h [K, K]: (q [K, N] int8, scales [K // group, N] fp32)."""
    if w.shape[0] % group or h.shape != (w.shape[0], w.shape[0]):
        raise ValueError(f"GPTQ: weight {w.shape}, Hessian {h.shape} and group {group} do not fit")
    q, scales, finite = _gptq(w, h, jnp.float32(damp), impl, group, act_order)
    if not bool(finite):
        raise GPTQError(f"GPTQ: the inputs' Hessian ({w.shape[0]}x{w.shape[0]}) is not positive definite "
                        f"with dampening {damp:g}; raise --damp or use more calibration data")
    return q, scales


def output_error(w: jax.Array, wq: jax.Array, h: jax.Array) -> float:
    """||X (W - Wq)||^2 / ||X W||^2 from H = 2 X^T X: the layer-wise error GPTQ minimises."""
    d = (w - wq).astype(jnp.float32)
    w = w.astype(jnp.float32)
    hp = functools.partial(jnp.dot, precision=lax.Precision.HIGHEST)
    num, den = jnp.sum(d * hp(h, d)), jnp.sum(w * hp(h, w))
    return float(num / den) if float(den) > 0 else math.nan
