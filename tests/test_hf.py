"""maxlm.hf import: logits parity with Hugging Face transformers, and one-line errors on bad input.

Small random Llama (grouped-query, untied / tied / llama3 rope scaling) and GPT-2 models are saved
with ``save_pretrained`` (safetensors), imported, and run by both stacks in fp32 on the same tokens.
"""

import dataclasses
import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flax.linen as nn  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from maxlm import config as config_lib  # noqa: E402
from maxlm import hf, model  # noqa: E402
from maxlm.train.checkpoint import restore_params  # noqa: E402

ATOL = 1e-4
BATCH, LENGTH = 2, 300

LLAMA = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=509, rope_theta=500000.0, max_position_embeddings=512,
             rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
GPT2 = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=333, n_positions=512, initializer_range=0.1)


def _randomize(module: "torch.nn.Module") -> None:
    """Perturb norm scales and biases too (HF initialises them to 1 and 0), so their mapping is tested."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def _save_hf(kind: str, path, **overrides):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**{**LLAMA, **overrides}, attn_implementation="eager")
        net = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(**{**GPT2, **overrides}, attn_implementation="eager",
                                      bos_token_id=0, eos_token_id=0)
        net = transformers.GPT2LMHeadModel(cfg)
    net = net.to(torch.float32).eval()
    _randomize(net)
    net.save_pretrained(path)
    return net


def _tokens(vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, size=(BATCH, LENGTH), dtype=np.int64)


def _hf_logits(net, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return net(torch.from_numpy(ids)).logits.float().numpy()


def _maxlm_logits(model_cfg, params, ids: np.ndarray) -> np.ndarray:
    cfg = dataclasses.replace(model_cfg, dtype="float32")
    logits = jax.jit(lambda p, x: model.forward(cfg, p, x)[0])(params, jnp.asarray(ids, jnp.int32))
    return np.asarray(logits)[..., :cfg.vocab_size]


def _import(path, dtype="float32"):
    model_cfg = hf.config_from_hf(json.loads((path / "config.json").read_text()), dtype=dtype)
    return model_cfg, hf.params_from_hf(path, model_cfg)


def _expected_tree(model_cfg):
    return jax.tree.map(lambda x: x.shape, nn.unbox(jax.eval_shape(lambda: model.Transformer(model_cfg).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))))["params"])


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "maxlm.hf", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def _assert_one_line_error(proc, *fragments):
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, _save_hf("llama", path)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    return path, _save_hf("gpt2", path)


def test_llama_cli_import_logits_parity(llama_dir, tmp_path):
    path, net = llama_dir
    out = tmp_path / "run"
    proc = _run_cli("import", path, "--out", out, "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    summary = proc.stdout.strip().splitlines()
    assert len(summary) == 1 and "LlamaForCausalLM" in summary[0] and str(out / "params") in summary[0]

    # The written config is the one `maxlm.train --config=RUN_DIR/config.gin` will load.
    cfg = config_lib.load(str(out / "config.gin"))
    model_cfg = cfg.model
    assert (model_cfg.n_kv_heads, model_cfg.rope_theta, model_cfg.dtype) == (2, 500000.0, "float32")
    assert model_cfg.padded_vocab == 512 and not model_cfg.tie_embeddings
    assert cfg.train.init_params == str((out / "params").resolve())
    assert cfg.train.run_dir == str(out.resolve()) and cfg.train.seq_len == 512

    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), _expected_tree(model_cfg),
                            is_leaf=lambda x: isinstance(x, tuple))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = restore_params(out / "params", abstract, jax.tree.map(lambda _: device, abstract))
    assert np.all(np.asarray(params["embed"])[model_cfg.vocab_size:] == 0)

    ids = _tokens(model_cfg.vocab_size)
    diff = np.abs(_maxlm_logits(model_cfg, params, ids) - _hf_logits(net, ids)).max()
    print(f"llama max abs logit diff {diff:.2e}")
    assert diff < ATOL

    # Never overwrite: a second import into the same run directory is refused in one line.
    again = _run_cli("import", path, "--out", out)
    _assert_one_line_error(again, "already exists", str(out / "params"))


def test_gpt2_logits_parity(gpt2_dir):
    path, net = gpt2_dir
    model_cfg, params = _import(path)
    assert (model_cfg.norm, model_cfg.activation, model_cfg.position) == ("layer", "gelu", "learned")
    assert model_cfg.use_bias and model_cfg.tie_embeddings and model_cfg.d_ff == 256
    assert jax.tree.map(lambda x: x.shape, params) == _expected_tree(model_cfg)
    ids = _tokens(model_cfg.vocab_size)
    diff = np.abs(_maxlm_logits(model_cfg, params, ids) - _hf_logits(net, ids)).max()
    print(f"gpt2 max abs logit diff {diff:.2e}")
    assert diff < ATOL


def test_gpt2_cli_import(gpt2_dir, tmp_path):
    proc = _run_cli("import", gpt2_dir[0], "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert "GPT2LMHeadModel" in proc.stdout
    cfg = config_lib.load(str(tmp_path / "run" / "config.gin"))
    assert cfg.model.dtype == "bfloat16" and cfg.model.position == "learned"


def test_llama_tied_embeddings(tmp_path):
    net = _save_hf("llama", tmp_path, tie_word_embeddings=True, num_hidden_layers=2)
    model_cfg, params = _import(tmp_path)
    assert model_cfg.tie_embeddings and "lm_head" not in params
    assert jax.tree.map(lambda x: x.shape, params) == _expected_tree(model_cfg)
    ids = _tokens(model_cfg.vocab_size)
    diff = np.abs(_maxlm_logits(model_cfg, params, ids) - _hf_logits(net, ids)).max()
    print(f"llama tied max abs logit diff {diff:.2e}")
    assert diff < ATOL


def test_llama3_rope_scaling(tmp_path):
    net = _save_hf("llama", tmp_path, rope_scaling=LLAMA3_ROPE, num_hidden_layers=2)
    model_cfg, params = _import(tmp_path)
    assert (model_cfg.rope_scaling_factor, model_cfg.rope_low_freq_factor, model_cfg.rope_high_freq_factor,
            model_cfg.rope_original_max_len) == (8.0, 1.0, 4.0, 64)
    ids = _tokens(model_cfg.vocab_size)
    want = _hf_logits(net, ids)
    diff = np.abs(_maxlm_logits(model_cfg, params, ids) - want).max()
    print(f"llama3-rope max abs logit diff {diff:.2e}")
    assert diff < ATOL
    # The scaling matters on this input: without it the logits are visibly different.
    unscaled = dataclasses.replace(model_cfg, rope_scaling_factor=0.0)
    assert np.abs(_maxlm_logits(unscaled, params, ids) - want).max() > 100 * ATOL


def test_config_mapping_v4_layout_and_defaults():
    llama = hf.config_from_hf(dict(model_type="llama", hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4, vocab_size=1000,
                                   rope_theta=1e6, head_dim=64, attention_bias=True,
                                   rope_scaling=dict(type="llama3", factor=32.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0,
                                                     original_max_position_embeddings=8192)))
    assert (llama.kv_heads, llama.dim_per_head, llama.rope_theta, llama.use_bias) == (4, 64, 1e6, True)
    assert llama.rope_scaling_factor == 32.0 and llama.padded_vocab == 1024
    gpt2 = hf.config_from_hf(dict(model_type="gpt2", n_embd=48, n_layer=1, n_head=3, vocab_size=50257))
    assert (gpt2.d_ff, gpt2.max_seq_len, gpt2.norm_eps, gpt2.padded_vocab) == (192, 1024, 1e-5, 50304)


def test_export_reproduces_saved_checkpoints(llama_dir, gpt2_dir):
    # import then export gives back save_pretrained's tensors: same names, dtypes and bits.
    for path, _ in (llama_dir, gpt2_dir):
        model_cfg, params = _import(path)
        saved = load_file(path / "model.safetensors")
        exported = hf.export_params(params, model_cfg, hf.read_hf_config(path))
        assert sorted(exported) == sorted(saved)
        for name, value in saved.items():
            assert exported[name].dtype == value.dtype and exported[name].tobytes() == value.tobytes(), name


def test_sharded_and_bf16_checkpoints(llama_dir, tmp_path):
    path, net = llama_dir
    model_cfg, params = _import(path)
    sharded = tmp_path / "sharded"
    net.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / hf.INDEX_FILE).is_file()
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, hf.params_from_hf(sharded, model_cfg), params)))
    bf16 = tmp_path / "bf16"
    net.to(torch.bfloat16).save_pretrained(bf16)
    net.to(torch.float32)
    loaded = hf.params_from_hf(bf16, model_cfg)
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(np.float32), params)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, loaded, rounded)))
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(loaded))


# ------------------------------------------------------------------------------ bad input


def test_missing_config_json(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    line = _assert_one_line_error(_run_cli("import", src, "--out", tmp_path / "run"), "config.json")
    assert str(src) in line
    assert not (tmp_path / "run").exists()


def test_unknown_model_type(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    _assert_one_line_error(_run_cli("import", src, "--out", tmp_path / "run"),
                           "'bert'", str(src / "config.json"))


def test_pickle_only_directory(llama_dir, tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    path, net = llama_dir
    shutil.copy(path / "config.json", src / "config.json")
    torch.save(net.state_dict(), src / "pytorch_model.bin")
    _assert_one_line_error(_run_cli("import", src, "--out", tmp_path / "run"),
                           "pytorch_model.bin", "safe_serialization=True")


def test_misshaped_tensor(llama_dir, tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    path, _ = llama_dir
    shutil.copy(path / "config.json", src / "config.json")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:16]
    save_file(tensors, src / "model.safetensors")
    _assert_one_line_error(_run_cli("import", src, "--out", tmp_path / "run"),
                           name, str(src / "model.safetensors"), "(16, 64)", "expected (32, 64)")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    tensors[name] = tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(hf.HFImportError, match=r"'model\.layers\.2\.mlp\.up_proj\.weight' is missing"):
        hf.params_from_hf(src, hf.config_from_hf(json.loads((path / "config.json").read_text())))


def test_unsupported_rope_scaling_and_unexpected_tensor(llama_dir, tmp_path):
    path, _ = llama_dir
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    with pytest.raises(hf.HFImportError, match="'yarn' is not supported"):
        hf.config_from_hf({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    shutil.copy(path / "config.json", tmp_path / "config.json")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(hf.HFImportError, match="unexpected tensors model.layers.0.self_attn.q_norm.weight"):
        hf.params_from_hf(tmp_path, hf.config_from_hf(cfg))


def test_config_from_hf_ignores_leftover_gin_bindings(tmp_path):
    # gin is global: a config.load() earlier in the process must not leak into imported configs.
    gin_file = tmp_path / "kv.gin"
    gin_file.write_text("ModelConfig.n_kv_heads = 2\nModelConfig.vocab_multiple = 64\nTrainConfig.steps = 7\n")
    config_lib.load(str(gin_file))
    gpt2 = hf.config_from_hf(dict(model_type="gpt2", n_embd=64, n_layer=1, n_head=4, vocab_size=300))
    assert gpt2.kv_heads == 4 and gpt2.vocab_multiple == 128


def test_llama_attention_bias_only(tmp_path):
    # maxlm has one use_bias switch: the MLP (and lm_head) biases HF lacks are imported as zeros.
    net = _save_hf("llama", tmp_path, attention_bias=True, mlp_bias=False, num_hidden_layers=2)
    model_cfg, params = _import(tmp_path)
    assert model_cfg.use_bias
    assert jax.tree.map(lambda x: x.shape, params) == _expected_tree(model_cfg)
    assert not params["layers"]["mlp"]["up_proj"]["bias"].any() and params["layers"]["attn"]["q_proj"]["bias"].any()
    ids = _tokens(model_cfg.vocab_size)
    diff = np.abs(_maxlm_logits(model_cfg, params, ids) - _hf_logits(net, ids)).max()
    print(f"llama attention-bias max abs logit diff {diff:.2e}")
    assert diff < ATOL
