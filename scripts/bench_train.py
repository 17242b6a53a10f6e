"""Training throughput of maxlm against Hugging Face transformers on PyTorch, same model, same run.

    python scripts/bench_train.py                 # ~19M-parameter Llama, batch 8 x 256, fp32, CPU
    python scripts/bench_train.py --size tiny --steps 3 --repeats 2   # a quick smoke run

Both frameworks train the same Llama-style model (RMSNorm, RoPE, SwiGLU, grouped-query attention,
untied embeddings) from the same initial weights (torch's, imported with maxlm.hf) on the same
random tokens, with AdamW (same betas, eps, weight decay with norms excluded, learning rate,
global-norm clipping), in fp32 on every CPU core; their final losses agree. maxlm runs its real
jitted train step (maxlm.train.tasks.lm_steps, state donated); torch runs LlamaForCausalLM with SDPA
attention in train mode and the fused AdamW kernel.

Each repeat times --steps steps of one framework, then of the other, alternating which goes
first so that machine noise hits both; step times are medians over repeats. Warm-up steps
(XLA compilation for maxlm) are excluded and reported separately.

MFU = flops_per_token (maxlm.model.flops: PaLM accounting, the same number for both) x tokens/s
divided by a measured fp32 matmul peak: a 1024^3 matmul, best of 10 as
maxlm.train.metrics.measure_peak_flops does, probed after every repeat, best of all. Each framework
gets its own peak ("own"); both also get the larger of the two ("machine"), which is the one to
compare. The last line printed is "ratio maxlm/torch tokens_per_s = X" (of median tokens/s).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# Measure the maxlm of this checkout, even when pip's editable install points at another one.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab")
SIZES = {
    "20m": (384, 8, 6, 2, 1024, 8192),  # 18.9M parameters, 6.3M of them the embedding and head
    "tiny": (128, 2, 4, 2, 384, 1024),  # a smoke test
}
PEAK_REPEATS = 10

# The optimizer of both sides; maxlm reads it as an OptimConfig, torch as AdamW arguments.
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
    p.add_argument("--steps", type=int, default=5, help="timed steps per repeat (default: 5)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per framework (default: 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first, at least 1 (default: 2)")
    # save_dots measured ~5% faster than none on CPU: recomputing norms and activations is cheaper
    # than storing them per layer (scripts/README.md).
    p.add_argument("--remat", default="save_dots", choices=("none", "full", "save_dots", "save_named"),
                   help="maxlm's ModelConfig.remat (default: save_dots)")
    p.add_argument("--only", choices=("maxlm", "torch"), help="run one framework only (no ratio)")
    args = p.parse_args(argv)
    for field, value in zip(SIZE_FIELDS, SIZES[args.size]):
        if getattr(args, field) is None:
            setattr(args, field, value)
    if args.steps < 1 or args.repeats < 1 or args.warmup < 1:
        p.error("--steps, --repeats and --warmup must be at least 1")
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
    """One batch of uniform random tokens (no packing), used by both frameworks for every step."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq_len + 1), dtype=np.int32)
    positions = np.broadcast_to(np.arange(args.seq_len, dtype=np.int32), (args.batch, args.seq_len))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": np.ones((args.batch, args.seq_len), np.int32),
            "positions": np.ascontiguousarray(positions),
            "weights": np.ones((args.batch, args.seq_len), np.float32)}


class MaxlmRunner:
    """maxlm's real train step (maxlm.train.tasks.lm_steps, state donated) on one CPU device."""

    name = "maxlm"

    def __init__(self, args: argparse.Namespace, batch: dict[str, np.ndarray], hf_dir: str | None = None):
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
        # both sides train the same network and their losses can be compared step for step.
        params = hf.params_from_hf(hf_dir, self.cfg.model) if hf_dir else None
        with jax.set_mesh(self.mesh):
            self.state = step.init_state(self.cfg, optimizer, shardings, params)
            self.train_step, _ = tasks.lm_steps(self.cfg, self.mesh, optimizer, shardings)
            self.batch = step.device_batch(batch, self.mesh, tasks.LM_BATCH)
        self.params = sum(x.size for x in jax.tree.leaves(self.state.params))

    def run(self, steps: int) -> float:
        """Run steps; return the last loss once everything has finished."""
        with self.jax.set_mesh(self.mesh):
            for _ in range(steps):
                self.state, out = self.train_step(self.state, self.batch)
            return float(out["loss"])  # waits for the last step

    def peak_flops(self) -> float:
        return self.metrics.measure_peak_flops("float32", repeats=PEAK_REPEATS)


class TorchRunner:
    """LlamaForCausalLM (SDPA attention, train mode) and torch.optim.AdamW, eager, all cores."""

    name = "torch"

    def __init__(self, args: argparse.Namespace, batch: dict[str, np.ndarray]):
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
        self.model = LlamaForCausalLM._from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32)
        self.model.train()
        # maxlm's decay mask (maxlm.train.optim.decay_mask): matrices decay, norm scales do not.
        named = list(self.model.named_parameters())
        groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": OPTIM["weight_decay"]},
                  {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
        kwargs = dict(lr=OPTIM["learning_rate"], betas=(OPTIM["b1"], OPTIM["b2"]), eps=OPTIM["eps"])
        try:  # the fused CPU kernel (torch >= 2.4) is the fastest; foreach is the fallback
            self.optimizer = torch.optim.AdamW(groups, fused=True, **kwargs)
            self.optimizer_kind = "fused"
        except (RuntimeError, TypeError, ValueError):
            self.optimizer = torch.optim.AdamW(groups, foreach=True, **kwargs)
            self.optimizer_kind = "foreach"
        self.param_list = [p for _, p in named]
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

    def peak_flops(self, size: int = 1024) -> float:
        """torch's fp32 matmul peak, measured as maxlm.train.metrics.measure_peak_flops does for JAX."""
        a = self.torch.ones((size, size), dtype=self.torch.float32)
        a @ a
        best = float("inf")
        for _ in range(PEAK_REPEATS):
            start = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - start)
        return 2.0 * size**3 / best


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process), on Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # guest time is already in user
    except OSError:
        return None
    idle = ticks[3] + ticks[4]  # idle + iowait
    own = os.times()
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK"), own.user + own.system


def timed(runner, steps: int) -> tuple[float, float]:
    """(seconds per step, last loss) over steps steps."""
    start = time.perf_counter()
    loss = runner.run(steps)
    elapsed = time.perf_counter() - start
    if not math.isfinite(loss):
        sys.exit(f"{runner.name}: loss is {loss} (not finite)")
    return elapsed / steps, loss


def main(argv=None) -> int:
    args = parse_args(argv)
    from maxlm import model

    batch = random_batch(args)
    tokens_per_step = args.batch * args.seq_len
    flops_per_token = model.flops_per_token(maxlm_config(args).model, args.seq_len)
    runners = []
    with tempfile.TemporaryDirectory() as hf_dir:
        if args.only != "maxlm":
            runners.append(TorchRunner(args, batch))
            runners[-1].model.save_pretrained(hf_dir)
        if args.only != "torch":
            runners.insert(0, MaxlmRunner(args, batch, hf_dir if runners else None))

    print(f"model: d_model={args.d_model} layers={args.n_layers} heads={args.n_heads} "
          f"kv_heads={args.n_kv_heads} d_ff={args.d_ff} vocab={args.vocab} untied, "
          f"{runners[0].params / 1e6:.2f}M parameters; batch {args.batch} x {args.seq_len} tokens; fp32; "
          f"{os.cpu_count()} CPU threads; maxlm remat={args.remat}")
    print(f"optimizer: AdamW lr={OPTIM['learning_rate']} betas=({OPTIM['b1']}, {OPTIM['b2']}) "
          f"eps={OPTIM['eps']} weight_decay={OPTIM['weight_decay']} clip={OPTIM['grad_clip']}"
          + "".join(f"; torch: {r.optimizer_kind}" for r in runners if r.name == "torch"))
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)

    warmup = {}
    for r in runners:  # maxlm compiles on its first step
        start = time.perf_counter()
        r.run(args.warmup)
        warmup[r.name] = time.perf_counter() - start

    times = {r.name: [] for r in runners}
    peaks = {r.name: 0.0 for r in runners}
    losses = {}
    cpu_start, wall_start = cpu_seconds(), time.perf_counter()
    for i in range(args.repeats):
        for r in runners if i % 2 == 0 else runners[::-1]:
            step_s, losses[r.name] = timed(r, args.steps)
            times[r.name].append(step_s)
            # The peak probe is short, so a moment of noise can spoil it: keep the best of all.
            peaks[r.name] = max(peaks[r.name], r.peak_flops())
        print(f"repeat {i + 1}/{args.repeats}: "
              + ", ".join(f"{n} {t[-1] * 1e3:.0f} ms/step" for n, t in times.items()), flush=True)

    # Other jobs on the machine slow torch's OpenMP threads much more than XLA's thread pool,
    # which inflates the ratio: say how busy the machine was besides this benchmark.
    cpu_end, wall = cpu_seconds(), time.perf_counter() - wall_start
    others = None
    if cpu_start and cpu_end:
        others = ((cpu_end[0] - cpu_start[0]) - (cpu_end[1] - cpu_start[1])) / (wall * os.cpu_count())

    machine_peak = max(peaks.values())
    print()
    header = (f"{'framework':<10}{'warm-up s':>10}{'step ms':>9}{'tokens/s':>10}{'peak GF/s':>11}"
              f"{'MFU own':>9}{'MFU machine':>13}{'loss':>9}")
    print(header)
    print("-" * len(header))
    tokens_per_s = {}
    for r in runners:
        step_s = statistics.median(times[r.name])
        tokens_per_s[r.name] = tokens_per_step / step_s
        model_flops = flops_per_token * tokens_per_s[r.name]
        print(f"{r.name:<10}{warmup[r.name]:>10.1f}{step_s * 1e3:>9.0f}{tokens_per_s[r.name]:>10,.0f}"
              f"{peaks[r.name] / 1e9:>11.0f}{model_flops / peaks[r.name]:>9.1%}"
              f"{model_flops / machine_peak:>13.1%}{losses[r.name]:>9.4f}")
    print(f"median of {args.repeats} repeats x {args.steps} steps; warm-up = first {args.warmup} steps "
          f"(maxlm's includes XLA compilation); {flops_per_token / 1e6:.1f} MFLOPs/token; "
          f"machine peak = {machine_peak / 1e9:.0f} GF/s (the larger measured fp32 matmul peak)")
    if others is not None:
        print(f"other processes used {max(others, 0.0):.0%} of the CPUs while timing"
              + ("; WARNING: a busy machine inflates the ratio (torch slows down more), rerun "
                 "when it is idle" if others > 0.1 else ""))
    if len(runners) == 2:
        print(f"ratio maxlm/torch tokens_per_s = {tokens_per_s['maxlm'] / tokens_per_s['torch']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
