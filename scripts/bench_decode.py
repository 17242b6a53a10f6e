"""Decode throughput of maxlm's generation against Hugging Face ``generate`` on PyTorch, same run.

    python scripts/bench_decode.py                       # ~19M Llama, batch 1 and 8, 64 + 128 tokens
    python scripts/bench_decode.py --size tiny --new-tokens 16 --repeats 1    # smoke run
    python scripts/bench_decode.py --batches 8 --json out.json

Both contenders generate greedily from the same weights (maxlm's random init, exported with
maxlm.hf.export_params and loaded by transformers' LlamaForCausalLM, eager attention), the same
random prompts (every row --prompt-len tokens) and --new-tokens new tokens, with a KV cache, in fp32,
each in its own worker process pinned to --threads CPUs (torch.set_num_threads as well). maxlm runs
``maxlm.infer.generate.run``: one jitted prefill, then the whole decode as one jitted while_loop
over the donated cache (no host round trip per token). Hugging Face runs ``model.generate``
(DynamicCache); its prefill is timed as one forward over the prompt, and its decode as the rest of
``generate``. Decode tokens/s counts the tokens of decode steps: batch x (new_tokens - 1).

Each repeat runs every batch size on both contenders, alternating their order; figures are medians
over repeats; compilation (maxlm) and a warm-up generate (torch) come first and are not timed. The
load average is read before and after, and the CPU time of other processes while timing; on a busy
machine no ratio is printed as a result. The last line is
"ratio maxlm/torch decode_tokens_per_s = X" at the largest batch.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SIZE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab")
SIZES = {
    "20m": (384, 8, 6, 2, 1024, 8192),  # 18.9M parameters, as bench_train's 20m
    "tiny": (128, 2, 4, 2, 384, 1024),  # a smoke test
}
BUSY_SHARE = 0.10  # other processes' share of the CPUs above which ratios are not results


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="20m", help="model preset (default: 20m)")
    for field in SIZE_FIELDS:
        p.add_argument(f"--{field}", type=int, help=f"override the preset's {field}")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default: 1,8)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per row (default: 64)")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per row (default: 128)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (default: 3)")
    p.add_argument("--threads", type=int, default=2, help="CPUs per contender (default: 2)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    for field, value in zip(SIZE_FIELDS, SIZES[args.size]):
        if getattr(args, field) is None:
            setattr(args, field, value)
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches {args.batches!r}: not a comma-separated list of integers")
    if min(args.batches) < 1 or args.prompt_len < 1 or args.new_tokens < 2 or args.repeats < 1 or args.threads < 1:
        p.error("--batches, --prompt-len, --repeats and --threads must be >= 1, --new-tokens >= 2")
    return args


def model_config(args):
    from maxlm.config import ModelConfig

    return ModelConfig(vocab_size=args.vocab, vocab_multiple=128, d_model=args.d_model, n_layers=args.n_layers,
                       n_heads=args.n_heads, n_kv_heads=args.n_kv_heads, d_ff=args.d_ff,
                       max_seq_len=max(256, args.prompt_len + args.new_tokens), norm_eps=1e-5, rope_theta=10000.0,
                       dtype="float32", param_dtype="float32", tie_embeddings=False, remat="none")


def prompts(args, batch: int) -> np.ndarray:
    return np.random.default_rng(batch).integers(0, args.vocab, (batch, args.prompt_len), dtype=np.int32)


class MaxlmRunner:
    """maxlm.infer.generate.run on one CPU device; writes the shared weights as a HF directory."""

    def __init__(self, args, hf_dir: str):
        import jax
        from safetensors.numpy import save_file

        from maxlm import hf, model
        from maxlm.infer import generate
        from maxlm.infer.placement import inference_mesh, param_shardings

        self.args, self.generate = args, generate
        self.cfg = model_config(args)
        self.mesh = inference_mesh(1)
        params = model.init_params(self.cfg, jax.random.PRNGKey(0))
        self.params = jax.device_put(params, param_shardings(self.cfg, self.mesh))
        os.makedirs(hf_dir, exist_ok=True)
        save_file(hf.export_params(jax.device_get(params), self.cfg, "llama"), os.path.join(hf_dir, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            json.dump(hf.config_to_hf(self.cfg, "llama"), f)
        self.count = sum(x.size for x in jax.tree.leaves(params))

    def run(self, batch: int):
        r = self.generate.run(self.cfg, self.params, list(prompts(self.args, batch)), self.args.new_tokens,
                              mesh=self.mesh)
        return r.prefill_s, r.decode_s, np.stack(r.tokens)


class TorchRunner:
    """transformers' LlamaForCausalLM.generate (greedy, KV cache) on the same weights."""

    def __init__(self, args, hf_dir: str):
        import torch
        from transformers import LlamaForCausalLM

        torch.set_num_threads(args.threads)
        self.torch, self.args = torch, args
        self.model = LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # random weights: always all new tokens
        self.model.generation_config.pad_token_id = 0
        self.count = sum(p.numel() for p in self.model.parameters())

    def run(self, batch: int):
        torch = self.torch
        ids = torch.from_numpy(prompts(self.args, batch).astype(np.int64))
        with torch.inference_mode():
            start = time.perf_counter()
            self.model(input_ids=ids, use_cache=True)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.args.new_tokens,
                                      do_sample=False, use_cache=True)
            total = time.perf_counter() - start
        return prefill, total - prefill, out[:, ids.shape[1]:].numpy()


def serve(name: str, args, hf_dir: str, conn) -> None:
    try:
        if hasattr(os, "sched_setaffinity"):
            cpus = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, cpus[:args.threads])  # before jax or torch size their pools
        runner = MaxlmRunner(args, hf_dir) if name == "maxlm" else TorchRunner(args, hf_dir)
        conn.send(("ready", runner.count))
        while True:
            cmd, *rest = conn.recv()
            if cmd != "run":
                return
            conn.send(runner.run(rest[0]))
    except Exception as err:  # noqa: BLE001 - reported by the parent in one line
        conn.send(("error", f"{type(err).__name__}: {err}"))


class Worker:
    def __init__(self, name: str, args, hf_dir: str):
        ctx = multiprocessing.get_context("spawn")
        self.name, (self.conn, child) = name, ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(name, args, hf_dir, child), daemon=True)
        self.proc.start()
        self.count = self.call()[1]

    def call(self, *msg):
        if msg:
            self.conn.send(msg)
        reply = self.conn.recv()
        if isinstance(reply, tuple) and isinstance(reply[0], str) and reply[0] == "error":
            sys.exit(f"bench_decode: {self.name} failed: {reply[1]}")
        return reply

    def close(self):
        self.conn.send(("quit",))
        self.proc.join(timeout=30)


def main(argv=None) -> int:
    from bench_train import cpu_busy_seconds

    args = parse_args(argv)
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, "hf")
        workers = {"maxlm": Worker("maxlm", args, hf_dir)}  # writes the weights torch loads
        workers["torch"] = Worker("torch", args, hf_dir)
        print(f"model: d_model={args.d_model} layers={args.n_layers} heads={args.n_heads} kv_heads={args.n_kv_heads} "
              f"d_ff={args.d_ff} vocab={args.vocab} untied, {workers['maxlm'].count / 1e6:.2f}M parameters; "
              f"prompt {args.prompt_len} + {args.new_tokens} new tokens, greedy, fp32, KV cache; "
              f"{args.threads} CPU threads each")
        print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} ({cores} cores)",
              flush=True)
        tokens = {}
        for b in args.batches:  # warm-up: compiles maxlm's bucket, warms torch's allocator
            for n, w in workers.items():
                tokens[n, b] = w.call("run", b)[2]
        times = {(n, b): [] for n in workers for b in args.batches}
        busy_start, wall_start = cpu_busy_seconds(), time.perf_counter()
        order = list(workers)
        for i in range(args.repeats):
            for b in args.batches:
                for n in order if i % 2 == 0 else order[::-1]:
                    prefill, decode, _ = workers[n].call("run", b)
                    times[n, b].append((prefill, decode))
            print(f"repeat {i + 1}/{args.repeats}: " + ", ".join(
                f"{n} b{b} decode {times[n, b][-1][1] * 1e3:.0f} ms" for n in workers for b in args.batches), flush=True)
        wall = time.perf_counter() - wall_start
        busy_end = cpu_busy_seconds()
        for w in workers.values():
            w.close()
    load_after = os.getloadavg()
    # Other processes' share of the CPUs while timing: all busy time minus what ours could use.
    others = None
    if busy_start is not None and busy_end is not None:
        others = max((busy_end - busy_start) - args.threads * wall, 0.0) / (wall * cores)
    busy = load_before[0] > cores or (others is not None and others > BUSY_SHARE)

    print()
    header = f"{'contender':<10}{'batch':>6}{'prefill ms':>11}{'prefill tok/s':>14}{'decode ms':>10}{'decode tok/s':>13}{'same tokens':>12}"
    print(header)
    print("-" * len(header))
    results = {}
    for b in args.batches:
        same = float(np.mean(tokens["maxlm", b] == tokens["torch", b]))
        for n in workers:
            prefill = statistics.median(t[0] for t in times[n, b])
            decode = statistics.median(t[1] for t in times[n, b])
            r = results[f"{n}_b{b}"] = dict(prefill_s=prefill, decode_s=decode,
                                             prefill_tokens_per_s=b * args.prompt_len / prefill,
                                             decode_tokens_per_s=b * (args.new_tokens - 1) / decode,
                                             same_tokens=same, times=times[n, b])
            print(f"{n:<10}{b:>6}{prefill * 1e3:>11.1f}{r['prefill_tokens_per_s']:>14,.0f}{decode * 1e3:>10.0f}"
                  f"{r['decode_tokens_per_s']:>13,.0f}{same:>12.1%}")
    print(f"medians of {args.repeats} repeats; decode tokens = batch x {args.new_tokens - 1}; same tokens: "
          "share of greedy tokens equal between the two (fp32 argmax near-ties may differ)")
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; other processes "
          f"used {others if others is not None else float('nan'):.0%} of the CPUs while timing")
    top = max(args.batches)
    ratio = results[f"maxlm_b{top}"]["decode_tokens_per_s"] / results[f"torch_b{top}"]["decode_tokens_per_s"]
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), load_before=load_before, load_after=load_after,
                                                   others=others, busy=busy, results=results, ratio=ratio), indent=1))
    if busy:
        print(f"WARNING: the machine was busy (load {load_before[0]:.2f} before, others "
              f"{others if others is not None else 0:.0%}), so no ratio is a result; rerun when it is idle")
    print("ratio maxlm/torch decode_tokens_per_s = " + ("n/a (busy machine)" if busy else f"{ratio:.3f}")
          + ("" if top == 8 else f" (batch {top})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
