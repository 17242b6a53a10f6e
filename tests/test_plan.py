"""The planner: counts equal the real model's, FLOPs match published GPT-3 compute, per-device
state bytes equal the real sharded arrays', suggestions really fit, the mesh rules and the pipeline
bubble are training's own (plan and train print the same bubble), and --aot compiles the real
train_step, pipelined too, with XLA's memory within 25% of the estimate."""

import json
import math
import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from helpers import small_config
from maxlm import config, model
from maxlm.model import flops as metrics
from maxlm.model import lora
from maxlm.parallel import pipeline_parallel, sharding
from maxlm.plan import memory as plan_memory
from maxlm.plan import planner as plan
from maxlm.train import optim, step

CONFIGS = sorted(p.name for p in config.CONFIG_DIR.glob("*.gin"))


def planned(name, bindings=(), gpus=None, **kw):
    args = plan.parse_args([f"--config={name}", *(f"--gin_bindings={b}" for b in bindings),
                            *([f"--gpus={gpus}"] if gpus else [])])
    cfg, degrees = plan.resolve(args)
    plan.validate(cfg, degrees)
    return cfg, degrees, plan.plan(cfg, degrees, **kw)


@pytest.mark.parametrize("name", CONFIGS)
def test_params_and_flops_are_the_models(name):
    cfg, _, result = planned(name)
    real = model.abstract_params(cfg.model)
    assert result["params"] == model.param_count(cfg.model) == sum(x.size for x in jax.tree.leaves(real))
    assert result["flops_per_token"] == metrics.flops_per_token(cfg.model, cfg.train.seq_len)
    assert set(result) == set(plan.JSON_KEYS)
    assert all(key in plan.__doc__ for key in plan.JSON_KEYS), "every JSON key is documented"


def test_gpt3_training_compute_matches_the_published_figure():
    _, _, r = planned("gpt175b.gin", tokens=300e9)
    assert r["model_flops_6nd"] == pytest.approx(3.14e23, rel=0.01)  # Brown et al. 2020, table D.1
    # PaLM's attention term adds ~2.8% at sequence 2048 (12*96*96*128*2048 vs 6*174.6e9).
    assert r["flops_with_attention"] / r["model_flops_6nd"] == pytest.approx(1.028, abs=0.003)
    # The naive "6 x params x seq_len per sequence, x 2 for backward" would be 2x this.
    assert r["flops_with_attention"] < 1.1 * 6 * r["params"] * r["tokens"]
    # Time and cost follow from the FLOPs: GPU-seconds = FLOPs / (MFU x peak).
    gpu_s = r["flops_with_attention"] / (r["mfu"] * r["peak_flops_per_gpu"])
    assert r["gpu_hours"] == pytest.approx(gpu_s / 3600)
    assert r["days"] == pytest.approx(gpu_s / r["gpus"] / 86400)
    assert r["cost_usd"] == pytest.approx(r["gpu_hours"] * r["price_per_gpu_hour"])
    assert r["fits"] and r["mesh"] == {"data": 1, "fsdp": 48, "tensor": 8, "pipeline": 1}


@pytest.mark.parametrize("opt,lora_rank", [("adamw", 0), ("lion", 0), ("adafactor", 0), ("adamw", 8)])
def test_state_bytes_equal_the_real_sharded_state(opt, lora_rank):
    """Per-device parameter and optimizer bytes are those of the real TrainState on 8 devices; with
    LoRA the optimizer state (and the gradients) cover the adapters alone."""
    # Dimensions of 128 and more, so that Adafactor factors its second moments.
    cfg = small_config(model=dict(d_model=128, d_ff=256, lora_rank=lora_rank),
                       mesh=dict(data=1, fsdp=4, tensor=2), optim=dict(name=opt))
    degrees = cfg.mesh.shape(8)
    optimizer = optim.make_optimizer(cfg.optim, cfg.train.steps)
    mesh = sharding.make_mesh(degrees)
    trainable = lora.trainable if lora_rank else None
    shardings = step.state_shardings(cfg, mesh, optimizer, trainable)
    with jax.set_mesh(mesh):
        state = step.init_state(cfg, optimizer, shardings, trainable=trainable)

    def on_device0(tree):
        return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
                   if s.device == jax.devices()[0])
    est = plan_memory.state_bytes(cfg, degrees)
    assert est["params"] == on_device0(state.params)
    assert est["optimizer"] == on_device0(state.opt_state)
    if lora_rank:
        adapters, _ = step.split(state.params, step.trainable_mask(state.params, lora.trainable))
        assert est["grads"] == on_device0(adapters) < est["params"] / 5
        assert 0 <= est["optimizer"] - 2 * est["grads"] <= 64  # two moments of the adapters alone, and a count
        return
    assert est["grads"] == est["params"]
    ratio = est["optimizer"] / est["params"]
    assert {"adamw": 1.9 < ratio <= 2.01, "lion": 0.95 < ratio <= 1.01, "adafactor": ratio < 0.5}[opt]


def test_memory_follows_mesh_remat_and_microbatches():
    cfg, degrees, _ = planned("llama3_8b.gin", ["OptimConfig.microbatches=2"], gpus=64)
    base = plan_memory.memory(cfg, degrees)
    wider = plan_memory.memory(cfg.replace(mesh={"data": 4, "fsdp": 16}), dict(degrees, data=4, fsdp=16))
    assert wider["params"] == pytest.approx(base["params"] / 2, rel=0.01)  # fsdp shards the state
    acts = {r: plan_memory.memory(cfg.replace(model={"remat": r}), degrees)["detail"]["saved_activations"]
            for r in ("none", "save_dots", "save_named", "full")}
    assert acts["none"] > acts["save_dots"] > acts["save_named"] > acts["full"]
    micro = plan_memory.memory(cfg.replace(optim={"microbatches": 4}), degrees)
    assert micro["detail"]["saved_activations"] * 2 == base["detail"]["saved_activations"]
    flash = plan_memory.memory(cfg.replace(model={"attention_impl": "cudnn"}), degrees)
    layer_bwd = "layer_backward_bytes_per_token"  # flash attention keeps no [heads, T, T] scores
    assert flash["detail"][layer_bwd] < base["detail"][layer_bwd] / 10
    assert flash["activations"] < base["activations"]


PIPELINE = ["MeshConfig.fsdp=12", "MeshConfig.pipeline=4", "MeshConfig.pipeline_microbatches=8"]


def test_pipeline_is_planned_as_training_runs_it():
    cfg, degrees, r = planned("gpt175b.gin", PIPELINE)
    flat = plan_memory.state_bytes(*planned("gpt175b.gin")[:2])
    piped = plan_memory.state_bytes(cfg, degrees)
    # Matrices: 4 stages x 12 fsdp shards = 48, as before; per-layer vectors now split 4 ways too.
    assert piped["layer_params"] == pytest.approx(flat["layer_params"], rel=0.02)
    assert piped["layer_params"] < flat["layer_params"]
    # 4 stages, 8 pipeline microbatches: (4 - 1) / (8 + 4 - 1), training's own function.
    assert r["pipeline_bubble"] == pytest.approx(3 / 11) == pipeline_parallel.bubble_fraction(4, 8, 1)
    assert any("pipeline = 4" in n for n in r["notes"])
    assert "pipeline bubble 27.3%" in plan.format_text(r)  # as training's start-up line prints it
    # The bubble comes from the pipeline's microbatches and repeats, not gradient accumulation's.
    for bindings, args in ((["MeshConfig.pipeline_microbatches=2"], (4, 2, 1)),
                           (["MeshConfig.pipeline_repeats=2"], (4, 8, 2)),
                           (["MeshConfig.pipeline_microbatches=2", "MeshConfig.pipeline_repeats=3"],
                            (4, 2, 3)),
                           (["OptimConfig.microbatches=2"], (4, 8, 1))):
        r2 = planned("gpt175b.gin", PIPELINE + bindings)[2]
        assert r2["pipeline_bubble"] == pipeline_parallel.bubble_fraction(*args), bindings
        assert r2["step_time_s"] == pytest.approx(r["step_time_s"] * (1 - r["pipeline_bubble"])
                                                  / (1 - r2["pipeline_bubble"]))


def test_pipeline_activations_follow_the_pipelines_schedule():
    cfg, degrees, _ = planned("gpt175b.gin", PIPELINE)
    d = plan_memory.memory(cfg, degrees)["detail"]
    sched = pipeline_parallel.Schedule(4, 1, 8, 96 // 4)
    # Per optimizer microbatch, the stage scan saves (8 + 4 - 1) x 24 layer calls on 1/8 of its tokens.
    assert d["tokens_per_layer_call"] * 8 == d["tokens_per_microbatch"]
    assert d["layer_calls_saved"] == sched.iterations * sched.layers_per_stage == 11 * 24
    assert d["saved_activations"] == int(d["tokens_per_layer_call"] * d["saved_bytes_per_token_per_layer"]
                                         * d["layer_calls_saved"])
    more = plan_memory.memory(cfg.replace(mesh={"pipeline_microbatches": 16}), degrees)["detail"]
    assert more["saved_activations"] / d["saved_activations"] == pytest.approx((19 / 16) / (11 / 8))
    circular = plan_memory.memory(cfg.replace(mesh={"pipeline_repeats": 2}), degrees)["detail"]
    assert circular["layer_calls_saved"] == pipeline_parallel.Schedule(4, 2, 8, 12).iterations * 12
    # In a pipeline the stages run under vmap: save_dots saves no matmul output, as full remat.
    dots = cfg.replace(model={"remat": "save_dots"})
    assert plan_memory.effective_remat(dots, degrees) == "full"
    assert plan_memory.memory(dots, degrees)["activations"] == plan_memory.memory(cfg, degrees)["activations"]
    assert any("'save_dots' recomputes like 'full'" in w for w in plan.plan(dots, degrees)["warnings"])


MESHES = [  # (bindings, degrees): each breaks one rule of config.mesh_problem
    (["ModelConfig.n_layers=6"], dict(data=2, fsdp=1, tensor=1, pipeline=4)),
    (["MeshConfig.pipeline_repeats=2"], dict(data=2, fsdp=1, tensor=1, pipeline=4)),
    (["MeshConfig.pipeline_microbatches=3"], dict(data=2, fsdp=1, tensor=1, pipeline=4)),
    (["TrainConfig.global_batch=6"], dict(data=4, fsdp=2, tensor=1, pipeline=1)),
    ([], dict(data=1, fsdp=1, tensor=8, pipeline=1)),  # 4 heads over tensor = 8
    (["ModelConfig.n_kv_heads=4", "ModelConfig.d_ff=770"], dict(data=2, fsdp=1, tensor=4, pipeline=1)),
    (["ModelConfig.d_model=264", "TrainConfig.global_batch=16"], dict(data=1, fsdp=16, tensor=1, pipeline=1)),
]


@pytest.mark.parametrize("bindings,degrees", MESHES, ids=range(len(MESHES)))
def test_mesh_rules_are_configs_own(bindings, degrees):
    """validate says what config.mesh_problem says (from maxlm.rules), and suggestions obey it."""
    cfg = config.load("tiny.gin", bindings).replace(mesh=degrees)
    problem = config.mesh_problem(cfg, degrees)
    assert problem
    with pytest.raises(config.ConfigError) as err:
        plan.validate(cfg, degrees)
    assert str(err.value) == f"tiny.gin: {problem}"


def test_suggested_pipelines_obey_the_mesh_rules():
    cfg, degrees, _ = planned("llama3_8b.gin", ["MeshConfig.data=8", "MeshConfig.fsdp=1",
                                                 "ModelConfig.remat='none'"], gpus=8)
    staged = [s for s in plan.suggestions(cfg, degrees, 1e15) if "MeshConfig.pipeline=" in s["change"]]
    assert staged
    for s in staged:
        again, new_degrees, r = planned("llama3_8b.gin", ["MeshConfig.data=8", "MeshConfig.fsdp=1",
                                                          "ModelConfig.remat='none'", *s["bindings"]], gpus=8)
        assert config.mesh_problem(again, new_degrees) is None and r["memory"]["total"] == s["total_bytes"]
        assert f"{r['pipeline_bubble']:.1%} bubble" in s["note"]


def test_a_config_that_does_not_fit_gets_a_suggestion_that_does():
    _, _, r = planned("llama3_1b.gin", ["OptimConfig.microbatches=1"])  # 131k tokens/device, 128k-vocab logits
    assert not r["fits"] and r["warnings"]
    best = r["suggestions"][0]
    _, _, again = planned("llama3_1b.gin", best["bindings"], gpus=best["gpus"])
    assert again["fits"] and again["memory"]["total"] == best["total_bytes"]


BAD = [
    (["--config=gpt175b.gin", "--gin_bindings=MeshConfig.pipeline=5", "--gin_bindings=MeshConfig.fsdp=6",
      "--gpus=240"], "gpt175b.gin: ModelConfig.n_layers = 96 is not divisible by MeshConfig.pipeline * "
                     "MeshConfig.pipeline_repeats = 5*1 = 5"),
    (["--config=gpt175b.gin", "--gpus=100"], "= 384, but 100 devices are present"),
    (["--config=tiny.gin", "--gin_bindings=ModelConfig.n_head=3"], "doesn't have a parameter named 'n_head'"),
    (["--config=gpt175b.gin", "--gin_bindings=MeshConfig.pipeline=4", "--gin_bindings=MeshConfig.fsdp=12",
      "--gin_bindings=MeshConfig.pipeline_microbatches=3"],
     "gpt175b.gin: MeshConfig.pipeline_microbatches = 3 does not divide the rows"),
    (["--config=tiny.gin", "--gin_bindings=ModelConfig.n_layers=8", "--gin_bindings=MeshConfig.data=2",
      "--gin_bindings=MeshConfig.pipeline=4", "--aot", "--aot_layers=2"],
     "tiny.gin: --aot_layers=2 compiles 2 layers, but ModelConfig.n_layers = 2 is not divisible by"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=range(len(BAD)))
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert plan.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


BAD_OPTIONS = [  # (argument, what the one line says): each was planned, or printed the usage block
    ("--tokens=-5", "argument --tokens: '-5' is not allowed (expected a number in (0, 1e18])"),
    ("--tokens=0", "argument --tokens: '0' is not allowed"),
    ("--tokens=nan", "argument --tokens: 'nan' is not allowed"),
    ("--tokens=-inf", "argument --tokens: '-inf' is not allowed"),
    ("--tokens=1e400", "argument --tokens: '1e400' is not allowed"),
    ("--price_per_gpu_hour=-1",
     "argument --price_per_gpu_hour: '-1' is not allowed (expected a number in [0, 10000])"),
    ("--price=nan", "argument --price_per_gpu_hour: 'nan' is not allowed"),
    ("--gpus=0", "argument --gpus: '0' is not allowed (expected an integer >= 1)"),
    ("--gpus=-8", "argument --gpus: '-8' is not allowed"),
    ("--gpus=nan", "argument --gpus: 'nan' is not allowed"),
    ("--mfu=nan", "argument --mfu: 'nan' is not allowed (expected a fraction in (0, 1])"),
    ("--mfu=-0.1", "argument --mfu: '-0.1' is not allowed"),
    ("--mfu=1.5", "argument --mfu: '1.5' is not allowed"),
    ("--aot_layers=1", "argument --aot_layers: '1' is not allowed (expected 0 (all layers) or an integer >= 2"),
    ("--config=", "argument --config: an empty value is not allowed"),
    ("--gin_bindings= ", "argument --gin_bindings: an empty value is not allowed"),
    ("--tokens=--", "argument --tokens: '--' is not a value"),
]


@pytest.mark.parametrize("arg,message", BAD_OPTIONS, ids=[a for a, _ in BAD_OPTIONS])
def test_bad_option_is_one_line_naming_it_and_exit_2(arg, message, capsys):
    with pytest.raises(SystemExit) as stop:
        plan.main([arg])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("maxlm.plan: error: ") and message in err, err


def test_cli_json_for_gpt175b_runs_in_seconds():
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "maxlm.plan", "--config=gpt175b.gin", "--tokens=300e9",
                          "--json"], capture_output=True, text=True, check=True).stdout
    elapsed = time.perf_counter() - start
    r = json.loads(out)
    assert set(r) == set(plan.JSON_KEYS)
    assert r["model_flops_6nd"] == pytest.approx(3.14e23, rel=0.01)
    assert elapsed < 60, f"planning took {elapsed:.0f} s"  # ~3 s on an idle machine


def _aot_config(mesh=None, **model):
    return small_config(model=dict(d_model=512, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=1536,
                                   vocab_size=4096, max_seq_len=512, dtype="bfloat16", **model),
                        mesh=mesh or dict(data=2, fsdp=2, tensor=2), train=dict(global_batch=16, seq_len=512))


@pytest.mark.slow
def test_aot_compiled_memory_is_within_25_percent():
    cfg = _aot_config(remat="save_named")
    a = plan.aot(cfg, cfg.mesh.shape(8))
    assert a["devices"] == 8 and a["layers_compiled"] == [4]
    assert a["argument_bytes"] == pytest.approx(a["estimate_state_bytes"], rel=0.01)
    assert 0.75 <= a["ratio"] <= 1.25, a


@pytest.mark.slow
def test_aot_with_fewer_layers_scales_back_to_the_full_model():
    cfg = _aot_config(remat="full").replace(model={"n_layers": 6})
    full = plan.aot(cfg, cfg.mesh.shape(8))
    assert 0.75 <= full["ratio"] <= 1.25, full
    reduced = plan.aot(cfg, cfg.mesh.shape(8), layers=2)
    assert reduced["layers_compiled"] == [2, 4] and reduced["extrapolated"]
    assert any("compiled 2 and 4 of 6 layers" in n for n in reduced["notes"])
    assert reduced["argument_bytes"] == pytest.approx(full["argument_bytes"], rel=0.01)
    assert reduced["total_bytes"] == pytest.approx(full["total_bytes"], rel=0.15)


@pytest.mark.slow
def test_aot_cli_sets_up_more_fake_devices_than_this_process_has():
    out = subprocess.run([sys.executable, "-m", "maxlm.plan", "--config=tiny.gin", "--gpus=16", "--aot",
                          "--gin_bindings=TrainConfig.global_batch=16", "--json"],
                         capture_output=True, text=True, check=True).stdout
    a = json.loads(out)["aot"]
    assert a["devices"] == 16 and a["total_bytes"] > 0
    assert math.isfinite(a["ratio"]) and np.isclose(a["argument_bytes"], a["estimate_state_bytes"], rtol=0.01)


@pytest.mark.slow
def test_aot_compiles_a_pipeline_within_25_percent():
    cfg = _aot_config(mesh=dict(data=2, fsdp=2, pipeline=2, pipeline_microbatches=4), remat="save_named")
    a = plan.aot(cfg, cfg.mesh.shape(8))
    assert a["devices"] == 8 and a["layers_compiled"] == [4]
    assert a["argument_bytes"] == pytest.approx(a["estimate_state_bytes"], rel=0.01)
    assert 0.75 <= a["ratio"] <= 1.25, a


BUBBLE = re.compile(r"pipeline bubble (\d+\.\d)%")
TRAIN_PIPELINE = ["ModelConfig.n_layers=8", "MeshConfig.data=2", "MeshConfig.pipeline=4",
                  "MeshConfig.pipeline_microbatches=2", "MeshConfig.pipeline_repeats=2"]


@pytest.mark.slow
def test_plan_and_train_print_the_same_pipeline_bubble(tmp_path):
    """A circular pipeline with fewer microbatches than stages: the bubble is 1 - 2*2 / (2*4 + 3)
    = 63.6%, where the textbook (S - 1) / (R M + S - 1) would say 42.9%, and the planner's old
    formula over OptimConfig.microbatches 75.0%."""
    bindings = [f"--gin_bindings={b}" for b in TRAIN_PIPELINE]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    planned_out = subprocess.run([sys.executable, "-m", "maxlm.plan", "--config=tiny.gin", *bindings],
                                 capture_output=True, text=True, check=True, env=env).stdout
    quick = ["TrainConfig.steps=1", "TrainConfig.sample_tokens=0", "TrainConfig.eval_batches=1",
             "TrainConfig.peak_flops=1e12", "CheckpointConfig.enabled=False"]
    trained = subprocess.run([sys.executable, "-m", "maxlm.train", "--config=tiny.gin", *bindings,
                              *(f"--gin_bindings={b}" for b in quick), f"--run_dir={tmp_path / 'run'}"],
                             capture_output=True, text=True, env=env)
    assert trained.returncode == 0, trained.stderr[-2000:]
    in_plan = BUBBLE.findall(planned_out)
    in_train = BUBBLE.findall(trained.stdout + trained.stderr)
    assert in_plan == in_train == ["63.6"], (in_plan, in_train)
    assert f"{pipeline_parallel.bubble_fraction(4, 2, 2):.1%}" == "63.6%"
