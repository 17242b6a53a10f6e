"""Training throughput of maxlm against PyTorch (eager and torch.compile), same model, same run.

    python scripts/bench_train.py                 # ~19M-parameter Llama, batch 8 x 256, fp32, CPU
    python scripts/bench_train.py --size tiny --steps 2 --repeats 2 --peers torch_eager   # smoke run
    python scripts/bench_train.py --size 85m --peers torch_eager --json out.json          # one size

Every contender trains the same Llama-style model (RMSNorm, RoPE, SwiGLU, grouped-query attention,
untied embeddings) from the same initial weights (torch's, imported with maxlm.hf) on the same
random tokens, with AdamW (same betas, eps, weight decay with norms excluded, learning rate,
global-norm clipping), in fp32 on every CPU core; their final losses agree. maxlm runs its real
jitted train step (maxlm.train.tasks.lm_steps, state donated), with the huge-page malloc setting
its entry point applies (maxlm.train.allocator; --allocator default turns it off). The peers run
transformers' LlamaForCausalLM (SDPA attention, train mode) with the fused AdamW kernel:
torch_eager as is, torch_compile and torch_max_autotune with torch.compile(model) in its default
and "max-autotune" modes.

Each contender lives in its own worker process (so each has its own peak memory, and no thread
pool of one framework sits in the other's process). Each repeat times --steps steps of every
contender in turn, reversing the order on alternate repeats so that machine noise hits all of
them; step times are medians over repeats. Warm-up steps (compilation) are excluded and reported.

MFU is model FLOP/s (maxlm.model.flops: 6N plus attention, the same number for all) over the
measured XLA fp32 matmul peak of this machine (a 1024^3 matmul, best of many probes taken between
repeats). The load average is read before and after; when the machine was busy (load above the
core count before the run, or other processes using more than 10% of the CPUs while timing) the
ratios are not printed as results. The last two lines are
"ratio maxlm/torch_eager tokens_per_s = X" and "ratio maxlm/torch_compile tokens_per_s = Y"
(the faster compile mode), ratios of median tokens/s.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# Measure the maxlm of this checkout, even when pip's editable install points at another one.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab")
SIZES = {
    "3m": (256, 4, 4, 2, 640, 1024),  # 3.3M parameters
    "20m": (384, 8, 6, 2, 1024, 8192),  # 18.9M parameters, 6.3M of them the embedding and head
    "85m": (768, 12, 12, 4, 2048, 8192),  # 88M parameters
    "tiny": (128, 2, 4, 2, 384, 1024),  # a smoke test
}
PEERS = ("torch_eager", "torch_compile", "torch_max_autotune")
COMPILE_MODES = {"torch_compile": None, "torch_max_autotune": "max-autotune"}
PEAK_REPEATS = 10
BUSY_SHARE = 0.10  # other processes' share of the CPUs above which ratios are not results

# The optimizer of every contender; maxlm reads it as an OptimConfig, torch as AdamW arguments.
OPTIM = dict(name="adamw", learning_rate=3e-4, schedule="constant", warmup_steps=0, b1=0.9, b2=0.95,
             eps=1e-8, weight_decay=0.1, grad_clip=1.0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="20m", help="model preset (default: 20m)")
    for field in SIZE_FIELDS:
        p.add_argument(f"--{field}", type=int, help=f"override the preset's {field}")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    p.add_argument("--seq_len", type=int, default=256, help="tokens per sequence (default: 256)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per repeat (default: 3)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per contender (default: 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first, at least 1 (default: 2)")
    p.add_argument("--remat", default="save_dots", choices=("none", "full", "save_dots", "save_named"),
                   help="maxlm's ModelConfig.remat (default: save_dots)")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated PyTorch contenders, any of {', '.join(PEERS)}, or 'none' "
                        f"(default: all)")
    p.add_argument("--allocator", choices=("huge_pages", "default"), default="huge_pages",
                   help="maxlm's malloc setting (default: huge_pages, as python -m maxlm.train runs)")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    for field, value in zip(SIZE_FIELDS, SIZES[args.size]):
        if getattr(args, field) is None:
            setattr(args, field, value)
    if args.steps < 1 or args.repeats < 1 or args.warmup < 1:
        p.error("--steps, --repeats and --warmup must be at least 1")
    args.peers = [] if args.peers == "none" else [x.strip() for x in args.peers.split(",") if x.strip()]
    unknown = sorted(set(args.peers) - set(PEERS))
    if unknown:
        p.error(f"--peers: unknown {', '.join(unknown)}; use any of {', '.join(PEERS)} or none")
    return args


def maxlm_config(args: argparse.Namespace):
    from maxlm import config

    return config.build(
        num_devices=1,
        model=dict(vocab_size=args.vocab, vocab_multiple=128, d_model=args.d_model, n_layers=args.n_layers,
                   n_heads=args.n_heads, n_kv_heads=args.n_kv_heads, d_ff=args.d_ff,
                   max_seq_len=args.seq_len, norm_eps=1e-5, rope_theta=10000.0, dtype="float32",
                   param_dtype="float32", tie_embeddings=False, remat=args.remat),
        mesh=dict(data=1), optim=OPTIM,
        train=dict(global_batch=args.batch, seq_len=args.seq_len, steps=1_000_000))


def random_batch(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """One batch of uniform random tokens (no packing), used by every contender for every step."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq_len + 1), dtype=np.int32)
    positions = np.broadcast_to(np.arange(args.seq_len, dtype=np.int32), (args.batch, args.seq_len))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": np.ones((args.batch, args.seq_len), np.int32),
            "positions": np.ascontiguousarray(positions),
            "weights": np.ones((args.batch, args.seq_len), np.float32)}


class MaxlmRunner:
    """maxlm's real train step (maxlm.train.tasks.lm_steps, state donated) on one CPU device."""

    def __init__(self, args: argparse.Namespace, hf_dir: str | None):
        import jax

        from maxlm import hf
        from maxlm.parallel import sharding
        from maxlm.train import metrics, optim, step, tasks

        self.jax, self.metrics = jax, metrics
        self.cfg = maxlm_config(args)
        self.mesh = sharding.make_mesh(self.cfg.mesh.shape(1), jax.devices()[:1])
        optimizer = optim.make_optimizer(self.cfg.optim, self.cfg.train.steps)
        shardings = step.state_shardings(self.cfg, self.mesh, optimizer)
        # Start from the torch model's weights (saved by save_pretrained, read by maxlm.hf), so
        # every contender trains the same network and their losses can be compared.
        params = hf.params_from_hf(hf_dir, self.cfg.model) if hf_dir else None
        with jax.set_mesh(self.mesh):
            self.state = step.init_state(self.cfg, optimizer, shardings, params)
            self.train_step, _ = tasks.lm_steps(self.cfg, self.mesh, optimizer, shardings)
            self.batch = step.device_batch(random_batch(args), self.mesh, tasks.LM_BATCH)
        self.params = sum(x.size for x in jax.tree.leaves(self.state.params))
        self.info = ""

    def run(self, steps: int) -> float:
        """Run steps; return the last loss once everything has finished."""
        with self.jax.set_mesh(self.mesh):
            for _ in range(steps):
                self.state, out = self.train_step(self.state, self.batch)
            return float(out["loss"])  # waits for the last step

    def peak_flops(self) -> float:
        return self.metrics.measure_peak_flops("float32", repeats=PEAK_REPEATS)


class TorchRunner:
    """LlamaForCausalLM (SDPA attention, train mode) and fused torch.optim.AdamW on all cores,
    eager or under torch.compile(model, mode=...)."""

    def __init__(self, args: argparse.Namespace, hf_dir: str, compile_mode: str | None | bool = False):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        self.torch = torch
        torch.set_num_threads(os.cpu_count())
        torch.manual_seed(0)
        hf_cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.d_ff,
                             num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                             num_key_value_heads=args.n_kv_heads, max_position_embeddings=args.seq_len,
                             rms_norm_eps=1e-5,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                             tie_word_embeddings=False, use_cache=False)
        model = LlamaForCausalLM._from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32)
        if not os.path.exists(os.path.join(hf_dir, "config.json")):
            model.save_pretrained(hf_dir)  # the first torch worker writes the shared initial weights
        else:
            model = LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", dtype=torch.float32)
        model.train()
        named = list(model.named_parameters())
        self.model = model if compile_mode is False else torch.compile(model, mode=compile_mode)
        # maxlm's decay mask (maxlm.train.optim.decay_mask): matrices decay, norm scales do not.
        groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": OPTIM["weight_decay"]},
                  {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
        kwargs = dict(lr=OPTIM["learning_rate"], betas=(OPTIM["b1"], OPTIM["b2"]), eps=OPTIM["eps"])
        try:  # the fused CPU kernel (torch >= 2.4) is the fastest; foreach is the fallback
            self.optimizer = torch.optim.AdamW(groups, fused=True, **kwargs)
            self.info = "fused AdamW"
        except (RuntimeError, TypeError, ValueError):
            self.optimizer = torch.optim.AdamW(groups, foreach=True, **kwargs)
            self.info = "foreach AdamW"
        self.param_list = [p for _, p in named]
        batch = random_batch(args)
        self.inputs = torch.from_numpy(batch["inputs"].astype(np.int64))
        self.targets = torch.from_numpy(batch["targets"].astype(np.int64))
        self.params = sum(p.numel() for p in self.param_list)

    def step(self):
        torch = self.torch
        logits = self.model(input_ids=self.inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 self.targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.param_list, OPTIM["grad_clip"], foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def run(self, steps: int) -> float:
        for _ in range(steps):
            loss = self.step()
        return float(loss.detach())


def _proc_status(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes (0 off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def serve(name: str, args: argparse.Namespace, hf_dir: str, conn) -> None:
    """A contender's worker process: build it, then answer ("run", n) / ("peak",) / ("stats",)."""
    try:
        if name == "maxlm":
            runner = MaxlmRunner(args, hf_dir if os.path.exists(os.path.join(hf_dir, "config.json")) else None)
        else:
            runner = TorchRunner(args, hf_dir, COMPILE_MODES.get(name, False))
        conn.send(("ready", runner.params, runner.info))
        while True:
            cmd, *rest = conn.recv()
            if cmd == "run":
                start = time.perf_counter()
                loss = runner.run(rest[0])
                conn.send((time.perf_counter() - start, loss))
            elif cmd == "peak":
                conn.send(runner.peak_flops())
            elif cmd == "stats":
                t = os.times()
                conn.send({"peak_rss": _proc_status("VmHWM"), "cpu_s": t.user + t.system})
            else:
                return
    except Exception as err:  # report to the parent, which prints one line and exits
        conn.send(("error", f"{type(err).__name__}: {err}"))


class Worker:
    """The parent's handle on a contender's process (spawned, so it starts clean)."""

    def __init__(self, name: str, args: argparse.Namespace, hf_dir: str, env: dict[str, str] | None):
        self.name = name
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        saved = dict(os.environ)
        os.environ.update(env or {})  # the child's environment is fixed when it starts
        try:
            self.proc = ctx.Process(target=serve, args=(name, args, hf_dir, child), daemon=True)
            self.proc.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        reply = self.call()
        self.params, self.info = reply[1], reply[2]

    def call(self, *msg):
        if msg:
            self.conn.send(msg)
        reply = self.conn.recv()
        if isinstance(reply, tuple) and reply[0] == "error":
            sys.exit(f"bench_train: {self.name} failed: {reply[1]}")
        return reply

    def close(self) -> None:
        self.conn.send(("quit",))
        self.proc.join(timeout=30)


def cpu_busy_seconds() -> float | None:
    """Busy CPU seconds of the whole machine since boot, on Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # guest time is already in user
    except OSError:
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def main(argv=None) -> int:
    args = parse_args(argv)
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()
    from maxlm import model
    from maxlm.train import allocator

    flops_per_token = model.flops_per_token(maxlm_config(args).model, args.seq_len)
    tokens_per_step = args.batch * args.seq_len
    maxlm_env = allocator.environment() if args.allocator == "huge_pages" else None
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, "init")
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tmp, "inductor"))  # no stale kernels
        names = args.peers + ["maxlm"]  # a torch worker writes the shared initial weights first
        workers = {n: Worker(n, args, hf_dir, maxlm_env if n == "maxlm" else None) for n in names}
        workers = {n: workers[n] for n in ["maxlm"] + args.peers}
        w0 = workers["maxlm"]
        print(f"model: d_model={args.d_model} layers={args.n_layers} heads={args.n_heads} "
              f"kv_heads={args.n_kv_heads} d_ff={args.d_ff} vocab={args.vocab} untied, "
              f"{w0.params / 1e6:.2f}M parameters; batch {args.batch} x {args.seq_len} tokens; fp32; "
              f"{cores} CPU threads; maxlm remat={args.remat}, malloc "
              f"{'huge pages' if maxlm_env else 'default'}")
        print(f"optimizer: AdamW lr={OPTIM['learning_rate']} betas=({OPTIM['b1']}, {OPTIM['b2']}) "
              f"eps={OPTIM['eps']} weight_decay={OPTIM['weight_decay']} clip={OPTIM['grad_clip']}"
              + "".join(f"; {w.name}: {w.info}" for w in workers.values() if w.info))
        print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} "
              f"({cores} cores); XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)

        warmup = {n: w.call("run", args.warmup)[0] for n, w in workers.items()}  # compiles
        times = {n: [] for n in workers}
        losses, peak = {}, 0.0
        busy_start, cpu_start = cpu_busy_seconds(), {n: w.call("stats")["cpu_s"] for n, w in workers.items()}
        wall_start = time.perf_counter()
        order = list(workers)
        for i in range(args.repeats):
            for n in order if i % 2 == 0 else order[::-1]:
                seconds, losses[n] = workers[n].call("run", args.steps)
                if not math.isfinite(losses[n]):
                    sys.exit(f"bench_train: {n}: loss is {losses[n]} (not finite)")
                times[n].append(seconds / args.steps)
            # The peak probe is short, so a moment of noise can spoil it: keep the best of all.
            peak = max(peak, w0.call("peak"))
            print(f"repeat {i + 1}/{args.repeats}: "
                  + ", ".join(f"{n} {t[-1] * 1e3:.0f} ms/step" for n, t in times.items()), flush=True)
        wall = time.perf_counter() - wall_start
        stats = {n: w.call("stats") for n, w in workers.items()}
        busy_end = cpu_busy_seconds()
        for w in workers.values():
            w.close()
    load_after = os.getloadavg()

    others = None
    if busy_start is not None and busy_end is not None:
        own = sum(stats[n]["cpu_s"] - cpu_start[n] for n in workers)
        others = max((busy_end - busy_start) - own, 0.0) / (wall * cores)
    busy = load_before[0] > cores or (others is not None and others > BUSY_SHARE)

    print()
    header = (f"{'contender':<20}{'warm-up s':>10}{'step ms':>9}{'spread ms':>10}{'tokens/s':>10}"
              f"{'model GF/s':>11}{'MFU':>7}{'peak RSS MiB':>14}{'loss':>9}")
    print(header)
    print("-" * len(header))
    results = {}
    for n in workers:
        step_s = statistics.median(times[n])
        tps = tokens_per_step / step_s
        results[n] = dict(step_s=step_s, tokens_per_s=tps, spread_s=max(times[n]) - min(times[n]),
                          warmup_s=warmup[n], mfu=flops_per_token * tps / peak,
                          peak_rss=stats[n]["peak_rss"], loss=losses[n], times=times[n])
        r = results[n]
        print(f"{n:<20}{r['warmup_s']:>10.1f}{step_s * 1e3:>9.0f}{r['spread_s'] * 1e3:>10.0f}{tps:>10,.0f}"
              f"{flops_per_token * tps / 1e9:>11.1f}{r['mfu']:>7.1%}{r['peak_rss'] / 2**20:>14,.0f}"
              f"{r['loss']:>9.4f}")
    print(f"median (spread = max - min) of {args.repeats} repeats x {args.steps} steps; warm-up = first "
          f"{args.warmup} steps (with compilation); {flops_per_token / 1e6:.1f} MFLOPs/token (6N + "
          f"attention); MFU against the XLA fp32 matmul peak of this machine, {peak / 1e9:.0f} GF/s")
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; other "
          f"processes used {others if others is not None else float('nan'):.0%} of the CPUs while timing")
    ratios = {}
    if "torch_eager" in results:
        ratios["torch_eager"] = results["maxlm"]["tokens_per_s"] / results["torch_eager"]["tokens_per_s"]
    compiled = [n for n in COMPILE_MODES if n in results]
    if compiled:
        best = max(compiled, key=lambda n: results[n]["tokens_per_s"])
        ratios["torch_compile"] = results["maxlm"]["tokens_per_s"] / results[best]["tokens_per_s"]
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            size=args.size, params=w0.params, batch=args.batch, seq_len=args.seq_len,
            flops_per_token=flops_per_token, xla_peak_flops=peak, load_before=load_before,
            load_after=load_after, others=others, busy=busy, results=results, ratios=ratios), indent=1))
    if busy:
        print(f"WARNING: the machine was busy (load {load_before[0]:.2f} before, others "
              f"{others if others is not None else 0:.0%}): other work slows PyTorch's threads more than "
              "XLA's, so no ratio is a result; rerun when the machine is idle")
    for peer, ratio in ratios.items():
        print(f"ratio maxlm/{peer} tokens_per_s = " + ("n/a (busy machine)" if busy else f"{ratio:.3f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
