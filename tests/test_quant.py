"""Quantization (maxlm.quant, ``python -m maxlm.quantize``): the quantized linear seam against the
dense Linear with the dequantized weights (the kernels' jnp reference unpacks them), on 1 and 8
devices; GPTQ and AWQ against RTN on the layer-wise error they are built to lower; a small trained
run quantized by each method; and the command line end to end, with its one-line errors."""

import dataclasses
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config, model
from maxlm.kernels.int4_matmul import dequantize_int4, quantize_int4
from maxlm.model.layers import Block, LayerContext
from maxlm.model.attention import Tokens
from maxlm.model.linear import Linear
from maxlm.parallel import sharding
from maxlm.quant import apply, awq, calibrate, gptq, policy, rtn
from maxlm.train import step

SMALL = dict(vocab_size=259, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_multiple=8,
             max_seq_len=64, dtype="float32")


def build(num_devices=None, mesh=None, **model_fields):
    return config.build(num_devices=num_devices, model={**SMALL, **model_fields}, mesh=mesh or {},
                        train=dict(seq_len=32, global_batch=8, sample_tokens=0))


def tokens(rng, batch=2, length=16):
    return jnp.asarray(rng.integers(0, 259, (batch, length)), jnp.int32)


# ---- configuration


@pytest.mark.parametrize("fields,message", [
    (dict(linear_rules=(("mlp/", "int3"),)), "ModelConfig.linear_rules[0] implementation = 'int3' is not one of"),
    (dict(linear_rules=(("mlp/(", "int4"),)), "ModelConfig.linear_rules[0]: regex 'mlp/(' does not compile"),
    (dict(linear_rules=("mlp/",)), "ModelConfig.linear_rules[0] = 'mlp/' should be a (regex, implementation) pair"),
    (dict(quant_group=12), "ModelConfig.quant_group = 12 must be a positive multiple of 8"),
    (dict(quant_group=0), "ModelConfig.quant_group must be positive"),
    (dict(quant_group=48, linear_rules=(("attn/", "int4"),)),
     "ModelConfig.quant_group = 48 does not divide the input size of attn/q_proj (int4): ModelConfig.d_model = 64"),
    (dict(int8_group=24, linear="int8"), "ModelConfig.int8_group = 24 does not divide the input size of attn/q_proj"),
    (dict(embedding="int2"), "ModelConfig.embedding = 'int2' is not one of dense, int8, int4"),
    (dict(tie_embeddings=True, linear="int4", quant_group=32), "ModelConfig.tie_embeddings: the LM head is the "
                                                                "embedding table"),
])
def test_bad_quantization_config_is_one_line(fields, message):
    with pytest.raises(config.ConfigError) as err:
        build(**fields)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_packed_rows_must_divide_by_their_mesh_axis():
    """q_proj (int4) packs d_model = 64 inputs into 8 int32 rows, split over fsdp like d_model."""
    fields = dict(model={**SMALL, "linear": "int4", "quant_group": 32}, train=dict(seq_len=32, global_batch=16, sample_tokens=0))
    config.build(8, mesh=dict(data=1, fsdp=8), **fields)
    with pytest.raises(config.ConfigError, match=r"attn/q_proj \(int4\) packs ModelConfig.d_model = 64 inputs "
                                                 r"into 8 int32 rows, which MeshConfig.fsdp = 16 does not divide"):
        config.build(16, mesh=dict(data=1, fsdp=16), **fields)


def test_rules_survive_the_operative_gin_and_gin_lists(tmp_path):
    cfg = build(linear_rules=(("^mlp/", "int8"), ("attn/(q|k)_proj", "int4")), quant_group=32, embedding="int4")
    path = tmp_path / "q.gin"
    path.write_text(config.operative_gin(cfg))
    assert config.load(str(path)).model == cfg.model
    listed = config.load(str(path), ["ModelConfig.linear_rules = [['^mlp/', 'int8']]"]).model
    assert listed.linear_rules == (("^mlp/", "int8"),) and hash(listed)
    assert listed.linear_impl("mlp/down_proj") == "int8" and listed.linear_impl("attn/o_proj") == "dense"


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_linear_inputs_list_every_linear_of_the_model(activation):
    """ModelConfig.linear_inputs (what validation checks groups against) is the model's real Linears."""
    cfg = build(activation=activation).model
    specs = {s.path: s.n_in for s in apply.linear_specs(cfg)}
    assert specs == {path: size for path, (_, size, _) in cfg.linear_inputs().items()}
    tied = dataclasses.replace(cfg, tie_embeddings=True)
    assert "lm_head" not in {s.path for s in apply.linear_specs(tied)}


# ---- the format and the quantized seam


def test_rtn_int4_is_the_kernels_reference_format():
    w = jax.random.normal(jax.random.PRNGKey(0), (128, 24)) * 0.1
    q, scales = rtn.rtn(w, "int4", 32)
    packed = rtn.pack("int4", q, scales, (24,))
    ref_q, ref_s = quantize_int4(w, 32)
    np.testing.assert_array_equal(packed["qweight"], ref_q)
    np.testing.assert_allclose(packed["scales"], ref_s, rtol=1e-6)
    # INT8: max|w| / 127 per output channel, q in [-128, 127]
    q8, s8 = rtn.rtn(w, "int8", 128)
    np.testing.assert_allclose(s8[0], np.abs(np.asarray(w)).max(0) / 127, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(q8, np.float32) * s8, w, atol=float(s8.max()) / 2 + 1e-7)


def _dequantized(spec, impl, p):
    """A quantized Linear's params as a dense kernel, unpacked independently of maxlm.model."""
    qweight = np.asarray(p["qweight"]).reshape(p["qweight"].shape[0], -1)
    scales = np.asarray(p["scales"]).reshape(p["scales"].shape[0], -1)
    if impl == "int4":
        w = np.asarray(dequantize_int4(jnp.asarray(qweight), jnp.asarray(scales)))
    else:
        g = qweight.shape[0] // scales.shape[0]
        w = qweight.astype(np.float32) * np.repeat(scales, g, axis=0)
    out = {"kernel": w.reshape(*spec.in_shape, *spec.out_shape)}
    return {**out, **({"bias": p["bias"]} if "bias" in p else {})}


@pytest.mark.parametrize("impl", ["int4", "int8"])
def test_quantized_linear_equals_the_dequantized_dense_linear(impl):
    """One Linear with a multi-axis input (o_proj's heads x head_dim) and a bias."""
    cfg = build(use_bias=True, linear=impl, quant_group=16, int8_group=32).model
    dense_cfg = dataclasses.replace(cfg, linear="dense")
    layer = lambda c: Linear(c, (4, 16), (64,), ("heads", "head_dim"), ("embed",), bias_names=("act_embed",))
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 4, 16))
    dense = nn.unbox(layer(dense_cfg).init(jax.random.PRNGKey(0), x)["params"])
    dense["bias"] = jnp.linspace(-1, 1, 64)
    spec = apply.LinearSpec("attn/o_proj", ("o_proj",), (4, 16), (64,))
    q = apply._rtn_linear(spec, impl, cfg.quant_group_of(impl, 64), dense)
    assert q["qweight"].shape == ((8, 64) if impl == "int4" else (64, 64)) and q["scales"].shape[0] == 64 // (
        16 if impl == "int4" else 32)
    got = layer(cfg).apply({"params": q}, x)
    want = layer(dense_cfg).apply({"params": _dequantized(spec, impl, q)}, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(want - layer(dense_cfg).apply({"params": dense}, x)))) > 0  # it did quantize


def _quantized_model(impl, **fields):
    """A random small model, every Linear, the LM head and the embedding quantized by RTN."""
    cfg = build(**fields).model
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    qcfg = dataclasses.replace(cfg, linear=impl, quant_group=16, embedding=impl)
    qparams, _ = apply.quantize_model(cfg, params, qcfg, "rtn")
    dense = jax.tree.map(lambda x: x, params)
    for spec in apply.linear_specs(cfg):
        p = apply._get(qparams, spec.where)
        if spec.stacked:
            layers = [_dequantized(spec, impl, jax.tree.map(lambda a: a[i], p)) for i in range(cfg.n_layers)]
            value = jax.tree.map(lambda *xs: np.stack(xs), *layers)
        else:
            value = _dequantized(spec, impl, p)
        dense = apply._with(dense, spec.where, value)
    table = apply.LinearSpec("embed", ("embed",), (cfg.d_model,), (cfg.padded_vocab,))
    dense["embed"] = _dequantized(table, impl, {"qweight": qparams["embed_qweight"],
                                                "scales": qparams["embed_scales"]})["kernel"].T
    return cfg, dense, qcfg, qparams


@pytest.mark.parametrize("impl,tied", [("int4", False), ("int8", True)])
def test_quantized_model_equals_the_dense_model_with_dequantized_weights(impl, tied):
    cfg, dense, qcfg, qparams = _quantized_model(impl, tie_embeddings=tied)
    if tied:
        assert "lm_head" not in qparams
    toks = tokens(np.random.default_rng(0))
    want, _ = model.forward(cfg, dense, toks)
    got, _ = model.forward(qcfg, qparams, toks)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["int4", "int8"])
def test_quantized_model_on_8_devices_with_tensor_and_fsdp(impl):
    """The new params' logical names shard on a (data 2, fsdp 2, tensor 2) mesh and give the 1-device logits."""
    cfg, _, qcfg, qparams = _quantized_model(impl)
    full = config.build(8, model=dataclasses.asdict(qcfg), mesh=dict(data=2, fsdp=2, tensor=2),
                        train=dict(seq_len=32, global_batch=8, sample_tokens=0))
    mesh = sharding.make_mesh(full.mesh.shape(8))
    names = step.param_names(full)
    specs = sharding.mesh_shardings(names, mesh)
    assert names["layers"]["mlp"]["down_proj"]["qweight"] == jax.sharding.PartitionSpec("layers", "mlp", "embed")
    assert specs["layers"]["mlp"]["down_proj"]["qweight"].spec == jax.sharding.PartitionSpec("pipeline", "tensor", "fsdp")
    assert names["layers"]["attn"]["q_proj"]["scales"] == jax.sharding.PartitionSpec("layers", None, "heads", "head_dim")
    placed = jax.device_put(qparams, specs)
    toks = tokens(np.random.default_rng(1), batch=8)
    with jax.set_mesh(mesh):
        sharded, _ = jax.jit(lambda p, t: model.forward(qcfg, p, t))(placed, toks)
    single, _ = model.forward(qcfg, qparams, toks)
    np.testing.assert_allclose(sharded, single, rtol=1e-4, atol=1e-4)


# ---- the methods against RTN on the error they minimise


def _error(x, w, wq):
    """||X W - X Q||^2 / ||X W||^2, computed from X itself."""
    x, w, wq = (np.asarray(a, np.float64) for a in (x, w, wq))
    return float(np.sum((x @ w - x @ wq) ** 2) / np.sum((x @ w) ** 2))


@pytest.mark.parametrize("impl,group,act_order", [("int4", 32, False), ("int4", 32, True), ("int8", 128, False),
                                                  ("int8", 64, True)])
def test_gptq_beats_rtn_on_correlated_inputs(impl, group, act_order):
    rng = np.random.default_rng(0)
    k, n = 128, 48
    # correlated inputs, as a layer's activations are: a low-rank part plus noise
    x = (rng.normal(size=(2048, k // 4)) @ rng.normal(size=(k // 4, k)) + 0.3 * rng.normal(size=(2048, k)))
    x = x.astype(np.float32)
    w = (rng.normal(size=(k, n)) * 0.05).astype(np.float32)
    q, s = rtn.rtn(jnp.asarray(w), impl, group)
    rtn_err = _error(x, w, np.asarray(q, np.float32) * np.repeat(np.asarray(s), group, 0))
    q, s = gptq.quantize(jnp.asarray(w), gptq.hessian(jnp.asarray(x)), impl, group, act_order=act_order)
    assert q.dtype == jnp.int8 and s.shape == (k // group, n)
    lo, hi = rtn.QRANGE[impl]
    assert lo <= int(q.min()) and int(q.max()) <= hi
    gptq_err = _error(x, w, np.asarray(q, np.float32) * np.repeat(np.asarray(s), group, 0))
    assert gptq_err < 0.5 * rtn_err, (gptq_err, rtn_err)


def test_awq_beats_rtn_with_outlier_input_channels():
    rng = np.random.default_rng(0)
    k, n, group = 128, 64, 32
    x = rng.normal(size=(2048, k)).astype(np.float32)
    x[:, rng.choice(k, 4, replace=False)] *= 25.0  # a few salient channels
    w = (rng.normal(size=(k, n)) * 0.05).astype(np.float32)
    q, scales = rtn.rtn(jnp.asarray(w), "int4", group)
    rtn_err = _error(x, w, np.asarray(q, np.float32) * np.repeat(np.asarray(scales), group, 0))
    s, alpha, _, _ = awq.search_scale(jnp.asarray(x), jnp.mean(jnp.abs(x), 0), [jnp.asarray(w)], "int4", group)
    assert alpha > 0
    ws = jnp.asarray(w) * s[:, None]
    clipped = awq.clip_scales(jnp.asarray(x) / s, ws, "int4", group)
    wq = rtn.quantize_values(ws, rtn.row_scales(clipped, k), "int4").astype(jnp.float32) * rtn.row_scales(clipped, k)
    awq_err = _error(x, w, np.asarray(wq) / np.asarray(s)[:, None])  # x W ~= (x / s) (Q of s W)
    assert awq_err < 0.6 * rtn_err, (awq_err, rtn_err)


@pytest.mark.parametrize("fields", [dict(), dict(n_kv_heads=4, norm="layer", activation="swiglu", use_bias=True)])
def test_awq_folds_are_exact(fields):
    """Scaling the Linears' input rows up and the ops before them down leaves the layer's output as it was."""
    cfg = build(**fields).model
    lp = jax.tree.map(lambda a: a[0], model.init_params(cfg, jax.random.PRNGKey(0))["layers"])
    lp = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.PRNGKey(3), a.shape), lp)
    specs = {s.path: s for s in apply.linear_specs(cfg)}
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 16, cfg.d_model))
    ctx = LayerContext(Tokens(positions=jnp.broadcast_to(jnp.arange(16), (2, 16)), segments=jnp.ones((2, 16), jnp.int32)))
    want, _ = Block(cfg).apply({"params": lp}, x, ctx)
    folded = lp
    groups = apply._awq_groups(cfg)
    assert len(groups) == (4 if cfg.n_heads == cfg.kv_heads else 3)
    for i, (members, prev) in enumerate(groups):
        k = specs[members[0]].n_in
        s = jnp.exp(jax.random.normal(jax.random.PRNGKey(10 + i), (k,)))
        folded = apply._fold(folded, lambda p: tuple(p.split("/")), members, prev, s, specs)
    got, _ = Block(cfg).apply({"params": folded}, x, ctx)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ---- a trained run: each method, and the command line


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small model trained for 150 steps on the stdlib source (~30 s): a real run directory."""
    from maxlm.train import pretrain

    run = tmp_path_factory.mktemp("quant") / "run"
    cfg = config.build(jax.device_count(), model=SMALL,
                       train=dict(steps=150, global_batch=16, seq_len=64, eval_every=150, eval_batches=4,
                                  log_every=50, sample_tokens=0, run_dir=str(run)),
                       optim=dict(warmup_steps=10, learning_rate=1e-2),
                       checkpoint=dict(every_steps=150, async_save=False))
    summary = pretrain.train(cfg)
    assert summary["eval_losses"][-1][1] < 3.0  # it learned something
    return run


@pytest.mark.slow
@pytest.mark.parametrize("method", apply.METHODS)
def test_each_method_keeps_the_perplexity_of_a_trained_model(trained, method):
    from maxlm.hf.load import load_model

    loaded = load_model(trained)
    held = calibrate.heldout_batches(loaded.run_config, 4)
    calib = calibrate.calibration_batches(loaded.run_config, 2)
    before = calibrate.perplexity(loaded.cfg, loaded.params, held)
    for bits, pol, bound in [(4, "all", 0.03), (8, "all", 0.005), (None, "layered", 0.01)]:
        qcfg = policy.quantized_config(loaded.cfg, pol, bits, 32)
        qparams, errors = apply.quantize_model(loaded.cfg, loaded.params, qcfg, method, calib, log=lambda _: None)
        after = calibrate.perplexity(qcfg, qparams, held)
        assert abs(after / before - 1) < bound, (method, bits, pol, before, after)
        if method != "rtn":
            assert errors and all(0 <= v < 0.05 for k, v in errors.items() if "alpha" not in k), errors


def test_calibration_batches_are_the_training_stream(trained):
    from maxlm.data import make_train_iterator

    cfg = config.load(str(trained / "config.gin"))
    batches = calibrate.calibration_batches(cfg, 2, batch_size=8)
    it = make_train_iterator(cfg.data, seq_len=cfg.train.seq_len, global_batch=8)
    try:
        first = next(it)
    finally:
        it.close()
    assert set(batches[0]) == {"inputs", "targets", "segment_ids", "positions", "weights"}
    np.testing.assert_array_equal(batches[0]["inputs"], first["inputs"])
    held = calibrate.heldout_batches(cfg, cfg.train.eval_batches)
    assert held[0]["inputs"].shape == (cfg.train.global_batch, cfg.train.seq_len)
    # the held-out batches and perplexity are the trainer's own eval
    rows = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    final = [r["eval_loss"] for r in rows if r.get("step") == cfg.train.steps and "eval_loss" in r][-1]
    from maxlm.hf.load import load_model

    loaded = load_model(trained)
    assert calibrate.perplexity(loaded.cfg, loaded.params, held) == pytest.approx(math.exp(final), rel=1e-5)


def test_cli_end_to_end(trained, tmp_path, capsys):
    from maxlm.hf.load import load_model
    from maxlm.infer import generate as gen
    from maxlm.quant.cli import main
    from maxlm.serve.engine import Engine, EngineConfig, RequestParams

    out = tmp_path / "gptq4"
    assert main(["--checkpoint", str(trained), "--method", "gptq", "--bits", "4", "--group", "32",
                 "--calib-samples", "32", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "layer 2/2 (gptq" in printed and "held-out perplexity, quantized" in printed and "smaller" in printed
    report = json.loads((out / "quant_report.json").read_text())
    assert report["method"] == "gptq" and report["perplexity"]["change"] < 0.03
    loaded = load_model(out)
    # the layers' matmul weights go from 4 bytes to half a byte (+ a 4-byte scale per 32); the
    # embedding, LM head and norms stay float32
    assert report["bytes"]["quantized"] == apply.weight_bytes(loaded.params) < report["bytes"]["original"] / 2
    assert loaded.cfg.linear_rules == (("^(attn|mlp)/", "int4"),) and loaded.cfg.quant_group == 32
    assert loaded.params["layers"]["mlp"]["up_proj"]["qweight"].dtype == jnp.int32
    assert calibrate.perplexity(loaded.cfg, loaded.params, calibrate.heldout_batches(loaded.run_config, 4)) == \
        pytest.approx(report["perplexity"]["quantized"], rel=1e-5)
    prompt = loaded.tokenizer.encode("def ", add_eos=False)
    ref = gen.run(loaded.cfg, loaded.params, [prompt], 12).tokens[0]
    engine = Engine(loaded.cfg, loaded.params, loaded.tokenizer, EngineConfig(max_num_seqs=2, block_size=8))
    served = []
    engine.submit(prompt, RequestParams(max_tokens=12, ignore_eos=True), lambda o: served.extend(o.token_ids))
    while engine.busy():
        engine.step()
    assert served == list(ref[:12])

    from maxlm.eval.cli import main as eval_main
    from maxlm.generate import main as generate_main

    assert generate_main(["--checkpoint", str(out), "--prompt", "def ", "--max-new-tokens", "8", "--no-stream"]) == 0
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("def f(x):\n    return x\n", "import os\n")))
    capsys.readouterr()
    assert eval_main(["--checkpoint", str(out), "--task", str(texts), "--out", str(tmp_path / "eval.json")]) == 0
    assert (tmp_path / "eval.json").is_file() and "perplexity" in capsys.readouterr().out


def test_command_line_entry_point_help():
    """``python -m maxlm.quantize`` (a separate process, outside the checkout's path) documents itself."""
    import subprocess
    import sys

    from tests.peer_envs import peer_env

    done = subprocess.run([sys.executable, "-m", "maxlm.quantize", "--help"], capture_output=True, text=True,
                          env=peer_env(), cwd="/", timeout=120)
    assert done.returncode == 0, done.stderr
    for flag in ("--checkpoint", "--method", "--bits", "--group", "--policy", "--act-order", "--out", "layered"):
        assert flag in done.stdout


@pytest.mark.parametrize("args,message", [
    (["--checkpoint", "{tmp}/nope"], "does not exist"),
    (["--bits", "3"], "argument --bits: 3 is not a supported width (4 or 8)"),
    (["--group", "48"], "--group 48: ModelConfig.quant_group = 48 does not divide the input size of attn/q_proj "
                        "(int4): ModelConfig.d_model = 64"),
    (["--group", "12"], "--group 12: INT4 groups must be a multiple of 8"),
    (["--out", "{run}"], "--out already exists"),
    (["--policy", "layered"], "--policy layered sets its own widths"),
    (["--method", "awq", "--act-order"], "--act-order applies to --method gptq"),
    (["--damp", "2"], "argument --damp: 2 must lie in (0, 1)"),
])
def test_cli_bad_input_is_one_line_and_exit_2(trained, tmp_path, capsys, args, message):
    from maxlm.quant.cli import main

    base = {"--checkpoint": str(trained), "--method": "rtn", "--bits": "4", "--out": str(tmp_path / "q")}
    i = 0
    while i < len(args):
        if args[i + 1:i + 2] and not args[i + 1].startswith("--"):
            base[args[i]] = args[i + 1].format(tmp=tmp_path, run=trained)
            i += 2
        else:
            base[args[i]] = None
            i += 1
    argv = [x for k, v in base.items() for x in ([k] if v is None else [k, v])]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own checks
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("maxlm.quantize: error: ") and message in err[0], err
    assert not (tmp_path / "q").exists()
