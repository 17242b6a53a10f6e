"""``python -m maxlm.plan --config=gpt175b.gin --tokens=300e9``: what a run needs, before renting.

From the config alone, in seconds: parameters, FLOPs, per-device memory under the config's mesh,
step time, GPU-hours, days and cost; with ``--aot``, the real ``train_step`` compiled on fake CPU
devices shaped like that mesh, and XLA's memory analysis printed next to the estimate.

FLOPs follow ``maxlm.model.flops.flops_per_token`` (PaLM appendix B, the function training's MFU
uses): 6N per token counts the forward (2N) and the backward (4N) matmuls once each, so the
popular "6 x params x seq_len per sequence, x 2 for the backward" counts the backward twice.
For GPT-3 175B and 300B tokens, 6ND = 3.14e23 (Brown et al. 2020); attention's 12.L.H.Q.T adds
2.8% at sequence 2048. Memory comes from ``maxlm.plan.memory``: device bytes (``total``, what must
fit the GPU) and, with host offload (``OptimConfig.offload_state`` / ``offload_params``), the host
memory per device that the offloaded state takes (``host``).

The mesh's divisibility rules are ``maxlm.config.mesh_problem`` (derived from ``maxlm.rules``), and
a pipeline's bubble is ``maxlm.parallel.pipeline_parallel.bubble_fraction`` of MeshConfig.pipeline,
pipeline_microbatches and pipeline_repeats: the numbers training checks and prints.

``--json`` prints one object with these keys (bytes are per device; FLOPs are totals):
  config, gpu, gpu_name, gpus, mesh {data, fsdp, tensor, pipeline},
  params, matmul_params, n_layers, seq_len, global_batch, microbatches, tokens_per_step, tokens,
  steps, flops_per_token, attention_flops_per_token, recompute_flops_per_token,
  model_flops_6nd (6 x params x tokens), flops_with_attention (flops_per_token x tokens),
  memory {params, grads, optimizer, activations, workspace, total, host}, memory_detail {...},
  gpu_memory_bytes, fits, suggestions [{change, bindings, gpus, total_bytes, note}],
  peak_flops_per_gpu, mfu, pipeline_bubble, step_time_s, tokens_per_s, gpu_hours, days,
  price_per_gpu_hour, cost_usd, warnings [...], notes [...],
  and with --aot: aot {devices, layers_compiled, extrapolated, compile_s, xla_options,
  argument_bytes, output_bytes, alias_bytes, temp_bytes, generated_code_bytes, total_bytes,
  estimate_total_bytes, ratio (XLA total / estimate), ratio_without_cpu_upcast,
  cpu_fp32_upcast_bytes, estimate_state_bytes, estimate_temp_bytes, notes [...]}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from typing import Any, Sequence

from maxlm.hardware import GPUS  # per GPU: peak FLOP/s, memory, assumed price (override it)
from maxlm import config  # no jax here: --aot must set XLA_FLAGS before jax starts

JSON_KEYS = (
    "config", "gpu", "gpu_name", "gpus", "mesh", "params", "matmul_params", "n_layers", "seq_len",
    "global_batch", "microbatches", "tokens_per_step", "tokens", "steps", "flops_per_token",
    "attention_flops_per_token", "recompute_flops_per_token", "model_flops_6nd", "flops_with_attention",
    "memory", "memory_detail", "gpu_memory_bytes", "fits", "suggestions", "peak_flops_per_gpu", "mfu",
    "pipeline_bubble", "step_time_s", "tokens_per_s", "gpu_hours", "days", "price_per_gpu_hour",
    "cost_usd", "warnings", "notes")  # and "aot" with --aot
# XLA:CPU (no native bf16 arithmetic) hoists an fp32 copy of every bf16 stacked activation out of
# the backward loop; a GPU compile does not. Turning that one pass off makes the CPU buffer
# assignment a faithful stand-in for the GPU's (see --aot_stock_xla).
AOT_XLA_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
EPILOG = """examples:
  python -m maxlm.plan --config=gpt175b.gin --tokens=300e9 --gpu=h100
  python -m maxlm.plan --config=llama3_8b.gin --gpus=64 --json
  python -m maxlm.plan --config=llama3_1b.gin --aot            # compile on 8 fake CPU devices
  python -m maxlm.plan --config=gpt175b.gin --aot --aot_layers=4   # 4 and 8 layers, scaled to 96

--gpus defaults to the product of the config's mesh degrees, times 8 where one degree is -1.
A pipeline (MeshConfig.pipeline > 1) is planned as training runs it: its bubble, printed as
training prints it, and its live activations follow MeshConfig.pipeline_microbatches and
MeshConfig.pipeline_repeats. Mistakes in options or config print one line and exit with status 2.
Nothing is written: the plan goes to stdout."""
GB = 1e9
HEADROOM = 0.9  # a suggested change must leave 10% of the GPU for XLA's workspace and fragmentation


class _Parser(argparse.ArgumentParser):
    """A mistake in the arguments is one line on stderr (not the usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"maxlm.plan: error: {' '.join(message.split())} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        for key, value in vars(parsed).items():
            # Python 3.11's argparse turns "--tokens=--" into [] (and appends [] to a list option)
            items = value if key == "gin_bindings" else [value]
            if any(isinstance(v, list) for v in items):
                self.error(f"argument --{key}: '--' is not a value")
        return parsed


def _number(kind: type, allowed: str, ok: Any) -> Any:
    """An argparse type: a finite ``kind`` for which ``ok(value)`` holds; ``allowed`` says which."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
            good = math.isfinite(value) and ok(value)
        except (TypeError, ValueError, OverflowError):  # not a number, or an int beyond float
            good = False
        if not good:
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed (expected {allowed})")
        return value
    return parse


def _text(what: str) -> Any:
    """An argparse type that refuses an empty or blank value."""
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"an empty value is not allowed (expected {what})")
        return text
    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Every option checked here, one line naming it, its value and what is allowed (exit 2). The
    upper bounds of --tokens and --price_per_gpu_hour lie far beyond any real run (Llama 3: 15e12
    tokens), so that a typo is refused instead of planned as an overflowing cost."""
    description = ("Plan a training run from its config: parameters, FLOPs, per-device memory under "
                   "the mesh, step time, GPU-hours, days and cost; --aot also compiles the real "
                   "train_step on fake CPU devices and sets XLA's memory analysis beside the estimate.")
    p = _Parser(prog="python -m maxlm.plan", description=description, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny.gin", type=_text("a gin file, or a bare name in configs/"),
                   help="gin file, or a bare name in configs/")
    p.add_argument("--gin_bindings", action="append", default=[], metavar="BINDING",
                   type=_text("a binding such as 'TrainConfig.steps = 100'"),
                   help="override one field, e.g. 'ModelConfig.remat=\"full\"' (repeatable)")
    p.add_argument("--tokens", type=_number(float, "a number in (0, 1e18]", lambda x: 0 < x <= 1e18),
                   metavar="N",
                   help="training tokens, e.g. 300e9 (default: steps x global_batch x seq_len)")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="GPU type (default: h100)")
    p.add_argument("--gpus", type=_number(int, "an integer >= 1", lambda x: x >= 1), metavar="N",
                   help="GPU count; resolves a -1 mesh degree (default: see below)")
    p.add_argument("--mfu", type=_number(float, "a fraction in (0, 1]", lambda x: 0 < x <= 1),
                   default=0.45, metavar="FRACTION", help="assumed model FLOPs utilisation (default: 0.45)")
    p.add_argument("--price_per_gpu_hour", metavar="USD",
                   type=_number(float, "a number in [0, 10000]", lambda x: 0 <= x <= 1e4),
                   help="US$ per GPU-hour (default: an assumed on-demand price per GPU type)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--aot", action="store_true",
                   help="also compile the real train_step on fake CPU devices shaped like the mesh")
    p.add_argument("--aot_layers", type=_number(int, "0 (all layers) or an integer >= 2 (a one-layer scan "
                                                "compiles differently)", lambda x: x == 0 or x >= 2),
                   default=0, metavar="K",
                   help="with --aot: compile K and 2K layers and scale to n_layers (default: all layers)")
    p.add_argument("--aot_stock_xla", action="store_true",
                   help="with --aot: keep XLA:CPU's default passes (adds CPU-only fp32 copies)")
    return p.parse_args(argv)


def default_gpus(mesh: config.MeshConfig) -> int:
    degrees = [mesh.data, mesh.fsdp, mesh.tensor, mesh.pipeline]
    fixed = math.prod(d for d in degrees if d > 0)
    return fixed * 8 if -1 in degrees else fixed


def resolve(args: argparse.Namespace) -> tuple[config.Config, dict[str, int]]:
    """The config and its mesh degrees on --gpus devices; ConfigError on any inconsistency."""
    cfg = config.load(args.config, args.gin_bindings)
    gpus = args.gpus or default_gpus(cfg.mesh)
    try:
        degrees = cfg.mesh.shape(gpus)
    except config.ConfigError as err:
        raise config.ConfigError(f"{cfg.source}: {err}") from None
    return cfg.replace(mesh=degrees), degrees


def validate(cfg: config.Config, degrees: dict[str, int]) -> None:
    """config.validate for a GPU plan on a mesh of ``degrees``: the config's own checks (cudnn
    allowed: planning needs no GPU), then ``config.mesh_problem``, the divisibility rules that
    training checks (derived from ``maxlm.rules``)."""
    config.validate(cfg.replace(model={"attention_impl": "xla"}) if cfg.model.attention_impl == "cudnn"
                    else cfg)
    problem = config.mesh_problem(cfg, degrees)
    if problem:
        raise config.ConfigError(f"{cfg.source}: {problem}")


def recompute_flops_per_token(m: config.ModelConfig, seq_len: int) -> float:
    """Extra forward work the remat policy redoes in the backward (not counted in MFU)."""
    from maxlm.model import flops as metrics

    attn_fwd = 4.0 * m.n_layers * m.n_heads * m.dim_per_head * seq_len
    if m.remat == "full":
        return 2.0 * metrics.matmul_params(m) + attn_fwd
    return attn_fwd if m.remat in ("save_dots", "save_named") else 0.0


def pipeline_bubble(cfg: config.Config, degrees: dict[str, int]) -> float:
    """The idle fraction of the pipeline, as training computes and prints it (0 without one)."""
    from maxlm.parallel import pipeline_parallel

    return pipeline_parallel.bubble_fraction(degrees["pipeline"], cfg.mesh.pipeline_microbatches,
                                             cfg.mesh.pipeline_repeats)


def timing(cfg: config.Config, degrees: dict[str, int], gpu: dict, mfu: float) -> dict[str, float]:
    from maxlm.model import flops as metrics

    tc, gpus = cfg.train, math.prod(degrees.values())
    tokens_per_step = tc.global_batch * tc.seq_len
    bubble = pipeline_bubble(cfg, degrees)
    step_time = (metrics.flops_per_token(cfg.model, tc.seq_len) * tokens_per_step
                 / (mfu * gpu["peak_flops"] * gpus) / (1 - bubble))
    return {"pipeline_bubble": bubble, "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time}


def memory(cfg: config.Config, degrees: dict[str, int]) -> dict[str, Any]:
    from maxlm.plan import memory as plan_memory

    return plan_memory.memory(cfg, degrees)


def effective_remat(cfg: config.Config, degrees: dict[str, int]) -> str:
    from maxlm.plan import memory as plan_memory

    return plan_memory.effective_remat(cfg, degrees)


def _divisors(n: int) -> list[int]:
    return [k for k in range(2, n + 1) if n % k == 0]


def _pipeline_microbatches(cfg: config.Config, degrees: dict[str, int]) -> int:
    """For a suggested pipeline: the most pipeline microbatches, up to 4 per stage, that divide the
    rows each data*fsdp shard feeds the model per optimizer microbatch (at least the current)."""
    rows = cfg.train.global_batch // (degrees["data"] * degrees["fsdp"] * cfg.optim.microbatches)
    fitting = [k for k in _divisors(rows) if k <= 4 * degrees["pipeline"]]
    return max([cfg.mesh.pipeline_microbatches, *fitting])


def _fits(cfg: config.Config, degrees: dict[str, int], limit: float) -> tuple[bool, int]:
    try:
        validate(cfg, degrees)
    except config.ConfigError:
        return False, 0
    total = memory(cfg, degrees)["total"]
    return total <= limit, total


def suggestions(cfg: config.Config, degrees: dict[str, int], limit: float) -> list[dict[str, Any]]:
    """For each kind of change (one field; pipeline stages with the pipeline microbatches they
    need), the smallest that brings the per-device total under ``limit``, computed with the same
    memory model; best first (least cost to throughput): cuDNN attention, more microbatches, a
    stronger remat policy, the optimizer state offloaded to host memory, more fsdp or pipeline
    stages out of the data axis, more GPUs into fsdp.
    Which changes are valid is ``validate``'s (and so ``config.mesh_problem``'s) to say."""
    m, out = cfg.model, []

    def consider(change: dict[str, dict], new_degrees: dict[str, int], note: str) -> bool:
        mesh = {**change.get("mesh", {}), **new_degrees}
        others = {k: v for k, v in change.items() if k != "mesh"}
        ok, total = _fits(cfg.replace(**others, mesh=mesh), new_degrees, limit)
        if ok:
            cls = {"model": "ModelConfig", "optim": "OptimConfig", "mesh": "MeshConfig"}
            bindings = [f"{cls[s]}.{k}={v!r}" for s, kv in change.items() for k, v in kv.items()]
            bindings += [f"MeshConfig.{k}={v}" for k, v in new_degrees.items() if v != degrees[k]]
            out.append({"change": ", ".join(bindings), "bindings": bindings,
                        "gpus": math.prod(new_degrees.values()), "total_bytes": total, "note": note})
        return ok

    if m.attention_impl == "xla":
        consider({"model": {"attention_impl": "cudnn"}}, degrees,
                 "cuDNN flash attention: no [heads, T, T] scores in memory, and faster")
    local = cfg.train.global_batch // (degrees["data"] * degrees["fsdp"])
    for micro in _divisors(local):
        if micro > cfg.optim.microbatches and micro % cfg.optim.microbatches == 0 and consider(
                {"optim": {"microbatches": micro}}, degrees,
                "more gradient-accumulation microbatches: same tokens per step, smaller matmuls"):
            break
    current = memory(cfg, degrees)["activations"]
    for policy, note in (("save_dots", "recomputes elementwise ops and attention"),
                         ("save_named", "recomputes elementwise ops, attention and one MLP matmul"),
                         ("full", "recomputes the whole forward: about +33% compute")):
        new = cfg.replace(model={"remat": policy})
        if policy == m.remat or effective_remat(new, degrees) != policy:  # save_dots in a pipeline
            continue
        if memory(new, degrees)["activations"] < current and consider({"model": {"remat": policy}},
                                                                      degrees, note):
            break
    if not cfg.optim.offload_state:
        opt = memory(cfg, degrees)["optimizer"]
        consider({"optim": {"offload_state": True}}, degrees,
                 f"optimizer state in host memory: {opt / GB:.1f} GB per device copied to the GPU and "
                 "back each step, overlapped with compute where XLA can")
    for k in _divisors(degrees["data"]):
        if consider({}, dict(degrees, data=degrees["data"] // k, fsdp=degrees["fsdp"] * k),
                    "ZeRO-3 over more devices: more all-gather/reduce-scatter traffic"):
            break
    for k in _divisors(degrees["data"]):
        staged = dict(degrees, data=degrees["data"] // k, pipeline=degrees["pipeline"] * k)
        micro = _pipeline_microbatches(cfg, staged)
        change = {"mesh": {"pipeline_microbatches": micro}} if micro != cfg.mesh.pipeline_microbatches else {}
        bubble = pipeline_bubble(cfg.replace(mesh={"pipeline_microbatches": micro}), staged)
        if consider(change, staged, f"more pipeline stages, {micro} pipeline microbatches: a "
                                    f"{bubble:.1%} bubble"):
            break
    for k in (2, 4, 8, 16, 32, 64):
        if consider({}, dict(degrees, fsdp=degrees["fsdp"] * k),
                    f"{k}x the GPUs, all into fsdp: same GPU-hours, fewer days"):
            break
    return out


def plan(cfg: config.Config, degrees: dict[str, int], gpu_key: str = "h100", tokens: float | None = None,
         mfu: float = 0.45, price: float | None = None) -> dict[str, Any]:
    """Everything the planner reports, as one JSON-ready dict (keys in the module docstring)."""
    from maxlm import model
    from maxlm.model import flops as metrics

    m, tc, gpu = cfg.model, cfg.train, GPUS[gpu_key]
    gpus = math.prod(degrees.values())
    tokens_per_step = tc.global_batch * tc.seq_len
    tokens = float(tokens if tokens is not None else tc.steps * tokens_per_step)
    params, per_token = model.param_count(m), metrics.flops_per_token(m, tc.seq_len)
    attention = per_token - 6.0 * metrics.matmul_params(m)  # PaLM's 12.L.H.Q.T, from the same function
    mem = memory(cfg, degrees)
    price = GPUS[gpu_key]["price"] if price is None else price
    t = timing(cfg, degrees, gpu, mfu)
    seconds = tokens / t["tokens_per_s"]
    gpu_hours = seconds * gpus / 3600
    warnings, notes = [], []
    fits = mem["total"] <= gpu["memory"]
    if not fits:
        warnings.append(f"per-device total {mem['total'] / GB:.1f} GB exceeds the {gpu['name']}'s "
                        f"{gpu['memory'] / GB:.0f} GB")
    elif mem["total"] > HEADROOM * gpu["memory"]:
        warnings.append(f"per-device total {mem['total'] / GB:.1f} GB is within 10% of the "
                        f"{gpu['memory'] / GB:.0f} GB: little room for XLA's workspace and fragmentation")
    remat = effective_remat(cfg, degrees)
    if remat != m.remat:
        warnings.append(f"ModelConfig.remat = {m.remat!r} recomputes like {remat!r} in a pipeline (its "
                        "stages run under vmap, so every matmul has a batch dimension): use 'save_named'")
    if m.dtype == "float32":
        warnings.append("compute dtype is float32, but the peak FLOP/s are bf16 dense: expect far lower MFU")
    if degrees["pipeline"] > 1:
        mc = cfg.mesh
        notes.append(f"pipeline = {degrees['pipeline']}: GPipe"
                     + (f", circular over {mc.pipeline_repeats} repeats" if mc.pipeline_repeats > 1 else "")
                     + f", {mc.pipeline_microbatches} pipeline microbatch(es) per optimizer microbatch; "
                     f"the step time includes its bubble {t['pipeline_bubble']:.1%}")
    return {
        "config": cfg.source, "gpu": gpu_key, "gpu_name": gpu["name"], "gpus": gpus, "mesh": degrees,
        "params": params, "matmul_params": metrics.matmul_params(m), "n_layers": m.n_layers,
        "seq_len": tc.seq_len, "global_batch": tc.global_batch, "microbatches": cfg.optim.microbatches,
        "tokens_per_step": tokens_per_step, "tokens": tokens, "steps": tokens / tokens_per_step,
        "flops_per_token": per_token, "attention_flops_per_token": attention,
        "recompute_flops_per_token": recompute_flops_per_token(dataclasses.replace(m, remat=remat),
                                                               tc.seq_len),
        "model_flops_6nd": 6.0 * params * tokens, "flops_with_attention": per_token * tokens,
        "memory": {k: v for k, v in mem.items() if k != "detail"}, "memory_detail": mem["detail"],
        "gpu_memory_bytes": gpu["memory"], "fits": fits,
        "suggestions": [] if fits else suggestions(cfg, degrees, HEADROOM * gpu["memory"]),
        "peak_flops_per_gpu": gpu["peak_flops"], "mfu": mfu, **t,
        "gpu_hours": gpu_hours, "days": seconds / 86400, "price_per_gpu_hour": price,
        "cost_usd": gpu_hours * price, "warnings": warnings, "notes": notes,
    }


def _compile(cfg: config.Config, degrees: dict[str, int], stock: bool) -> tuple[dict[str, int], float, int]:
    """Lower and compile the real train_step from abstract shapes on fake CPU devices; returns
    XLA's per-device memory analysis, the compile seconds, and fp32 copies of bf16 layer stacks."""
    import jax
    import jax.numpy as jnp

    from maxlm.parallel import sharding
    from maxlm.train import optim, step, tasks

    n = math.prod(degrees.values())
    mesh = sharding.make_mesh(degrees, jax.devices()[:n])
    optimizer = optim.make_optimizer(cfg.optim, cfg.train.steps)
    shardings = step.state_shardings(cfg, mesh, optimizer)
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        shapes = jax.eval_shape(lambda: step.init_state(cfg, optimizer, shardings))
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             shapes, shardings)
        rows = (cfg.train.global_batch, cfg.train.seq_len)
        batch = {k: jax.ShapeDtypeStruct(rows, jnp.float32 if k == "weights" else jnp.int32,
                                         sharding=sh) for k, sh in step.batch_shardings(tasks.LM_BATCH, mesh).items()}
        train_step, _ = tasks.lm_steps(cfg, mesh, optimizer, shardings)
        compiled = train_step.lower(state, batch).compile(
            compiler_options=None if stock else AOT_XLA_OPTIONS)
    seconds = time.perf_counter() - start
    ma = compiled.memory_analysis()
    stats = {k: int(getattr(ma, f"{k}_size_in_bytes"))
             for k in ("argument", "output", "alias", "temp", "generated_code")}
    upcast = 0
    if stock:  # converts of whole bf16 [n_layers, ...] stacks to fp32, as XLA:CPU emits them
        for dims in set(re.findall(r": bf16\[([\d,]+)\]\) -> f32\[\1\]", compiled.as_text())):
            shape = [int(d) for d in dims.split(",")]
            upcast += 4 * math.prod(shape) if shape[0] == cfg.model.n_layers else 0
    return stats, seconds, upcast


def _check_aot(cfg: config.Config, degrees: dict[str, int], layers: int = 0) -> None:
    """--aot_layers=K compiles K and 2K layers: both must suit the mesh (a pipeline's stages)."""
    if 0 < layers and 2 * layers < cfg.model.n_layers:
        for k in (layers, 2 * layers):
            problem = config.mesh_problem(cfg.replace(model={"n_layers": k}), degrees)
            if problem:
                raise config.ConfigError(f"{cfg.source}: --aot_layers={layers} compiles {k} layers, "
                                         f"but {problem}")


def aot(cfg: config.Config, degrees: dict[str, int], layers: int = 0, stock: bool = False) -> dict[str, Any]:
    """Compile the real train_step on fake CPU devices and set XLA's figures beside the estimate.

    With ``layers`` = K (2 <= K, 2K < n_layers) it compiles K and 2K layers, keeping every other
    shape and the mesh, and scales the per-layer difference up to n_layers."""
    import jax

    n, m, notes = math.prod(degrees.values()), cfg.model, []
    _check_aot(cfg, degrees, layers)
    if jax.device_count() < n:
        raise config.ConfigError(f"--aot needs {n} devices but this process has {jax.device_count()}")
    if m.attention_impl in ("cudnn", "pallas"):
        cfg = cfg.replace(model={"attention_impl": "xla"})
        notes.append(f"compiled with attention_impl = 'xla' ({m.attention_impl}'s GPU kernels do not compile for "
                     "CPU); the estimate beside it is for 'xla' too")
    if layers == 1:
        raise ValueError("compile at least 2 layers: a one-layer scan compiles differently")
    if 0 < layers and 2 * layers < m.n_layers:
        small, s1, u1 = _compile(cfg.replace(model={"n_layers": layers}), degrees, stock)
        large, s2, u2 = _compile(cfg.replace(model={"n_layers": 2 * layers}), degrees, stock)
        scale = (m.n_layers - layers) / layers
        stats = {k: int(small[k] + scale * (large[k] - small[k])) for k in small}
        upcast, seconds, compiled = int(u1 + scale * (u2 - u1)), s1 + s2, [layers, 2 * layers]
        notes.append(f"compiled {layers} and {2 * layers} of {m.n_layers} layers (same mesh and per-device "
                     f"shapes) and scaled the per-layer difference to {m.n_layers} layers")
    else:
        stats, seconds, upcast = _compile(cfg, degrees, stock)
        compiled = [m.n_layers]
    est = memory(cfg, degrees)
    if cfg.optim.offload_state or cfg.optim.offload_params:
        # XLA:CPU has one memory: its analysis counts pinned_host arguments as ordinary ones (its
        # host_* sizes stay 0), so the compiled step is set beside the estimate without offload.
        est = memory(cfg.replace(optim={"offload_state": False, "offload_params": False}), degrees)
        notes.append("host offload compiled too, but XLA:CPU counts host-memory arguments with the device's: "
                     "compared with the estimate without offload (the plan above moves "
                     f"{memory(cfg, degrees)['host'] / GB:.2f} GB per device to the host)")
    total = stats["argument"] + stats["temp"] + stats["output"] - stats["alias"]
    est_state = est["params"] + est["optimizer"]
    est_temp = est["grads"] + est["activations"] + est["workspace"]
    ratio = total / est["total"]
    if stock:
        ratio = (total - upcast) / est["total"]
        notes.append(f"stock XLA:CPU passes: it made {upcast / GB:.2f} GB of fp32 copies of bf16 layer "
                     "stacks, hoisted out of the backward loop (a GPU compile makes none; not all are "
                     f"live at the peak): without them XLA/plan would be at least {ratio:.2f}")
    else:
        notes.append("compiled with --xla_disable_hlo_passes=while-loop-invariant-code-motion so that "
                     "XLA:CPU keeps bf16 activation stacks bf16 as a GPU compile does "
                     "(--aot_stock_xla: without)")
    if not 0.75 <= ratio <= 1.25:
        parts = {"state (arguments vs params + optimizer)": (stats["argument"], est_state),
                 "temporaries (temp vs grads + activations + workspace)":
                     (stats["temp"] - upcast, est_temp)}
        worst = max(parts, key=lambda k: abs(parts[k][0] - parts[k][1]))
        xla, mine = parts[worst]
        notes.append(f"XLA differs from the estimate mostly in {worst}: {xla / GB:.2f} GB vs "
                     f"{mine / GB:.2f} GB; the estimate models a GPU-like schedule, XLA:CPU's buffer "
                     "assignment orders and fuses differently")
    return {"devices": n, "layers_compiled": compiled, "extrapolated": compiled != [m.n_layers],
            "compile_s": seconds, "xla_options": None if stock else AOT_XLA_OPTIONS,
            **{f"{k}_bytes": v for k, v in stats.items()}, "total_bytes": total,
            "estimate_total_bytes": est["total"], "ratio": total / est["total"],
            "ratio_without_cpu_upcast": ratio, "estimate_state_bytes": est_state,
            "estimate_temp_bytes": est_temp, "cpu_fp32_upcast_bytes": upcast, "notes": notes}


def _g(x: float) -> str:
    return f"{x / GB:,.2f} GB"


def format_text(r: dict[str, Any]) -> str:
    mem, d, mesh = r["memory"], r["memory_detail"], r["mesh"]
    attention, six_n = r["attention_flops_per_token"], r["flops_per_token"] - r["attention_flops_per_token"]
    lines = [
        f"maxlm plan: {r['config']} on {r['gpus']} x {r['gpu_name']} "
        f"(mesh {' '.join(f'{k}={v}' for k, v in mesh.items())})",
        f"  parameters    {r['params'] / 1e9:,.3f}B ({r['matmul_params'] / 1e9:,.3f}B in matmuls), "
        f"{r['n_layers']} layers, sequence {r['seq_len']}, {r['tokens_per_step']:,} tokens/step",
        f"  FLOPs/token   {r['flops_per_token']:.4g} = 6N {six_n:.4g} + attention {attention:.4g} "
        f"(+{attention / six_n:.1%}); remat recomputes {r['recompute_flops_per_token']:.3g} more",
        f"  training      {r['tokens']:.4g} tokens = {r['steps']:,.0f} steps: model_flops_6nd "
        f"{r['model_flops_6nd']:.4g}, flops_with_attention {r['flops_with_attention']:.4g}",
        "                (6N per token already counts the backward: 2N forward + 4N backward)",
        f"  memory/device {d['tokens_per_microbatch']:,} tokens per microbatch x {r['microbatches']} "
        "microbatch(es)" + (f", {d['tokens_per_layer_call']:,} per pipeline microbatch"
                            if mesh["pipeline"] > 1 else ""),
        f"    parameters  {_g(mem['params'])}"
        + (f"  (kept in host memory between steps: {_g(d['offloaded_params'])})" if d["offloaded_params"] else ""),
        f"    gradients   {_g(mem['grads'])}"
        + ("  (accumulator + microbatch)" if r["microbatches"] > 1 else ""),
        f"    optimizer   {_g(mem['optimizer'])}"
        + (f"  (+ {_g(d['offloaded_optimizer'])} in host memory)" if d["offloaded_optimizer"] else ""),
        f"    activations {_g(mem['activations'])}  (saved {_g(d['saved_activations'])}, peak at the "
        f"{d['peak_at'].replace('_', ' ')})",
        f"    workspace   {_g(mem['workspace'])}  (gathered embedding and its gradient, one gathered "
        "layer)",
        f"    total       {_g(mem['total'])} of {_g(r['gpu_memory_bytes'])}: "
        + ("fits" if r["fits"] else "DOES NOT FIT")
        + (f" (with {_g(d['offload_transient'])} of offloaded optimizer state brought back for the update)"
           if d["offload_transient"] else ""),
        *([f"    host        {_g(mem['host'])} per device of offloaded state (pinned host memory)"]
          if mem["host"] else []),
        f"  time          at {r['mfu']:.0%} MFU of {r['peak_flops_per_gpu'] / 1e12:,.0f} TFLOP/s: step "
        f"{r['step_time_s']:.3g} s, {r['tokens_per_s']:,.0f} tokens/s"
        + (f", pipeline bubble {r['pipeline_bubble']:.1%}" if mesh["pipeline"] > 1 else ""),
        f"  cost          {r['gpu_hours']:,.0f} GPU-hours, {r['days']:,.1f} days on {r['gpus']} GPUs, "
        f"${r['cost_usd']:,.0f} at ${r['price_per_gpu_hour']:.2f}/GPU-hour",
    ]
    lines += [f"  warning: {w}" for w in r["warnings"]] + [f"  note: {n}" for n in r["notes"]]
    for i, s in enumerate(r["suggestions"]):
        lines.append(f"  {'suggestion' if i == 0 else 'or':>10}: {s['change']} -> {_g(s['total_bytes'])} "
                     f"per device on {s['gpus']} GPUs ({s['note']})")
    if not r["fits"] and not r["suggestions"]:
        lines.append("  no single change tried (cudnn attention, microbatches, remat, optimizer offload, "
                     "fsdp, pipeline, up to 64x the GPUs) fits")
    if "aot" in r:
        a = r["aot"]
        lines += [
            f"  --aot         train_step compiled for {a['devices']} fake CPU devices, layers "
            f"{'+'.join(map(str, a['layers_compiled']))}, in {a['compile_s']:.1f} s; per device:",
            f"    XLA  arguments {_g(a['argument_bytes'])}, temp {_g(a['temp_bytes'])}, output "
            f"{_g(a['output_bytes'])} ({_g(a['alias_bytes'])} aliased to donated arguments), "
            f"code {_g(a['generated_code_bytes'])} -> total {_g(a['total_bytes'])}",
            f"    plan state {_g(a['estimate_state_bytes'])}, temporaries {_g(a['estimate_temp_bytes'])} "
            f"-> total {_g(a['estimate_total_bytes'])}; XLA/plan = {a['ratio']:.2f}",
        ]
        lines += [f"    note: {n}" for n in a["notes"]]
    return "\n".join(lines)


def _ensure_devices(n: int, argv: list[str]) -> int | None:
    """Make n fake CPU devices available: set XLA_FLAGS if jax has not started, else rerun this
    command in a child process that sets them. Returns the child's exit status, or None."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    flags = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    if "jax" not in sys.modules:
        os.environ.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
        return None
    import jax

    if jax.default_backend() == "cpu" and jax.device_count() >= n:
        return None
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "maxlm.plan", *argv], env=env).returncode


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        cfg, degrees = resolve(args)
        if args.aot:
            _check_aot(cfg, degrees, args.aot_layers)
            rc = _ensure_devices(math.prod(degrees.values()), argv)
            if rc is not None:
                return rc
        validate(cfg, degrees)
        result = plan(cfg, degrees, args.gpu, args.tokens, args.mfu, args.price_per_gpu_hour)
        if args.aot:
            result["aot"] = aot(cfg, degrees, args.aot_layers, args.aot_stock_xla)
    except config.ConfigError as err:
        print(f"maxlm.plan: config error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else format_text(result))
    return 0
