"""Blocked vs dense attention (attention_impl="xla"), forward+backward, on this machine.

Times jax.jit(value_and_grad(sum(attention(q, k, v) * r))) w.r.t. q, k, v for the dense square
(``_xla_attention`` over the full mask, scores recomputed in the backward) and for the blocked
schedule (``blocked_attention``), alternating the two, median over repeats. Grouped-query:
6 query heads, 2 kv heads. Last line: `ratio blocked/dense fwd+bwd time = X` (geometric mean
over the shapes).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.model import attention as A


def dense(q, k, v, segments, window):
    tokens = A.Tokens(jnp.broadcast_to(jnp.arange(q.shape[1]), segments.shape), segments)
    return jax.checkpoint(A._xla_attention)(q, k, v, A.attention_mask(tokens, tokens, window, True))


def blocked(q, k, v, segments, window, block, remat):
    if remat == "auto":  # the production dispatch: attention_impl="xla" over its own tokens
        tokens = A.Tokens(segments, segments)
        return A._xla(q, k, v, tokens, tokens, window, True, block=block)
    core = functools.partial(A.blocked_attention, segments=segments, sliding_window=window, block=block)
    return (jax.checkpoint(core) if remat == "recompute" else core)(q, k, v)


def step_fn(attn, r):
    loss = lambda q, k, v, seg: jnp.sum(attn(q, k, v, seg).astype(jnp.float32) * r)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="256:0,1024:0,1024:128", help="comma list of seq_len:window")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--block", type=int, default=A.BLOCK)
    p.add_argument("--remat", choices=("auto", "recompute", "store"), default="auto",
                   help="blocked: recompute scores in the backward, store them, or decide by shape")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(f"{'T':>6} {'window':>6} {'block':>5} {'remat':>9} {'dense ms':>9} {'blocked ms':>10} {'ratio':>6}")
    ratios = []
    for shape in args.shapes.split(","):
        t, window = (int(x) for x in shape.split(":"))
        ks = jax.random.split(jax.random.PRNGKey(0), 4)
        b, h, dt = args.batch, args.head_dim, jnp.dtype(args.dtype)
        q = jax.random.normal(ks[0], (b, t, 6, h), dt)
        k, v = (jax.random.normal(kk, (b, t, 2, h), dt) for kk in ks[1:3])
        r = jax.random.normal(ks[3], (b, t, 6, h), jnp.float32)
        seg = jnp.asarray(np.repeat(np.arange(1, 5), -(-t // 4))[None, :t].repeat(b, 0))  # 4 documents
        fns = [step_fn(functools.partial(dense, window=window), r),
               step_fn(functools.partial(blocked, window=window, block=args.block, remat=args.remat), r)]
        times = [[], []]
        for i in range(args.repeats + 1):  # the first round compiles and is dropped
            for fn, ts in zip(fns, times):
                start = time.perf_counter()
                jax.block_until_ready(fn(q, k, v, seg))
                if i:
                    ts.append(time.perf_counter() - start)
        d, bl = (1e3 * statistics.median(ts) for ts in times)
        seen = max(hi - first for _, hi, first in A.query_blocks(t, args.block, window))
        remat = args.remat if args.remat != "auto" else ("store" if seen <= A.STORE_KEYS else "recompute")
        ratios.append(bl / d)
        print(f"{t:>6} {window:>6} {args.block:>5} {remat:>9} {d:>9.1f} {bl:>10.1f} {bl / d:>6.3f}")
    print(f"ratio blocked/dense fwd+bwd time = {float(np.exp(np.mean(np.log(ratios)))):.3f}")


if __name__ == "__main__":
    main()
