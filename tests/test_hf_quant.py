"""maxlm.hf export --quant int4: transformers (with compressed-tensors) loads the INT4 export and
computes maxlm's INT4 model's logits.

* A dense model exported with --quant int4 equals maxlm's own RTN INT4 model (``maxlm.quantize``'s
  RTN, same group) in fp32 within 1e-4 on 2 x 128 tokens, the LM head dense (``ignore: [lm_head]``).
* A model made INT4 by GPTQ (only the MLP: the attention stays dense and is listed in ``ignore``)
  exports losslessly: the packed words are the model's own and the logits are its logits; with
  --quant int4 its attention is RTN-quantized and the MLP words still pass through unchanged.
* The packed tensors, unpacked by compressed-tensors' own ``unpack_from_int32``, times the scales,
  are the HF weights of the dequantized model written dense (so the table's transforms moved the
  packed words the same way as dense weights).
* GPTQ format: transformers needs optimum + gptqmodel to load it (not installed, not pulled in
  here), so its tensors are unpacked independently (AutoGPTQ v1: w = scale * (q - (zero + 1)))
  and compared with the dense weights; qweight is the compressed-tensors words transposed.
* A model vLLM's CPU kernel would refuse still exports, with a note; bad options are one line, exit 2.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from safetensors.numpy import load_file

from maxlm import config as config_lib
from maxlm import hf, model
from maxlm.data.tokenizer import ByteTokenizer
from maxlm.hf.convert import export_params
from maxlm.hf.load import LoadedModel
from maxlm.hf.quant_export import dense_model
from maxlm.quant.apply import quantize_model

ATOL = 1e-4
GROUP = 32
LENGTH = 128
# GQA, untied head, q/k/v heads reshaped by the table: every kind of row transform is exercised.
LLAMA = dict(vocab_size=259, vocab_multiple=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=160,
             max_seq_len=256, tie_embeddings=False, dtype="float32", param_dtype="float32")
ALL = ((r"^(attn|mlp)/", "int4"),)
MLP = ((r"^mlp/", "int4"),)


def _cfg(rules=(), group=GROUP, **fields):
    return config_lib.ModelConfig(**{**LLAMA, **fields}, linear_rules=rules, quant_group=group)


def _dense_params(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: (0.1 * rng.standard_normal(x.shape)).astype(np.float32),
                        model.abstract_params(cfg))


def _tokens(batch=2):
    return np.random.default_rng(1).integers(0, LLAMA["vocab_size"], size=(batch, LENGTH), dtype=np.int64)


def _maxlm_logits(cfg, params, ids):
    logits = jax.jit(lambda p, x: model.forward(cfg, p, x)[0])(params, jnp.asarray(ids, jnp.int32))
    return np.asarray(logits)[..., :cfg.vocab_size]


def _loaded(cfg, params):
    return LoadedModel(cfg, params, ByteTokenizer(), None, "random llama (tests/test_hf_quant.py)")


def _export(cfg, params, out, **kwargs):
    notes = []
    summary = hf.export_model(_loaded(cfg, params), out, say=notes.append, **kwargs)
    return summary, notes


def _hf_net(out):
    net, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager", dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return net.eval()


def _hf_logits(out, ids):
    with torch.no_grad():
        return _hf_net(out)(torch.from_numpy(ids)).logits.float().numpy()


def _unpack_ct(tensors, base):
    """compressed-tensors' own unpacking: W [N, K] = q * scale, per group of inputs."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    packed = torch.from_numpy(tensors[f"{base}.weight_packed"])
    shape = tuple(int(v) for v in tensors[f"{base}.weight_shape"])
    q = unpack_from_int32(packed, 4, torch.Size(shape)).numpy().astype(np.float32)
    scale = tensors[f"{base}.weight_scale"].astype(np.float32)
    return q * np.repeat(scale, shape[1] // scale.shape[1], axis=1)


def _unpack_gptq(tensors, base):
    """AutoGPTQ v1's dequantization, written out: nibble j of qweight word [r, n] is input 8r+j;
    nibble j of qzeros word [g, c] is output 8c+j's zero point minus one; W = scale * (q - zero)."""
    shifts = np.arange(8, dtype=np.uint32) * 4
    words = tensors[f"{base}.qweight"].view(np.uint32)
    q = ((words[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, words.shape[1]).astype(np.float32)
    zwords = tensors[f"{base}.qzeros"].view(np.uint32)
    zeros = ((zwords[:, :, None] >> shifts[None, None, :]) & 0xF).reshape(zwords.shape[0], -1) + 1
    g_idx = tensors[f"{base}.g_idx"]
    w = (q - zeros[g_idx].astype(np.float32)) * tensors[f"{base}.scales"][g_idx].astype(np.float32)
    return w.T  # [N, K] as nn.Linear


def _dense_hf_weights(cfg, params):
    """The HF tensors of the model with every quantized weight dequantized, as a dense export writes them."""
    dense_cfg, dense = dense_model(cfg, jax.device_get(params), lambda _: None)
    return export_params(dense, dense_cfg, "llama")


@pytest.fixture(scope="module")
def dense():
    cfg = _cfg()
    return cfg, _dense_params(cfg)


@pytest.fixture(scope="module")
def rtn(dense):
    """maxlm's RTN INT4 model of ``dense`` (every attention and MLP Linear, group 32)."""
    cfg, params = dense
    qcfg = _cfg(ALL)
    return qcfg, quantize_model(cfg, params, qcfg, "rtn")[0]


@pytest.fixture(scope="module")
def gptq_mlp(dense):
    """The MLP made INT4 by GPTQ (calibrated on random tokens); the attention stays dense."""
    cfg, params = dense
    qcfg = _cfg(MLP)
    rng = np.random.default_rng(2)
    batches = [{"inputs": rng.integers(0, cfg.vocab_size, (4, 64)).astype(np.int32),
                "segment_ids": np.ones((4, 64), np.int32),
                "positions": np.broadcast_to(np.arange(64, dtype=np.int32), (4, 64))} for _ in range(2)]
    return qcfg, quantize_model(cfg, params, qcfg, "gptq", batches, log=lambda _: None)[0]


@pytest.fixture(scope="module")
def rtn_export(dense, tmp_path_factory):
    cfg, params = dense
    out = tmp_path_factory.mktemp("hfq") / "rtn"
    summary, notes = _export(cfg, params, out, quant="int4", quant_group=GROUP)
    return out, summary, notes


def test_dense_model_exported_int4_equals_maxlm_rtn_int4(dense, rtn, rtn_export):
    qcfg, qparams = rtn
    out, summary, notes = rtn_export
    assert "7 Linear(s) per layer int4 (compressed-tensors, group 32)" in summary, summary
    assert any("round-to-nearest, group 32" in n for n in notes), notes
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["ignore"] == ["lm_head"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["symmetric"], weights["strategy"], weights["group_size"]) == (4, True, "group", 32)
    tensors = load_file(out / "model.safetensors")
    assert tensors["lm_head.weight"].dtype == np.float32 and "lm_head.weight_packed" not in tensors
    assert tensors["model.layers.0.self_attn.k_proj.weight_packed"].shape == (32, 64 // 8)
    ids = _tokens()
    want, got = _maxlm_logits(qcfg, qparams, ids), _hf_logits(out, ids)
    err = np.abs(got - want).max()
    print(f"INT4 RTN export: transformers vs maxlm INT4 logits, max |diff| {err:.2e}")
    assert err < ATOL, err
    # INT4 is not the dense model: the comparison would catch an export that wrote dense weights.
    assert np.abs(want - _maxlm_logits(*dense, ids)).max() > 100 * ATOL


def test_packed_tensors_unpack_to_the_dense_weights(rtn, rtn_export):
    """compressed-tensors' unpacking of every INT4 tensor is the HF weight of the dequantized model."""
    out, _, _ = rtn_export
    tensors = load_file(out / "model.safetensors")
    reference = _dense_hf_weights(*rtn)
    packed = [name.removesuffix(".weight_packed") for name in tensors if name.endswith(".weight_packed")]
    assert len(packed) == 7 * LLAMA["n_layers"]
    for base in packed:
        np.testing.assert_array_equal(_unpack_ct(tensors, base), reference[f"{base}.weight"], err_msg=base)
    dense_names = {n for n in tensors if not n.endswith(("_packed", "_scale", "_shape"))}
    assert dense_names == {n for n in reference if n.removesuffix(".weight") not in packed}
    for name in dense_names:
        np.testing.assert_array_equal(tensors[name], reference[name], err_msg=name)


def test_gptq_model_exports_losslessly(gptq_mlp, rtn, tmp_path):
    qcfg, qparams = gptq_mlp
    summary, notes = _export(qcfg, qparams, tmp_path / "as-is")
    assert "3 Linear(s) per layer int4" in summary and not any("round-to-nearest" in n for n in notes), (summary, notes)
    qc = json.loads((tmp_path / "as-is" / "config.json").read_text())["quantization_config"]
    layers = range(LLAMA["n_layers"])
    assert qc["ignore"][0] == "lm_head"
    assert sorted(qc["ignore"][1:]) == sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in layers for p in "qkvo")
    assert not any("partly quantized" in n for n in notes), notes  # q/k/v all dense, gate/up both int4
    tensors = load_file(tmp_path / "as-is" / "model.safetensors")
    words = np.asarray(qparams["layers"]["mlp"]["down_proj"]["qweight"])  # [L, K/8, N]
    for i in layers:  # the model's own words, transposed (down_proj's output order is unchanged)
        np.testing.assert_array_equal(tensors[f"model.layers.{i}.mlp.down_proj.weight_packed"], words[i].T)
    ids = _tokens()
    want = _maxlm_logits(qcfg, qparams, ids)
    err = np.abs(_hf_logits(tmp_path / "as-is", ids) - want).max()
    print(f"GPTQ (MLP) export as is: transformers vs maxlm logits, max |diff| {err:.2e}")
    assert err < ATOL, err

    # --quant int4: the attention by RTN on top; the GPTQ words still pass through unchanged.
    summary, notes = _export(qcfg, qparams, tmp_path / "all", quant="int4")
    assert "7 Linear(s) per layer int4" in summary and any("quantized 4 Linear(s)" in n for n in notes), notes
    again = load_file(tmp_path / "all" / "model.safetensors")
    for name in tensors:
        if ".mlp." in name:
            np.testing.assert_array_equal(again[name], tensors[name], err_msg=name)
    mixed = dataclasses.replace(qcfg, linear_rules=ALL)
    mixed_params = jax.device_get(qparams)  # GPTQ leaves the attention as it was: RTN of it is rtn's
    mixed_params = {**mixed_params, "layers": {**mixed_params["layers"], "attn": rtn[1]["layers"]["attn"]}}
    err = np.abs(_hf_logits(tmp_path / "all", ids) - _maxlm_logits(mixed, mixed_params, ids)).max()
    print(f"GPTQ MLP + RTN attention export: max |diff| {err:.2e}")
    assert err < ATOL, err


def test_gptq_format_tensors(rtn, rtn_export, dense, tmp_path):
    """--quant-format gptq: the same words untransposed, zero point 8 (v1: 7), g_idx k // G; unpacked
    independently they are the dense weights. (transformers loads GPTQ only with optimum + gptqmodel.)"""
    cfg, params = dense
    summary, _ = _export(cfg, params, tmp_path / "gptq", quant="int4", quant_group=GROUP, quant_format="gptq")
    assert "(gptq, group 32)" in summary, summary
    qc = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format")} == {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False, "checkpoint_format": "gptq"}
    assert qc["modules_in_block_to_quantize"] == [[f"{p}" for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]]
    tensors = load_file(tmp_path / "gptq" / "model.safetensors")
    ct = load_file(rtn_export[0] / "model.safetensors")
    reference = _dense_hf_weights(*rtn)
    bases = [n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")]
    assert len(bases) == 7 * LLAMA["n_layers"]
    for base in bases:
        np.testing.assert_array_equal(tensors[f"{base}.qweight"], ct[f"{base}.weight_packed"].T)
        np.testing.assert_array_equal(tensors[f"{base}.g_idx"], np.arange(tensors[f"{base}.qweight"].shape[0] * 8) // GROUP)
        np.testing.assert_array_equal(_unpack_gptq(tensors, base), reference[f"{base}.weight"], err_msg=base)
    assert "lm_head.weight" in tensors and "lm_head.qweight" not in tensors


def test_bf16_export_rounds_only_the_scales(rtn, dense, tmp_path):
    cfg, params = dense
    _export(cfg, params, tmp_path / "bf16", quant="int4", quant_group=GROUP, dtype="bf16")
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    base = "model.layers.1.mlp.up_proj"
    assert tensors[f"{base}.weight_packed"].dtype == np.int32 and tensors[f"{base}.weight_shape"].dtype == np.int64
    ids = _tokens(1)
    want = _maxlm_logits(*rtn, ids)
    with torch.no_grad():
        net = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16).eval()
        got = net(torch.from_numpy(ids)).logits.float().numpy()
    agree = np.mean(got.argmax(-1) == want.argmax(-1))
    print(f"bf16 INT4 export: top-1 agreement with maxlm's fp32 INT4 model {agree:.3f}")
    assert agree > 0.9, agree


def test_vllm_cpu_note_and_refusals(dense, rtn, tmp_path, capsys):
    cfg, params = dense
    # d_ff 168 (not a multiple of 32; group 8 divides it): exported all the same, with the note.
    odd = _cfg(d_ff=168, group=8)
    _, notes = _export(odd, _dense_params(odd), tmp_path / "odd", quant="int4", quant_group=8)
    assert (tmp_path / "odd" / "config.json").exists()
    assert any("vLLM on CPU will refuse" in n and "mlp/gate_proj [64 in, 168 out]" in n for n in notes), notes

    run = tmp_path / "run"  # the CLI on a run directory: bad options are one line, exit 2
    _save_run(run, cfg, params)
    out = tmp_path / "out"
    for argv, fragments in [
        (["--quant", "int3"], ["--quant", "int3"]),
        (["--quant", "int4", "--quant-group", "12"], ["--quant-group", "'12'", "multiple of 8"]),
        (["--quant", "int4", "--quant-group", "48"], ["--quant-group 48", "64 inputs", "attn/q_proj"]),
        (["--quant", "int4", "--quant-format", "awq"], ["--quant-format", "awq"]),
        (["--quant", "none", "--quant-format", "gptq"], ["--quant-format", "--quant none"]),
        (["--quant-group", "64"], ["--quant-group", "INT4 exports"]),
        (["--quant", "int4", "--family", "gpt2"], ["gpt2"]),
    ]:
        code, err = _cli(["export", run, "--out", out, *argv], capsys)
        assert code == 2 and len(err) == 1 and "Traceback" not in err[0], (argv, code, err)
        for fragment in fragments:
            assert fragment in err[0], (fragment, err[0])
    assert not out.exists()
    # A model quantized with group 32 cannot be regrouped without quantizing it again.
    qrun = tmp_path / "qrun"
    _save_run(qrun, *rtn)
    code, err = _cli(["export", qrun, "--out", out, "--quant-group", "64"], capsys)
    assert code == 2 and len(err) == 1 and "quant_group = 32" in err[0], err
    code, err = _cli(["export", qrun, "--out", out, "--quant", "none"], capsys)
    assert code == 0 and (out / "config.json").exists(), err
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def _cli(argv, capsys):
    try:
        code = hf.main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err.strip().splitlines()


def _save_run(run_dir, cfg, params):
    """A run directory as maxlm.quantize leaves one: config.gin + a checkpoint of the parameters."""
    from maxlm.train.checkpoint import save_params

    run_dir.mkdir(parents=True)
    save_params(run_dir / "params", jax.device_get(params))
    full = config_lib.build(model=dataclasses.asdict(cfg),
                            train={"init_params": str(run_dir / "params"), "seq_len": 128, "sample_tokens": 64})
    (run_dir / "config.gin").write_text(config_lib.operative_gin(full))
