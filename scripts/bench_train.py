"""Training throughput of maxlm against Hugging Face transformers on PyTorch, same model, same run.

    python scripts/bench_train.py                 # ~19M-parameter Llama, batch 8 x 256, fp32, CPU
    python scripts/bench_train.py --size tiny --steps 3 --repeats 2   # a quick smoke run

Both frameworks train the same Llama-style model (RMSNorm, RoPE, SwiGLU, grouped-query attention,
untied embeddings) on the same random tokens with AdamW (same betas, eps, weight decay with norms
excluded, learning rate, global-norm clipping) in fp32. Each repeat times ``--steps`` steps of one
framework after the other, alternating which goes first, so machine noise hits both; the
reported step time is the median over repeats. Warm-up steps (compilation for maxlm, allocator
and oneDNN warm-up for torch) are excluded and reported separately.

MFU = flops_per_token (maxlm.metrics, PaLM accounting, identical for both) x tokens/s / peak,
where the peak is each framework's own measured fp32 matmul rate (a 1024^3 matmul, best of a few).
The last line is ``ratio maxlm/torch tokens_per_s = X``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

# name: (d_model, n_layers, n_heads, n_kv_heads, d_ff, vocab)
SIZES = {
    "20m": (384, 8, 6, 2, 1024, 8192),  # 18.9M parameters (6.3M of them embedding and head)
    "tiny": (128, 2, 4, 2, 384, 1024),  # a smoke test
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="20m", help="model preset (default: 20m)")
    p.add_argument("--d_model", type=int, help="override the preset's d_model")
    p.add_argument("--n_layers", type=int, help="override the preset's layer count")
    p.add_argument("--n_heads", type=int, help="override the preset's head count")
    p.add_argument("--n_kv_heads", type=int, help="override the preset's key/value head count")
    p.add_argument("--d_ff", type=int, help="override the preset's MLP width")
    p.add_argument("--vocab", type=int, help="override the preset's vocabulary size")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    p.add_argument("--seq_len", type=int, default=256, help="tokens per sequence (default: 256)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per repeat (default: 5)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per framework (default: 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: 2)")
    p.add_argument("--remat", default="none", choices=("none", "full", "save_dots", "save_named"),
                   help="maxlm's ModelConfig.remat (default: none; torch never recomputes)")
    p.add_argument("--only", choices=("maxlm", "torch"), help="run one framework only (no ratio)")
    args = p.parse_args(argv)
    for field, value in zip(("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab"), SIZES[args.size]):
        if getattr(args, field) is None:
            setattr(args, field, value)
    if min(args.steps, args.repeats, args.warmup + 1) < 1:
        p.error("--steps and --repeats must be at least 1, --warmup at least 0")
    return args


# The optimizer both sides use; maxlm reads it as an OptimConfig, torch as AdamW arguments.
OPTIM = dict(name="adamw", learning_rate=3e-4, schedule="constant", warmup_steps=0, b1=0.9, b2=0.95,
             eps=1e-8, weight_decay=0.1, grad_clip=1.0)


def random_batch(args: argparse.Namespace) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq_len + 1), dtype=np.int32)
    positions = np.broadcast_to(np.arange(args.seq_len, dtype=np.int32), (args.batch, args.seq_len))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": np.ones((args.batch, args.seq_len), np.int32),
            "positions": np.ascontiguousarray(positions),
            "weights": np.ones((args.batch, args.seq_len), np.float32)}


class MaxlmRunner:
    """The real maxlm train step (maxlm.step.compile_steps), state donated, on one CPU device."""

    name = "maxlm"

    def __init__(self, args: argparse.Namespace, batch: dict[str, np.ndarray]):
        import jax

        from maxlm import config, metrics, optim, sharding, step

        self.jax = jax
        devices = jax.devices()[:1]
        self.cfg = config.build(
            num_devices=1,
            model=dict(vocab_size=args.vocab, vocab_multiple=128, d_model=args.d_model,
                       n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                       d_ff=args.d_ff, max_seq_len=args.seq_len, norm_eps=1e-5, dtype="float32",
                       tie_embeddings=False, remat=args.remat),
            mesh=dict(data=1), optim=OPTIM,
            train=dict(global_batch=args.batch, seq_len=args.seq_len, steps=1_000_000))
        self.mesh = sharding.make_mesh(self.cfg.mesh.shape(1), devices)
        optimizer = optim.make_optimizer(self.cfg.optim, self.cfg.train.steps)
        shardings = step.state_shardings(self.cfg, self.mesh, optimizer)
        with jax.set_mesh(self.mesh):
            self.state = step.init_state(self.cfg, optimizer, shardings)
            self.train_step, _ = step.compile_steps(self.cfg, self.mesh, optimizer, shardings)
            self.batch = step.device_batch(batch, self.mesh)
        self.params = sum(x.size for x in jax.tree.leaves(self.state.params))
        self.flops_per_token = metrics.flops_per_token(self.cfg.model, args.seq_len)
        self.peak = metrics.measure_peak_flops("float32")

    def run(self, steps: int) -> float:
        """Run steps and return the last loss, after everything has finished."""
        with self.jax.set_mesh(self.mesh):
            for _ in range(steps):
                self.state, out = self.train_step(self.state, self.batch)
            return float(out["loss"])  # waits for the last step


class TorchRunner:
    """LlamaForCausalLM (sdpa attention) with torch.optim.AdamW, eager, all cores."""

    name = "torch"

    def __init__(self, args: argparse.Namespace, batch: dict[str, np.ndarray], flops_per_token: float):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        self.torch = torch
        torch.set_num_threads(os.cpu_count())
        torch.manual_seed(0)
        hf_cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.d_model,
                             intermediate_size=args.d_ff, num_hidden_layers=args.n_layers,
                             num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                             max_position_embeddings=args.seq_len, rms_norm_eps=1e-5,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                             tie_word_embeddings=False, use_cache=False)
        self.model = LlamaForCausalLM._from_config(hf_cfg, attn_implementation="sdpa",
                                                   dtype=torch.float32)
        self.model.train()
        # maxlm's decay mask: decay matrices, not norm scales.
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": OPTIM["weight_decay"]},
                  {"params": no_decay, "weight_decay": 0.0}]
        kwargs = dict(lr=OPTIM["learning_rate"], betas=(OPTIM["b1"], OPTIM["b2"]), eps=OPTIM["eps"])
        try:  # the fused CPU kernel (torch >= 2.4) is the fastest; foreach is the fallback
            self.optimizer = torch.optim.AdamW(groups, fused=True, **kwargs)
            self.optimizer_kind = "fused"
        except (RuntimeError, TypeError, ValueError):
            self.optimizer = torch.optim.AdamW(groups, foreach=True, **kwargs)
            self.optimizer_kind = "foreach"
        self.params_list = list(self.model.parameters())
        self.inputs = torch.from_numpy(batch["inputs"].astype(np.int64))
        self.targets = torch.from_numpy(batch["targets"].astype(np.int64))
        self.params = sum(p.numel() for p in self.params_list)
        self.flops_per_token = flops_per_token
        self.peak = measure_torch_peak_flops(torch)

    def step(self):
        torch = self.torch
        logits = self.model(input_ids=self.inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 self.targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params_list, OPTIM["grad_clip"], foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def run(self, steps: int) -> float:
        for _ in range(steps):
            loss = self.step()
        return float(loss.detach())


def measure_torch_peak_flops(torch, size: int = 1024, repeats: int = 5) -> float:
    """torch's fp32 matmul peak, measured exactly as maxlm.metrics.measure_peak_flops does."""
    a = torch.ones((size, size), dtype=torch.float32)
    a @ a
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def timed(runner, steps: int) -> float:
    start = time.perf_counter()
    loss = runner.run(steps)
    elapsed = time.perf_counter() - start
    if not math.isfinite(loss):
        sys.exit(f"{runner.name}: loss is {loss} (not finite)")
    return elapsed / steps


def main(argv=None) -> int:
    args = parse_args(argv)
    batch = random_batch(args)
    tokens_per_step = args.batch * args.seq_len

    runners = []
    if args.only != "torch":
        runners.append(MaxlmRunner(args, batch))
    flops_per_token = runners[0].flops_per_token if runners else None
    if args.only != "maxlm":
        if flops_per_token is None:  # torch alone still uses maxlm's FLOP accounting
            from maxlm import config, metrics
            m = config.build(model=dict(vocab_size=args.vocab, vocab_multiple=128, d_model=args.d_model,
                                        n_layers=args.n_layers, n_heads=args.n_heads,
                                        n_kv_heads=args.n_kv_heads, d_ff=args.d_ff,
                                        max_seq_len=args.seq_len)).model
            flops_per_token = metrics.flops_per_token(m, args.seq_len)
        runners.append(TorchRunner(args, batch, flops_per_token))

    print(f"model: d_model={args.d_model} layers={args.n_layers} heads={args.n_heads} "
          f"kv_heads={args.n_kv_heads} d_ff={args.d_ff} vocab={args.vocab}, "
          f"{runners[0].params / 1e6:.2f}M params; batch {args.batch} x {args.seq_len} tokens, fp32, "
          f"{os.cpu_count()} CPU threads")
    print(f"AdamW lr={OPTIM['learning_rate']} betas=({OPTIM['b1']}, {OPTIM['b2']}) eps={OPTIM['eps']} "
          f"wd={OPTIM['weight_decay']} clip={OPTIM['grad_clip']}"
          + (f"; torch optimizer: {runners[-1].optimizer_kind}" if args.only != "maxlm" else ""))
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")

    warmup = {}
    for r in runners:  # the first step compiles (maxlm) or warms allocators and kernels (torch)
        start = time.perf_counter()
        r.run(max(args.warmup, 1))
        warmup[r.name] = time.perf_counter() - start

    times = {r.name: [] for r in runners}
    for i in range(args.repeats):
        order = runners if i % 2 == 0 else runners[::-1]
        for r in order:
            times[r.name].append(timed(r, args.steps))
        print(f"repeat {i + 1}/{args.repeats}: "
              + ", ".join(f"{n} {t[-1] * 1e3:.0f} ms/step" for n, t in times.items()), flush=True)

    print()
    header = f"{'framework':<10}{'params':>9}{'warm-up s':>11}{'step ms':>10}{'tokens/s':>11}{'peak GFLOP/s':>14}{'MFU':>8}"
    print(header)
    print("-" * len(header))
    tokens_per_s = {}
    for r in runners:
        step_s = statistics.median(times[r.name])
        tokens_per_s[r.name] = tokens_per_step / step_s
        mfu = r.flops_per_token * tokens_per_s[r.name] / r.peak
        print(f"{r.name:<10}{r.params / 1e6:>8.2f}M{warmup[r.name]:>11.2f}{step_s * 1e3:>10.1f}"
              f"{tokens_per_s[r.name]:>11,.0f}{r.peak / 1e9:>14.1f}{mfu:>8.1%}")
    print(f"(median of {args.repeats} repeats x {args.steps} steps; warm-up = first {max(args.warmup, 1)} "
          f"step(s), maxlm's includes XLA compilation; FLOPs/token = {flops_per_token:.4g})")
    if len(runners) == 2:
        print(f"ratio maxlm/torch tokens_per_s = {tokens_per_s['maxlm'] / tokens_per_s['torch']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
