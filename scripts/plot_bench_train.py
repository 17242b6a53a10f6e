"""Tokens/s and peak memory against model size, maxlm beside PyTorch eager: how cost grows with work.

    python scripts/plot_bench_train.py                       # 3m, 20m and 85m; ~15 minutes on 2 cores
    python scripts/plot_bench_train.py --sizes 3m,20m --out /tmp/sizes.png

Runs scripts/bench_train.py once per size (its own process each time, --peers torch_eager), keeps
each run's JSON next to the picture, and draws two panels: tokens/s (median of the repeats, with
the spread as error bars) and peak resident memory, each against parameters on a log axis.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="3m,20m,85m", help="bench_train presets (default: 3m,20m,85m)")
    p.add_argument("--out", default=str(HERE / "bench_train_sizes.png"), help="the picture to write")
    p.add_argument("--repeats", type=int, default=3, help="bench_train --repeats (default: 3)")
    p.add_argument("--steps", type=int, default=2, help="bench_train --steps (default: 2)")
    args = p.parse_args(argv)
    out = Path(args.out)
    runs = []
    for size in args.sizes.split(","):
        record = out.with_name(f"{out.stem}_{size}.json")
        print(f"== {size}", flush=True)
        cmd = [sys.executable, str(HERE / "bench_train.py"), "--size", size, "--peers", "torch_eager",
               "--repeats", str(args.repeats), "--steps", str(args.steps), "--json", str(record)]
        if subprocess.run(cmd).returncode:
            sys.exit(f"plot_bench_train: bench_train failed for --size {size}")
        runs.append(json.loads(record.read_text()))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_mem) = plt.subplots(1, 2, figsize=(10, 4))
    params = [r["params"] / 1e6 for r in runs]
    for name, style in (("maxlm", "o-"), ("torch_eager", "s--")):
        tps = [r["results"][name]["tokens_per_s"] for r in runs]
        tok = [r["batch"] * r["seq_len"] for r in runs]
        err = [[t - n / max(r["results"][name]["times"]) for t, n, r in zip(tps, tok, runs)],
               [n / min(r["results"][name]["times"]) - t for t, n, r in zip(tps, tok, runs)]]
        ax_tps.errorbar(params, tps, yerr=err, fmt=style, capsize=3, label=name)
        ax_mem.plot(params, [r["results"][name]["peak_rss"] / 2**30 for r in runs], style, label=name)
    for ax, label in ((ax_tps, "training tokens/s (batch 8 x 256, fp32)"), (ax_mem, "peak resident memory, GiB")):
        ax.set_xscale("log")
        ax.set_xlabel("parameters, millions")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_tps.set_yscale("log")
    busy = any(r["busy"] for r in runs)
    fig.suptitle("maxlm vs PyTorch eager on this CPU" + (" (BUSY MACHINE: not a result)" if busy else ""))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    for r in runs:
        print(f"{r['size']:>4} {r['params'] / 1e6:6.1f}M  maxlm {r['results']['maxlm']['tokens_per_s']:8,.0f} tok/s "
              f"(MFU {r['results']['maxlm']['mfu']:.0%})  torch_eager "
              f"{r['results']['torch_eager']['tokens_per_s']:8,.0f} tok/s  ratio {r['ratios']['torch_eager']:.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
