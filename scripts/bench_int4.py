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

    python scripts/bench_int4.py --variants gemv --ms 1,16,64 --json out.jsonl   # GPU: the kernel variants

--variants (comma-separated names from kernel.VARIANTS, or "all") times bf16 jnp.dot and each
variant over its grid of settings (VARIANT_GRID) at each M, same method as above; each contender's
first output is checked once against the reference (max abs error), a contender that fails to
compile or run is reported and skipped, and no new contender starts after --budget-s seconds.
Rows are appended to --json as JSON lines; scripts/gpu_int4_sweep.sh runs one process per variant
(a crashed kernel cannot take the others down) and merges them into one table.

Without a GPU the kernel cannot be timed: the script says so, checks the kernel in Pallas
interpret mode against the reference (max abs error on a small shape), compiles its Triton IR
for sm_90 with the `triton` package when installed (no GPU needed), and times XLA's
dequantize-then-matmul against bf16 jnp.dot on the CPU, labelled as what it is: not the kernel.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.kernels import int4_matmul as int4
from maxlm.kernels.int4_matmul import offline

MMA = r"\b(?:mma\.sync|wgmma\.mma_async)\b"  # tensor-core instructions in PTX (Hopper's wgmma for big tiles)
SWEEP = dict(block_n=(32, 64, 128), k_splits=(1, 2, 4), block_k=(256, 512))


def _grid(*rows, keys=("block_n", "k_splits", "block_k", "num_warps")):
    return [dict(zip(keys, r)) for r in rows]


# --variants: the settings timed per variant and M (about 2-3 s of compile each on an H200; the grid
# is sized so that all variants at M = 1, 16, 64 fit in ~5 minutes). {} is the variant's defaults.
VARIANT_GRID = {
    "dot": {
        1: [{}] + _grid((32, 4, 256, 4), (64, 4, 256, 4), (32, 8, 256, 4), (64, 8, 512, 4), (128, 8, 256, 4)),
        16: [{}] + _grid((32, 4, 256, 4), (64, 4, 256, 4), (64, 8, 256, 4), (128, 4, 512, 4)),
        64: [{}] + _grid((64, 2, 256, 4), (128, 1, 256, 4), (128, 2, 256, 8)),
    },
    "dot_perm": {
        1: [{}] + _grid((32, 4, 256, 4), (64, 4, 256, 4), (64, 8, 512, 4)),
        16: [{}] + _grid((32, 4, 256, 4), (64, 4, 256, 4), (128, 4, 512, 4)),
        64: [{}] + _grid((64, 2, 256, 4), (128, 2, 256, 8)),
    },
    "dot_wide": {
        1: [{}] + _grid((32, 4, 256, 4), (64, 4, 256, 4), (64, 8, 512, 4), (128, 8, 256, 4)),
        16: [{}] + _grid((32, 4, 256, 4), (64, 4, 256, 4), (128, 4, 256, 4), (128, 8, 512, 8)),
        64: [{}] + _grid((64, 2, 256, 4), (128, 1, 256, 4), (128, 2, 256, 8)),
    },
    "gemv": {
        1: [{}] + _grid((64, 8, 256, 4), (128, 4, 256, 4), (128, 8, 256, 4), (128, 16, 256, 4), (128, 8, 512, 4),
                        (256, 8, 256, 4), (256, 16, 256, 8), (256, 8, 512, 8), (512, 16, 256, 8), (64, 16, 512, 4),
                        (128, 32, 128, 4)),
        16: [{}] + _grid((64, 8, 256, 4, 8), keys=("block_n", "k_splits", "block_k", "num_warps", "block_m")),
    },
    "gemv_strided": {
        1: [{}] + _grid((128, 8, 256, 4), (256, 16, 256, 8)),
        16: [{}],
    },
}


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
    p.add_argument("--variants", default="",
                   help="GPU: time these kernel variants (comma-separated, or 'all') over VARIANT_GRID instead")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="--variants: start no new contender after this many seconds (default: 300)")
    p.add_argument("--json", default="", help="--variants: append one JSON line per result to this file")
    p.add_argument("--summarize", default="", metavar="JSONL",
                   help="print one table and the best setting per M from --json files' lines (no GPU needed)")
    args = p.parse_args(argv)
    if args.variants:
        names = list(int4.VARIANTS) if args.variants == "all" else args.variants.split(",")
        if bad := [v for v in names if v not in int4.VARIANTS]:
            p.error(f"--variants: unknown {bad}; choose from {', '.join(int4.VARIANTS)} or 'all'")
        args.variants = names
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


def _cfg_name(variant, cfg):
    return variant + " " + (",".join(f"{k}={v}" for k, v in cfg.items()) or "defaults")


def variant_sweep(args) -> None:
    """bf16 jnp.dot and every (variant, setting) of VARIANT_GRID at each M, timed as gpu() does."""
    warnings.filterwarnings("ignore")  # jax 0.11 warns on every Triton-backend call
    t0 = time.perf_counter()
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; weights [{args.k}, {args.n}], "
          f"group {args.group}; variants {','.join(args.variants)}; {args.calls} matmuls per call over "
          f"{args.copies} weight copies; median of {args.repeats} alternating repeats", flush=True)
    weights = make_weights(args.k, args.n, args.group, args.copies)
    dense = [(w,) for w, _, _ in weights]
    packed = [(q, s) for _, q, s in weights]
    run = functools.partial(runner, calls=args.calls, copies=args.copies)
    w_bytes = {"bf16": args.k * args.n * 2, "int4": args.k * args.n // 2 + args.k // args.group * args.n * 4}
    jobs = {m: [(v, cfg) for v in args.variants for cfg in VARIANT_GRID[v].get(m, [])] for m in args.ms}
    total = sum(len(j) for j in jobs.values()) or 1
    done = 0
    print(f"{'M':>5} {'contender':<64} {'us/matmul':>10} {'GB/s':>7} {'vs bf16':>8} {'max|err|':>9}")

    def emit(row):
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    for m in args.ms:
        x = jax.random.normal(jax.random.PRNGKey(m), (args.calls, m, args.k), jnp.bfloat16)
        io = m * (args.k + args.n) * 2
        ref = np.asarray(int4.int4_matmul_reference(x[0], *packed[0]).astype(jnp.float32))
        scale = float(np.max(np.abs(ref)))
        bf16 = run(lambda x_, w: jnp.dot(x_, w, preferred_element_type=jnp.float32).astype(x_.dtype))
        contenders = {"bf16 jnp.dot": (bf16, dense, w_bytes["bf16"], None)}
        errs = {}
        done += len(jobs[m])
        deadline = t0 + args.budget_s * done / total  # this M's share of the budget, cumulative
        for variant, cfg in jobs[m]:
            name = _cfg_name(variant, cfg)
            if time.perf_counter() > deadline:
                print(f"{m:>5} {name:<64} skipped: time budget", flush=True)
                emit(dict(m=m, variant=variant, cfg=cfg, name=name, error="skipped: time budget"))
                continue
            fn = run(lambda x_, q, s, cfg=cfg, variant=variant: int4.int4_matmul(
                x_, q, s, impl="pallas", variant=variant, **cfg))
            try:
                t = time.perf_counter()
                outs = jax.block_until_ready(fn(x, packed))  # compile, warm up, and check the first output
                err = float(np.max(np.abs(np.asarray(outs[0].astype(jnp.float32)) - ref)))
                errs[name] = (err, time.perf_counter() - t)
                contenders[name] = (fn, packed, w_bytes["int4"], (variant, cfg))
            except Exception as e:  # noqa: BLE001  (one failing contender must not stop the sweep)
                msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                print(f"{m:>5} {name:<64} FAILED {msg}", flush=True)
                emit(dict(m=m, variant=variant, cfg=cfg, name=name, error=msg))
        jax.block_until_ready(bf16(x, dense))
        times = {name: [] for name in contenders}
        for _ in range(args.repeats):
            for name, (fn, ws, _, _) in contenders.items():
                times[name].append(_time_once(fn, (x, ws)) / args.calls)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        base = med["bf16 jnp.dot"]
        for name, (_, _, wb, what) in contenders.items():
            err = errs.get(name, (0.0, 0.0))[0]
            bad = "  WRONG" if what and err > 0.02 * scale else ""
            print(f"{m:>5} {name:<64} {1e6 * med[name]:>10.2f} {(wb + io) / med[name] / 1e9:>7.0f} "
                  f"{base / med[name]:>7.2f}x {err if what else 0:>9.3g}{bad}", flush=True)
            row = dict(m=m, name=name, us=1e6 * med[name], gbs=(wb + io) / med[name] / 1e9, speedup=base / med[name],
                       bf16_us=1e6 * base, max_abs_err=err if what else 0.0, max_abs_out=scale, wrong=bool(bad))
            if what:
                row.update(variant=what[0], cfg=what[1], compile_s=errs[name][1])
            emit(row)
        ok = [n for n, (_, _, _, w) in contenders.items() if w and errs[n][0] <= 0.02 * scale]
        if ok:
            best = min(ok, key=med.get)
            print(f"{m:>5} best: {best}: {1e6 * med[best]:.2f} us, {base / med[best]:.2f}x bf16 "
                  f"({1e6 * base:.2f} us)", flush=True)
    print(f"sweep done in {time.perf_counter() - t0:.0f} s")


def summarize(path: str) -> None:
    """One table from the JSON lines of --variants runs (each run times its own bf16 baseline; a
    row's speedup is against the baseline of its own run) and the best correct setting per M."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    timed = [r for r in rows if "us" in r]
    print(f"{'M':>5} {'contender':<64} {'us/matmul':>10} {'GB/s':>7} {'vs bf16':>8} {'max|err|':>9}  note")
    for m in sorted({r["m"] for r in rows}):
        base = [r["us"] for r in timed if r["m"] == m and "variant" not in r]
        if base:
            print(f"{m:>5} {'bf16 jnp.dot (median over runs: ' + ', '.join(f'{b:.1f}' for b in base) + ')':<64} "
                  f"{statistics.median(base):>10.2f}")
        for r in sorted((r for r in timed if r["m"] == m and "variant" in r), key=lambda r: r["us"]):
            print(f"{m:>5} {r['name']:<64} {r['us']:>10.2f} {r['gbs']:>7.0f} {r['speedup']:>7.2f}x "
                  f"{r['max_abs_err']:>9.3g}  {'WRONG' if r['wrong'] else ''}")
        for r in rows:
            if r["m"] == m and "error" in r:
                print(f"{m:>5} {r['name']:<64} {'-':>10} {'-':>7} {'-':>8} {'-':>9}  {r['error'][:120]}")
    print()
    for m in sorted({r["m"] for r in rows}):
        ok = [r for r in timed if r["m"] == m and "variant" in r and not r["wrong"]]
        if ok:
            b = min(ok, key=lambda r: r["us"])
            print(f"best M={m}: {b['name']}: {b['us']:.2f} us vs bf16 {b['bf16_us']:.2f} us = {b['speedup']:.2f}x "
                  f"(max abs err {b['max_abs_err']:.3g} of max |out| {b['max_abs_out']:.3g})")
        else:
            print(f"best M={m}: no correct timed setting")


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
    if args.summarize:
        summarize(args.summarize)
    elif args.variants and jax.default_backend() == "gpu":
        variant_sweep(args)
    else:
        (gpu if jax.default_backend() == "gpu" else cpu)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
