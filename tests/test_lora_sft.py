"""LoRA and QLoRA runs through the shared loop (issue 15, items 2 and 5): a rank-8 LoRA SFT reaches
the exact-match bar within a few points of full SFT from the same base, QLoRA over an INT4 base
trains with the base stored at its INT4 size, and a LoRA run killed with SIGKILL resumes exactly."""

import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from test_resilience import ENV, logged_step, losses, wait_for

from maxlm import config
from maxlm.model import lora

ROOT = Path(__file__).resolve().parents[1]


def _sft(run_dir: Path, *bindings: str, config_file: str = "sft_tiny.gin", check: bool = True) -> str:
    cmd = [sys.executable, "-m", "maxlm.sft", f"--config={config_file}", f"--run_dir={run_dir}",
           "--gin_bindings=TrainConfig.peak_flops=1e12", *[f"--gin_bindings={b}" for b in bindings]]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


RESUME = ["ModelConfig.lora_rank=4", "ModelConfig.lora_dropout=0.1", "TrainConfig.steps=16", "TrainConfig.log_every=1",
          "TrainConfig.eval_every=1000", "SFTConfig.eval_prompts=0", "CheckpointConfig.every_steps=4",
          "CheckpointConfig.max_to_keep=10", "SFTConfig.data='synthetic:upper:400'"]


@pytest.mark.slow
def test_lora_run_killed_with_sigkill_resumes_bitwise(tmp_path):
    """Adapters, their optimizer state, the dropout keys and the SFT data iterator all come back."""
    straight = tmp_path / "straight"
    _sft(straight, *RESUME)
    reference = losses(straight)
    assert sorted(reference) == list(range(1, 17))
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "maxlm.sft", "--config=sft_tiny.gin", f"--run_dir={killed}",
           "--gin_bindings=TrainConfig.peak_flops=1e12", *[f"--gin_bindings={b}" for b in RESUME]]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    wait_for(lambda: logged_step(killed) >= 9 and (killed / "checkpoints/8/manifest.json").exists(), proc)
    proc.kill()
    proc.wait()
    output = _sft(killed, *RESUME)
    assert "resuming from" in output
    assert losses(killed) == reference


BASE = ["ModelConfig.tie_embeddings=True", "TrainConfig.steps=1000", "TrainConfig.eval_every=500", "SFTConfig.eval_prompts=0"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """configs/lora_tiny.gin's base: full SFT on uppercasing words (tied embeddings, 1000 steps)."""
    run = tmp_path_factory.mktemp("lora") / "sft_upper"
    _sft(run, *BASE)
    return run


def _exact_match(run_dir: Path, held):
    from maxlm.hf.load import load_model
    from maxlm.posttrain import sft

    loaded = load_model(run_dir)
    cfg = config.load("lora_tiny.gin", num_devices=jax.device_count()).replace(model=vars(loaded.cfg))
    return sft.exact_match(cfg, loaded.params, held)


@pytest.mark.slow
def test_lora_sft_learns_the_task_beside_full_sft(base_run, tmp_path):
    from maxlm.posttrain import sft

    cfg = config.load("lora_tiny.gin", num_devices=jax.device_count())
    held = sft.load_data(cfg).eval_examples[:100]
    before = _exact_match(base_run, held)
    timings = {}
    for name, extra in (("lora", ()), ("full", ("ModelConfig.lora_rank=0", "OptimConfig.learning_rate=1e-3",
                                                "TrainConfig.steps=500"))):
        start = time.perf_counter()
        out = _sft(tmp_path / name, f"TrainConfig.init_from={str(base_run)!r}", "SFTConfig.eval_prompts=0", *extra,
                   config_file="lora_tiny.gin")
        timings[name] = time.perf_counter() - start
        if name == "lora":
            assert "LoRA rank 8 on attn/q_proj" in out and "LoRA adapters start fresh" in out
    lora_em, full_em = _exact_match(tmp_path / "lora", held), _exact_match(tmp_path / "full", held)
    print(f"\n{cfg.sft.data} from a base that uppercases: base {before}; LoRA rank 8 {lora_em} "
          f"({timings['lora']:.0f} s); full SFT {full_em} ({timings['full']:.0f} s)")
    for prompt, want, got in lora_em.rows[:3]:
        print(f"  {prompt!r} -> {got!r} (wanted {want!r})")
    assert before.score <= 0.05, before.rows[:5]
    # The bar: >= 90%, and rank 8 within a few points of full SFT. Measured: LoRA 100%
    # (2000 steps; 90% at 1000, where it still keeps the base's copying errors), full SFT 100% (500).
    assert lora_em.score >= 0.9, lora_em.rows[:10]
    assert full_em.score >= 0.9, full_em.rows[:10]
    assert lora_em.score >= full_em.score - 0.05, (lora_em, full_em)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_qlora_trains_over_an_int4_base_stored_at_int4_size(base_run, tmp_path):
    from maxlm.hf.load import load_model

    base, q4, qlora = base_run, tmp_path / "base-int4", tmp_path / "qlora"
    proc = subprocess.run([sys.executable, "-m", "maxlm.quantize", "--checkpoint", str(base), "--method", "rtn",
                           "--bits", "4", "--group", "32", "--out", str(q4)], env=ENV, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # QLoRA: the quantized run's own config (its INT4 linear_rules), adapters on every attention and MLP Linear
    out = _sft(qlora, "ModelConfig.lora_rank=8", "ModelConfig.lora_targets='attn/|mlp/'", f"TrainConfig.init_from={str(q4)!r}",
               "TrainConfig.steps=150", "TrainConfig.eval_every=50", "SFTConfig.eval_prompts=0",
               "SFTConfig.data='synthetic:capitalize:4000'", "OptimConfig.learning_rate=1e-2",
               config_file=str(q4 / "config.gin"))
    assert "LoRA adapters start fresh" in out and "frozen base" in out
    evals = [m["eval_loss"] for m in _metrics(qlora) if "eval_loss" in m]
    print(f"\nQLoRA eval loss on reply tokens: {evals[0]:.3f} -> {evals[-1]:.3f}")
    assert evals[-1] < 0.8 * evals[0], evals

    loaded = load_model(qlora)
    cfg = loaded.cfg
    assert cfg.lora_rank == 8 and all(cfg.linear_impl(p) == "int4" for p in cfg.lora_paths())
    dense = load_model(base)
    dense_bytes = lora.base_bytes(dense.params)
    # closed form: each INT4 Linear [K, N] is K N / 2 bytes of nibbles + (K / 32) N fp32 scales
    saved = 0
    for path, (_, k, _) in cfg.linear_inputs().items():
        if cfg.linear_impl(path) != "int4":
            continue
        n = {"attn/q_proj": cfg.n_heads * cfg.dim_per_head, "attn/k_proj": cfg.kv_heads * cfg.dim_per_head,
             "attn/v_proj": cfg.kv_heads * cfg.dim_per_head, "attn/o_proj": cfg.d_model, "mlp/gate_proj": cfg.d_ff,
             "mlp/up_proj": cfg.d_ff, "mlp/down_proj": cfg.d_model}[path]
        saved += cfg.n_layers * (k * n * 4 - (k * n // 2 + (k // 32) * n * 4))
    assert lora.base_bytes(loaded.params) == dense_bytes - saved

    assert saved > 0
    # the adapters trained, and the INT4 base is bit for bit the quantized run's
    quantized = load_model(q4)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                        lora.without_adapters(loaded.params), quantized.params)
    assert all(jax.tree.leaves(same))
    assert any(np.abs(np.asarray(x)).max() > 0 for k, x in lora.adapters(loaded.params).items() if k.endswith("lora_b"))
