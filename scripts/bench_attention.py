"""Attention benchmarks: the Pallas flash kernel against cuDNN and XLA (GPU), and the blocked
against the dense schedule of attention_impl="xla" (CPU).

``--gpu``: forward and forward+backward TFLOP/s at B=4, N=16 heads, S=4096, D=128, causal, bf16
(the sizes are options) of ``flash_attention`` (kernels/flash_attention, compiled through Pallas'
Triton backend), ``jax.nn.dot_product_attention(implementation='cudnn')`` and (..., 'xla'),
alternating the contenders, median over repeats. FLOPs follow FlashAttention's benchmark:
4·B·N·S²·D for the forward, halved when causal, and 2.5x that for the backward (3.5x for both).
Last lines: `ratio pallas/cudnn fwd = X` and `ratio pallas/cudnn fwd+bwd = Y`. ``--sweep`` also
times other block sizes of the kernel. Without a GPU it says so and checks only correctness: the
kernel in interpret mode against the jnp reference, max abs error of outputs and gradients.

Default (CPU): times jax.jit(value_and_grad(sum(attention(q, k, v) * r))) w.r.t. q, k, v for the
dense square (``_xla_attention`` over the full mask, scores recomputed in the backward) and for
the blocked schedule (``blocked_attention``), alternating the two, median over repeats.
Grouped-query: 6 query heads, 2 kv heads. Last line: `ratio blocked/dense fwd+bwd time = X`
(geometric mean over the shapes).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.kernels import flash_attention as fa


def dense(q, k, v, segments, window):
    from maxlm.model import attention as A  # noqa: PLC0415  (the GPU run has only maxlm.kernels)

    tokens = A.Tokens(jnp.broadcast_to(jnp.arange(q.shape[1]), segments.shape), segments)
    return jax.checkpoint(A._xla_attention)(q, k, v, A.attention_mask(tokens, tokens, window, True))


def blocked(q, k, v, segments, window, block, remat):
    from maxlm.model import attention as A  # noqa: PLC0415

    if remat == "auto":  # the production dispatch: attention_impl="xla" over its own tokens
        tokens = A.Tokens(segments, segments)
        return A._xla(q, k, v, tokens, tokens, window, True, block=block)
    core = functools.partial(A.blocked_attention, segments=segments, sliding_window=window, block=block)
    return (jax.checkpoint(core) if remat == "recompute" else core)(q, k, v)


def step_fn(attn, r):
    loss = lambda q, k, v, seg: jnp.sum(attn(q, k, v, seg).astype(jnp.float32) * r)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


# ---------------------------------------------------------------- GPU: Pallas vs cuDNN vs XLA


def _contenders(causal: bool, blocks: fa.BlockSizes | None):
    return {
        "pallas": lambda q, k, v: fa.flash_attention(q, k, v, causal=causal, block_sizes=blocks),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"),
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla"),
    }


def _median_ms(fns: dict, args, repeats: int, inner: int) -> dict:
    """Median ms per call of each fn, the contenders alternating within every repeat."""
    for fn in fns.values():  # compile and warm up
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                out = fn(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / inner)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def gpu_bench(args) -> None:
    b, n, s, d = args.batch, args.heads, args.seq_len, args.head_dim
    dt = jnp.dtype(args.dtype)
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(kk, (b, s, n, d), dt) for kk in ks)
    flops = 4 * b * n * s * s * d * (0.5 if args.causal else 1.0)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; B={b} N={n} S={s} D={d} "
          f"causal={args.causal} {args.dtype}; median of {args.repeats} alternating repeats")

    def both(fns):
        fwd = {name: jax.jit(fn) for name, fn in fns.items()}
        bwd = {name: jax.jit(lambda q, k, v, fn=fn: jax.vjp(fn, q, k, v)[1](do)) for name, fn in fns.items()}
        return _median_ms(fwd, (q, k, v), args.repeats, args.inner), _median_ms(bwd, (q, k, v), args.repeats, args.inner)

    fns = _contenders(args.causal, None)
    ref = jax.jit(fns["cudnn"])(q, k, v).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(jax.jit(fns["pallas"])(q, k, v).astype(jnp.float32) - ref)))
    print(f"max |pallas - cudnn| output = {err:.3e}")
    fwd, fb = both(fns)
    print(f"{'impl':>8} {'fwd ms':>8} {'TFLOP/s':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8}")
    for name in fns:
        print(f"{name:>8} {fwd[name]:>8.3f} {flops / fwd[name] / 1e9:>8.1f} {fb[name]:>11.3f} "
              f"{3.5 * flops / fb[name] / 1e9:>8.1f}")
    if args.sweep:
        print("pallas block sizes (block_q, block_k, block_q_bwd, block_k_bwd, warps, stages):")
        for bq, bk, bqb, bkb, warps, stages in ((128, 64, 64, 64, 8, 2), (128, 128, 64, 64, 8, 2),
                                                (64, 64, 64, 64, 4, 2), (128, 64, 64, 128, 8, 3),
                                                (128, 64, 128, 64, 8, 2), (128, 32, 32, 64, 4, 3)):
            blocks = fa.BlockSizes(bq, bk, bqb, bkb, warps, warps, stages)
            sf, sb = both({"pallas": _contenders(args.causal, blocks)["pallas"]})
            print(f"  {bq:>4} {bk:>4} {bqb:>4} {bkb:>4} {warps:>2} {stages}: fwd {sf['pallas']:.3f} ms "
                  f"({flops / sf['pallas'] / 1e9:.1f} TFLOP/s), fwd+bwd {sb['pallas']:.3f} ms "
                  f"({3.5 * flops / sb['pallas'] / 1e9:.1f} TFLOP/s)")
    print(f"ratio pallas/cudnn fwd = {fwd['cudnn'] / fwd['pallas']:.3f}")
    print(f"ratio pallas/cudnn fwd+bwd = {fb['cudnn'] / fb['pallas']:.3f}")


def _out_and_grads(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))


def interpret_check() -> None:
    """No GPU: the kernel in interpret mode against the jnp reference, small shapes."""
    print(f"no GPU (jax backend: {jax.default_backend()}): no timing; interpret-mode correctness only")
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    seg = jnp.asarray(np.repeat([1, 2, 3], [50, 40, 30])[None].repeat(2, 0), jnp.int32)  # 3 documents
    small = fa.BlockSizes(32, 32, 32, 32)
    for dt, window in ((jnp.float32, 0), (jnp.bfloat16, 48)):
        q, do = (jax.random.normal(kk, (2, 120, 4, 128), dt) for kk in ks[:2])
        k, v = (jax.random.normal(kk, (2, 120, 2, 128), dt) for kk in ks[2:])
        opts = dict(causal=True, sliding_window=window)
        kernel = lambda q, k, v: fa.flash_attention(q, k, v, seg, block_sizes=small, **opts)
        reference = lambda q, k, v: fa.attention_reference(q, k, v, seg, **opts)
        got, want = (jax.jit(functools.partial(_out_and_grads, f))(q, k, v, do) for f in (kernel, reference))
        errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))) for g, w in zip(got, want)]
        print(f"B=2 S=120 N=4 K=2 D=128 causal window={window} 3 documents {jnp.dtype(dt).name}: max abs error "
              + ", ".join(f"{name} {e:.2e}" for name, e in zip(("out", "dq", "dk", "dv"), errs)))


# ---------------------------------------------------------------- CPU: blocked vs dense (xla)


def cpu_bench(args) -> None:
    from maxlm.model import attention as A  # noqa: PLC0415

    block = args.block or A.BLOCK
    print(f"{'T':>6} {'window':>6} {'block':>5} {'remat':>9} {'dense ms':>9} {'blocked ms':>10} {'ratio':>6}")
    ratios = []
    for shape in args.shapes.split(","):
        t, window = (int(x) for x in shape.split(":"))
        ks = jax.random.split(jax.random.PRNGKey(0), 4)
        b, h, dt = args.batch or 8, args.head_dim or 64, jnp.dtype(args.dtype or "float32")
        q = jax.random.normal(ks[0], (b, t, 6, h), dt)
        k, v = (jax.random.normal(kk, (b, t, 2, h), dt) for kk in ks[1:3])
        r = jax.random.normal(ks[3], (b, t, 6, h), jnp.float32)
        seg = jnp.asarray(np.repeat(np.arange(1, 5), -(-t // 4))[None, :t].repeat(b, 0))  # 4 documents
        fns = [step_fn(functools.partial(dense, window=window), r),
               step_fn(functools.partial(blocked, window=window, block=block, remat=args.remat), r)]
        times = [[], []]
        for i in range(args.repeats + 1):  # the first round compiles and is dropped
            for fn, ts in zip(fns, times):
                start = time.perf_counter()
                jax.block_until_ready(fn(q, k, v, seg))
                if i:
                    ts.append(time.perf_counter() - start)
        d, bl = (1e3 * statistics.median(ts) for ts in times)
        seen = max(hi - first for _, hi, first in A.query_blocks(t, block, window))
        remat = args.remat if args.remat != "auto" else ("store" if seen <= A.STORE_KEYS else "recompute")
        ratios.append(bl / d)
        print(f"{t:>6} {window:>6} {block:>5} {remat:>9} {d:>9.1f} {bl:>10.1f} {bl / d:>6.3f}")
    print(f"ratio blocked/dense fwd+bwd time = {float(np.exp(np.mean(np.log(ratios)))):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--gpu", action="store_true", help="Pallas vs cuDNN vs XLA on the GPU (without one: "
                   "interpret-mode correctness only)")
    p.add_argument("--sweep", action="store_true", help="--gpu: also time other block sizes of the kernel")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="--gpu: causal mask")
    p.add_argument("--heads", type=int, default=16, help="--gpu: query (= kv) heads")
    p.add_argument("--seq_len", type=int, default=4096, help="--gpu: sequence length")
    p.add_argument("--inner", type=int, default=10, help="--gpu: calls per timed repeat")
    p.add_argument("--shapes", default="256:0,1024:0,1024:128", help="CPU: comma list of seq_len:window")
    p.add_argument("--block", type=int, default=None, help="CPU: query block of the blocked schedule "
                   "(default: attention.BLOCK)")
    p.add_argument("--remat", choices=("auto", "recompute", "store"), default="auto",
                   help="CPU blocked: recompute scores in the backward, store them, or decide by shape")
    p.add_argument("--batch", type=int, default=None, help="batch (default: 4 with --gpu, else 8)")
    p.add_argument("--head_dim", type=int, default=None, help="head dim (default: 128 with --gpu, else 64)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default: bfloat16 with --gpu, else float32")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if not args.gpu:
        return cpu_bench(args)
    if jax.default_backend() != "gpu":
        return interpret_check()
    args.batch, args.head_dim, args.dtype = args.batch or 4, args.head_dim or 128, args.dtype or "bfloat16"
    gpu_bench(args)


if __name__ == "__main__":
    main()
