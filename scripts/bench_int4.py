"""INT4 weight-only matmul (the Pallas kernel) against a bf16 jnp.dot, same weights shape, same run.

    python scripts/bench_int4.py                     # GPU: 8192x8192 weights at M = 1, 16, 64, 256
    python scripts/bench_int4.py --ms 1,16 --sweep   # also try other block sizes at each M
    python scripts/bench_int4.py                     # CPU: no timing of the kernel (see below)

On a GPU each timed call is one jit that runs --calls matmuls over --copies distinct weight
arrays in turn (so INT4's 32 MiB of weights cannot sit in the 50 MiB L2 between calls and the
Python dispatch is amortised), the INT4 and bf16 calls alternate, and each figure is the median
over --repeats. Effective GB/s counts the bytes a matmul must move: weights (+ scales), x, out.
The memory-traffic limit of the speedup is bf16 bytes / INT4 bytes, ~3.9x at M=1 with group 128.
The last lines are "ratio int4/bf16 speedup M=1 = X" and "... M=16 = Y".

Without a GPU the kernel cannot be timed: the script says so, checks the kernel in Pallas
interpret mode against the reference (max abs error on a small shape), compiles its Triton IR
for sm_90 with the `triton` package when installed (no GPU needed), and times XLA's
dequantize-then-matmul against bf16 jnp.dot on the CPU, labelled as what it is: not the kernel.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.kernels import int4_matmul as int4
from maxlm.kernels.int4_matmul import offline

MMA = r"\b(?:mma\.sync|wgmma\.mma_async)\b"  # tensor-core instructions in PTX (Hopper's wgmma for big tiles)
SWEEP = dict(block_n=(32, 64, 128), k_splits=(1, 2, 4), block_k=(256, 512))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=8192, help="input dimension K (default: 8192)")
    p.add_argument("--n", type=int, default=8192, help="output dimension N (default: 8192)")
    p.add_argument("--ms", default="1,16,64,256", help="comma-separated M (rows of x) (default: 1,16,64,256)")
    p.add_argument("--group", type=int, default=128, help="quantisation group along K (default: 128)")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats, alternating (default: 20)")
    p.add_argument("--copies", type=int, default=16,
                   help="distinct weight arrays cycled per call (default: 16); at least --calls, or XLA merges "
                        "the bf16 dots that share a weight into one and the baseline reads it once")
    p.add_argument("--calls", type=int, default=16, help="matmuls per timed jit call (default: 16)")
    p.add_argument("--sweep", action="store_true", help="GPU: also time other block sizes at each M")
    args = p.parse_args(argv)
    try:
        args.ms = [int(m) for m in args.ms.split(",")]
    except ValueError:
        p.error(f"--ms {args.ms!r} must be comma-separated integers")
    if problem := int4.check_shapes(args.k, args.group):
        p.error(problem)
    if min(args.ms + [args.k, args.n, args.repeats, args.copies, args.calls]) < 1:
        p.error("--k, --n, --ms, --repeats, --copies and --calls must be positive")
    return args


def make_weights(k, n, group, copies):
    """``copies`` random weights as (bf16 [K, N], qweight, scales) each."""
    out = []
    for key in jax.random.split(jax.random.PRNGKey(0), copies):
        w = jax.random.normal(key, (k, n), jnp.float32) * 0.02
        qweight, scales = int4.quantize_int4(w, group)
        out.append((w.astype(jnp.bfloat16), qweight, scales))
    return out


def _time_once(fn, args):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def runner(matmul, calls, copies):
    """One jit running ``calls`` matmuls, cycling through ``copies`` weights; returns every output
    (no combining op to add time). Each matmul has its own rows of ``x`` ([calls, M, K]): with one
    x, XLA would merge the repeats of a weight copy into one matmul (common subexpressions)."""
    def run(x, weights):
        return [matmul(x[i], *weights[i % copies]) for i in range(calls)]
    return jax.jit(run)


def gpu(args) -> None:
    print(f"device: {jax.devices()[0].device_kind}; weights [{args.k}, {args.n}], group {args.group}; "
          f"{args.calls} matmuls per call over {args.copies} weight copies; "
          f"median of {args.repeats} alternating repeats")
    weights = make_weights(args.k, args.n, args.group, args.copies)
    dense = [(w,) for w, _, _ in weights]
    packed = [(q, s) for _, q, s in weights]
    run = functools.partial(runner, calls=args.calls, copies=args.copies)
    bf16 = run(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
    xla = run(lambda x, q, s: int4.int4_matmul(x, q, s, impl="xla"))
    w_bytes = {"bf16": args.k * args.n * 2, "int4": args.k * args.n // 2 + args.k // args.group * args.n * 4}
    print(f"{'M':>5} {'contender':<50} {'us/matmul':>10} {'GB/s':>7} {'vs bf16':>8}")
    ratios = {}
    for m in args.ms:
        x = jax.random.normal(jax.random.PRNGKey(m), (args.calls, m, args.k), jnp.bfloat16)
        io = m * (args.k + args.n) * 2
        configs = [{}]
        if args.sweep:
            configs += [dict(zip(SWEEP, c)) for c in itertools.product(*SWEEP.values())]
        contenders = {"bf16 jnp.dot": (bf16, dense, w_bytes["bf16"]),
                      "int4 xla (dequant+dot)": (xla, packed, w_bytes["int4"])}
        for cfg in configs:
            name = "int4 pallas " + (",".join(f"{k}={v}" for k, v in cfg.items()) or "defaults")
            kernel = run(lambda x_, q, s, cfg=cfg: int4.int4_matmul(x_, q, s, impl="pallas", **cfg))
            contenders[name] = (kernel, packed, w_bytes["int4"])
        times = {name: [] for name in contenders}
        for name, (fn, ws, _) in contenders.items():  # compile and warm up, untimed
            jax.block_until_ready(fn(x, ws))
        for _ in range(args.repeats):
            for name, (fn, ws, _) in contenders.items():
                times[name].append(_time_once(fn, (x, ws)) / args.calls)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        for name, (_, _, wb) in contenders.items():
            print(f"{m:>5} {name:<50} {1e6 * med[name]:>10.2f} {(wb + io) / med[name] / 1e9:>7.0f} "
                  f"{med['bf16 jnp.dot'] / med[name]:>7.2f}x", flush=True)
        ratios[m] = med["bf16 jnp.dot"] / med["int4 pallas defaults"]
        if args.sweep:
            best = min((n for n in med if n.startswith("int4 pallas")), key=med.get)
            print(f"{m:>5} best: {best} ({med['bf16 jnp.dot'] / med[best]:.2f}x)")
    print(f"memory-traffic limit of the speedup (bf16 bytes / int4 bytes, weights only): "
          f"{w_bytes['bf16'] / w_bytes['int4']:.2f}x")
    for m in args.ms:
        print(f"ratio int4/bf16 speedup M={m} = {ratios[m]:.2f}")


def cpu(args) -> None:
    print(f"no GPU (jax backend: {jax.default_backend()}): the Pallas kernel cannot be timed here; "
          "checking it instead")
    m, k, n = 16, 1024, 384
    x = jax.random.normal(jax.random.PRNGKey(1), (m, k), jnp.bfloat16)
    (_, qweight, scales), = make_weights(k, n, args.group if k % args.group == 0 else 128, 1)
    t = time.perf_counter()
    got = int4.int4_matmul(x, qweight, scales, impl="pallas", interpret=True)
    ref = int4.int4_matmul_reference(x, qweight, scales)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
    print(f"interpret-mode kernel vs reference, bf16 [{m}, {k}] x [{k}, {n}]: max abs error {err:.3g} "
          f"(max |out| {float(jnp.max(jnp.abs(ref.astype(jnp.float32)))):.3g}; {time.perf_counter() - t:.1f} s)")
    try:
        for mm in (1, 16, 256):
            p = int4.default_blocks(mm, args.k, args.n)
            ptx = offline.compile_ir(offline.triton_ir(mm, args.k, args.n, args.group, jnp.bfloat16),
                                     num_warps=p["num_warps"], num_stages=p["num_stages"])
            text = ptx.asm["ptx"]
            mmas = len(re.findall(MMA, text))
            converts = len(re.findall(r"cvt\.rn\.(?:bf16|f16|f32)\.[su](?:8|16|32)\b", text))
            print(f"compiled for sm_90 with triton (not run), M={mm} [{args.k}, {args.n}]: blocks "
                  f"{p['block_m']}x{p['block_n']}x{p['block_k']}, {mmas} tensor-core mma in the code, "
                  f"{converts} int->float converts, {ptx.metadata.shared // 1024} KiB shared memory")
    except (ImportError, NotImplementedError) as e:  # no pip `triton`, or a jax without the hook
        print(f"the sm_90 compile check is skipped: {e}")
    # Not the kernel: XLA's INT4 path (dequantize, then dot) against a bf16 dot, on this CPU.
    k, n = 2048, 2048
    (w, qweight, scales), = make_weights(k, n, args.group if k % args.group == 0 else 128, 1)
    for mm in (1, 16):
        x = jax.random.normal(jax.random.PRNGKey(mm), (mm, k), jnp.bfloat16)
        dense = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
        xla = jax.jit(lambda x, q, s: int4.int4_matmul(x, q, s, impl="xla"))
        jax.block_until_ready((dense(x, w), xla(x, qweight, scales)))
        td, tx = [], []
        for _ in range(args.repeats):
            td.append(_time_once(dense, (x, w)))
            tx.append(_time_once(xla, (x, qweight, scales)))
        d, q = statistics.median(td), statistics.median(tx)
        print(f"NOT THE KERNEL, XLA dequantize-then-matmul on CPU, M={mm} [{k}, {n}]: bf16 dot {1e3 * d:.2f} ms, "
              f"int4 xla {1e3 * q:.2f} ms, bf16/int4 time {d / q:.2f}")
    for mm in args.ms[:2]:
        print(f"ratio int4/bf16 speedup M={mm} = not measured (no GPU in this session)")


def main(argv=None) -> int:
    args = parse_args(argv)
    (gpu if jax.default_backend() == "gpu" else cpu)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
