"""maxlm.hf export: transformers loads what maxlm writes and computes the same logits.

* A briefly trained run (through the Checkpointer, as training saves it) and random Llama (GQA,
  untied, llama3 rope scaling) and GPT-2 models load with no missing or unexpected keys; fp32
  logits match maxlm's within 1e-4 on 300 tokens, a bf16 export within a mean KL of 1e-3.
* import -> export of a save_pretrained checkpoint gives back every tensor bit for bit.
* Sharded exports load; the tokenizer files tokenise exactly as maxlm does, and decode back.
* Bad input is one line and exit 2; an export killed midway leaves no directory at --out.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import small_config, train_losses
from safetensors.numpy import load_file

from maxlm import config as config_lib
from maxlm import hf, model
from maxlm.data.tokenizer import BPETokenizer, ByteTokenizer, train_bpe
from maxlm.hf import export as export_lib
from maxlm.hf.load import LoadedModel, load_model
from maxlm.train.checkpoint import Checkpointer

ATOL = 1e-4
LENGTH = 300
STEP = 3
LLAMA = dict(vocab_size=259, vocab_multiple=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=160,
             max_seq_len=512, norm="rms", activation="swiglu", position="rope", rope_theta=500000.0,
             rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
             rope_original_max_len=64, tie_embeddings=False, dtype="float32")
GPT2 = dict(vocab_size=259, vocab_multiple=128, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_seq_len=512,
            norm="layer", activation="gelu", position="learned", use_bias=True, tie_embeddings=True,
            dtype="float32")
TEXTS = ["hello world", "def f(x):\n    return {'a': x ** 2}  # comment\n\tpass\n",
         "naïve café — Ünïcödé, 中文字符, Ελληνικά, русский", "emoji 😀👍🏽🇫🇷 and ZWJ 👩‍👩‍👧",
         "literal <|bos|> and <|eos|><|pad|> in text", "", " ", "  leading and trailing  \n\n"]


# ---------------------------------------------------------------------------------------------
# helpers


def _random_params(model_cfg, seed=0):
    """Every leaf random (norm scales and biases too), so every row of the table is exercised."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: (0.1 * rng.standard_normal(x.shape)).astype(np.float32),
                        model.abstract_params(model_cfg))


def _loaded(fields, seed=0):
    cfg = config_lib.ModelConfig(**fields)
    return LoadedModel(cfg, _random_params(cfg, seed), ByteTokenizer(), None, f"random {seed}")


def _tokens(vocab, batch=2):
    return np.random.default_rng(1).integers(0, vocab, size=(batch, LENGTH), dtype=np.int64)


def _maxlm_logits(model_cfg, params, ids):
    cfg = dataclasses.replace(model_cfg, dtype="float32")
    logits = jax.jit(lambda p, x: model.forward(cfg, p, x)[0])(params, jnp.asarray(ids, jnp.int32))
    return np.asarray(logits)[..., :cfg.vocab_size]


def _hf_load(out, **kwargs):
    net, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager", **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return net.eval()


def _hf_logits(net, ids):
    with torch.no_grad():
        return net(torch.from_numpy(ids)).logits.float().numpy()


def _mean_kl(p_logits, q_logits):
    """Mean over positions of KL(softmax p || softmax q), in float64."""
    def log_softmax(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    logp, logq = log_softmax(p_logits), log_softmax(q_logits)
    return float(np.mean(np.sum(np.exp(logp) * (logp - logq), axis=-1)))


def _run_main(argv, capsys):
    try:
        code = hf.main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out.strip().splitlines(), captured.err.strip().splitlines()


def _refused(argv, capsys, *fragments):
    code, _, err = _run_main(argv, capsys)
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], (code, err)
    for fragment in fragments:
        assert str(fragment) in err[0], (fragment, err[0])
    return err[0]


def _save_run(run_dir, cfg, state, step):
    """A run directory as training leaves it: config.gin + a verified checkpoint."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.gin").write_text(config_lib.operative_gin(cfg))
    ckpt = Checkpointer(run_dir, cfg.checkpoint, log=lambda _: None)
    ckpt.save(step, state, None, cfg.to_dict(), {})
    ckpt.wait()
    ckpt.close()
    return run_dir


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A small GQA Llama trained STEP real steps on one device, saved as training saves it."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    cfg = small_config(num_devices=1, model=dict(n_kv_heads=2, max_seq_len=512, vocab_multiple=128),
                       train=dict(run_dir=str(run_dir), global_batch=4, seq_len=32))
    losses, state = train_losses(cfg, jax.devices()[:1], steps=STEP)
    assert losses[-1] < losses[0]
    return _save_run(run_dir, cfg, state, STEP)


@pytest.fixture(scope="module")
def trained_export(trained_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports") / "trained"
    summary = hf.export_model(trained_run, out)
    assert f"(step {STEP})" in summary and str(out) in summary
    return out


# ---------------------------------------------------------------------------------------------
# (a) transformers loads the export and computes maxlm's logits


@pytest.mark.slow
def test_trained_run_export_matches_transformers(trained_run, trained_export):
    out = trained_export
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", hf.MANIFEST])
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "a staging directory was left"
    config = json.loads((out / "config.json").read_text())
    for key in ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "tie_word_embeddings",
                "attention_bias", "mlp_bias", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert key in config, key
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (259, 256, 257)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258, "do_sample": False}
    with open(out / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "pt"}
    assert hf.verify_manifest(out) is None
    manifest = json.loads((out / hf.MANIFEST).read_text())
    assert manifest["step"] == STEP and set(manifest["files"]) == {p.name for p in out.iterdir()} - {hf.MANIFEST}

    loaded = load_model(trained_run)
    ids = _tokens(259)
    ours = _maxlm_logits(loaded.cfg, loaded.params, ids)
    theirs = _hf_logits(_hf_load(out), ids)
    print(f"trained run fp32: max |logit diff| = {np.abs(ours - theirs).max():.2e}")
    assert np.abs(ours - theirs).max() < ATOL, np.abs(ours - theirs).max()

    # maxlm reads its own export back (the Hugging Face path of load_model), tokenizer included.
    back = load_model(out)
    assert isinstance(back.tokenizer, ByteTokenizer) and back.cfg.vocab_size == 259
    ours_hf, back_hf = (hf.export_params(jax.tree.map(np.asarray, m.params), m.cfg, "llama") for m in (loaded, back))
    assert all(np.array_equal(ours_hf[k], back_hf[k]) for k in ours_hf)  # equal up to the vocab padding


@pytest.mark.slow
@pytest.mark.parametrize("fields", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_random_model_export_fp32_and_bf16(fields, tmp_path):
    loaded = _loaded(fields)
    family = hf.infer_family(loaded.cfg)
    hf.export_model(loaded, tmp_path / "fp32")
    hf.export_model(loaded, tmp_path / "bf16", dtype="bf16")
    config = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert config["architectures"] == [hf.SUPPORTED[family]]
    if family == "llama":
        assert config["num_key_value_heads"] == 2 and not config["tie_word_embeddings"]
        assert config["rope_scaling"]["rope_type"] == "llama3"
    ids = _tokens(fields["vocab_size"])
    ours = _maxlm_logits(loaded.cfg, loaded.params, ids)
    fp32 = _hf_logits(_hf_load(tmp_path / "fp32"), ids)
    net = _hf_load(tmp_path / "bf16")  # dtype from config.json: computes in bfloat16
    assert net.dtype == torch.bfloat16
    kl = _mean_kl(ours, _hf_logits(net, ids))
    print(f"{family}: fp32 max |logit diff| = {np.abs(ours - fp32).max():.2e}, bf16 mean KL = {kl:.2e}")
    assert np.abs(ours - fp32).max() < ATOL, np.abs(ours - fp32).max()
    assert kl < 1e-3, kl


def test_unexportable_models(tmp_path):
    # A Llama-shaped model cannot become GPT-2, nor a model that fits neither family anything;
    # a tokenizer with more tokens than the model embeds is refused too.
    with pytest.raises(hf.HFExportError, match="ModelConfig.norm = 'rms' does not fit gpt2"):
        hf.export_model(_loaded(LLAMA), tmp_path / "x", family="gpt2")
    with pytest.raises(hf.HFExportError, match="fits neither llama"):
        hf.export_model(_loaded({**LLAMA, "activation": "gelu"}), tmp_path / "x")
    with pytest.raises(hf.HFExportError, match="the tokenizer has 259 tokens but ModelConfig.vocab_size = 200"):
        hf.export_model(_loaded({**LLAMA, "vocab_size": 200}), tmp_path / "x")
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------
# (b) import -> export is bit-exact; (c) sharding


def _save_pretrained(kind, path):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=509, max_position_embeddings=512, tie_word_embeddings=False,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=64), initializer_range=0.1)
        net = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=333, n_positions=512,
                                      initializer_range=0.1, bos_token_id=0, eos_token_id=0)
        net = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: perturb them too
        for p in net.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape))
    net.save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_import_export_round_trip_is_bit_exact(kind, tmp_path, capsys):
    src = _save_pretrained(kind, tmp_path / "hf")
    saved = load_file(str(src / "model.safetensors"))
    code, _, err = _run_main(["import", src, "--out", tmp_path / "run", "--dtype", "float32"], capsys)
    assert code == 0, err
    for name, source in (("via_run", tmp_path / "run"), ("direct", src)):
        code, out, err = _run_main(["export", source, "--out", tmp_path / name], capsys)
        assert code == 0 and len(out) == 1 and out[0].startswith("exported"), (out, err)
        exported = load_file(str(tmp_path / name / "model.safetensors"))
        assert sorted(exported) == sorted(saved), name
        for key, value in saved.items():
            assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes(), (name, key)


def test_bf16_hf_source_exports_in_its_own_dtype_with_its_generation_config(tmp_path, capsys):
    src = _save_pretrained("gpt2", tmp_path / "hf")
    net = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    net.generation_config.update(do_sample=True, top_k=7, temperature=0.6, max_new_tokens=33)
    net.save_pretrained(tmp_path / "bf16", safe_serialization=True)
    src = tmp_path / "bf16"
    saved = load_file(str(src / "model.safetensors"))
    assert {v.dtype.name for v in saved.values()} == {"bfloat16"}
    code, out, err = _run_main(["export", src, "--out", tmp_path / "out"], capsys)  # no --dtype
    assert code == 0 and "bfloat16" in out[0], (out, err)
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(exported) == sorted(saved)
    for key, value in saved.items():
        assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes(), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert ((tmp_path / "out" / "generation_config.json").read_bytes()
            == (src / "generation_config.json").read_bytes())
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "out").top_k == 7
    assert hf.verify_manifest(tmp_path / "out") is None
    # An explicit --dtype still wins; a maxlm run defaults to float32.
    code, out, err = _run_main(["export", src, "--out", tmp_path / "fp32", "--dtype", "fp32"], capsys)
    assert code == 0 and {v.dtype.name for v in load_file(str(tmp_path / "fp32" / "model.safetensors")).values()} \
        == {"float32"}, err
    assert "float32" in hf.export_model(_loaded(GPT2), tmp_path / "run_export")


@pytest.mark.slow
def test_sharded_export_loads(tmp_path):
    loaded = _loaded(LLAMA)
    summary = hf.export_model(loaded, tmp_path / "sharded", max_shard_bytes=100_000)
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    count = len(files)
    assert count > 2 and files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert f"{count} shards" in summary
    index = json.loads((tmp_path / "sharded" / hf.INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(files)
    sizes = {f: (tmp_path / "sharded" / f).stat().st_size for f in files}
    assert index["metadata"]["total_size"] <= sum(sizes.values())
    ids = _tokens(LLAMA["vocab_size"], batch=1)[:, :64]
    ours = _maxlm_logits(loaded.cfg, loaded.params, ids)
    assert np.abs(_hf_logits(_hf_load(tmp_path / "sharded"), ids) - ours).max() < ATOL


# ---------------------------------------------------------------------------------------------
# (d) bad input: one line, exit 2, nothing written


def test_bad_inputs_are_one_line(trained_run, tmp_path, capsys):
    out = tmp_path / "out"
    _refused(["export", tmp_path / "nope", "--out", out], capsys, tmp_path / "nope", "does not exist")
    _refused(["export", trained_run, "--out", out, "--step", 99], capsys, "no checkpoint of step 99",
             f"have: {STEP}")
    _refused(["export", trained_run, "--out", out, "--family", "gpt2"], capsys,
             "ModelConfig.norm", "gpt2")
    _refused(["export", trained_run, "--out", out, "--family", "bert"], capsys, "--family")
    _refused(["export", trained_run, "--out", out, "--dtype", "int8"], capsys, "--dtype")
    assert not out.exists()
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    _refused(["export", trained_run, "--out", full], capsys, full, "not empty")
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    (tmp_path / "file").write_text("x")
    _refused(["export", trained_run, "--out", tmp_path / "file"], capsys, "not a directory")
    # sliding_window: a copy of the run whose config.gin asks for one
    windowed = tmp_path / "windowed"
    shutil.copytree(trained_run, windowed)
    with open(windowed / "config.gin", "a") as f:
        f.write("\nModelConfig.sliding_window = 16\n")
    _refused(["export", windowed, "--out", out], capsys, f"{windowed / 'config.gin'}: ModelConfig.sliding_window = 16",
             "LlamaForCausalLM")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full", "windowed"]


def test_empty_out_directory_is_used(trained_run, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = _run_main(["export", f"{trained_run}/checkpoints/{STEP}", "--out", tmp_path / "empty",
                                "--step", STEP], capsys)
    assert code == 0 and not err and (tmp_path / "empty" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------
# (e) an interrupted export leaves nothing that looks complete


def test_failed_write_leaves_nothing_and_rerun_succeeds(trained_run, tmp_path, capsys, monkeypatch):
    real, calls = export_lib._write_shard, []

    def fail_second(path, tensors):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(path))
        real(path, tensors)

    monkeypatch.setattr(export_lib, "_write_shard", fail_second)
    out = tmp_path / "deep" / "out"
    line = _refused(["export", trained_run, "--out", out, "--max-shard-gb", 0.0001], capsys,
                    "No space left on device", "nothing was exported")
    assert "model-00002" in line
    assert not (tmp_path / "deep").exists(), "the staging directory or made parents were left"
    monkeypatch.setattr(export_lib, "_write_shard", real)
    code, _, err = _run_main(["export", trained_run, "--out", out], capsys)
    assert code == 0 and hf.verify_manifest(out) is None, err


def test_safetensors_write_error_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk as SafetensorError, not OSError: still one line, no stage."""
    import safetensors.numpy
    from safetensors import SafetensorError

    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    monkeypatch.setattr(safetensors.numpy, "save_file", disk_full)
    out = tmp_path / "deep" / "out"
    with pytest.raises(hf.HFExportError) as err:
        hf.export_model(_loaded(GPT2), out)
    line = str(err.value)
    assert "\n" not in line and "model.safetensors" in line and "No space left on device" in line, line
    assert "nothing was exported" in line
    assert not (tmp_path / "deep").exists(), "the staging directory or made parents were left"

    def opaque(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: something odd")

    monkeypatch.setattr(safetensors.numpy, "save_file", opaque)
    line = str(pytest.raises(hf.HFExportError, hf.export_model, _loaded(GPT2), out).value)
    assert "model.safetensors" in line and "something odd" in line and not (tmp_path / "deep").exists(), line


@pytest.mark.slow
def test_killed_export_leaves_no_complete_directory(trained_run, tmp_path, capsys):
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import os, signal
        from maxlm.hf import export as e
        real = e._write_shard
        def write_then_die(path, tensors):
            real(path, tensors)
            os.kill(os.getpid(), signal.SIGKILL)
        e._write_shard = write_then_die
        e.export_model({str(trained_run)!r}, {str(out)!r})
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not out.exists()
    stages = [p for p in tmp_path.iterdir() if p.name.startswith(".out.hf-export.tmp-")]
    assert len(stages) == 1 and (stages[0] / "model.safetensors").is_file()  # the killed one's leftovers
    assert not (stages[0] / hf.MANIFEST).exists()
    code, _, err = _run_main(["export", trained_run, "--out", out], capsys)
    assert code == 0, err
    assert hf.verify_manifest(out) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "the dead stage was not cleared"


# ---------------------------------------------------------------------------------------------
# (f) the tokenizer files tokenise as maxlm does


def _check_tokenizer(maxlm_tok, out, texts, decodes_back):
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (
        maxlm_tok.bos_id, maxlm_tok.eos_id, maxlm_tok.pad_id)
    reloaded = hf.load_tokenizer(out)
    assert type(reloaded) is type(maxlm_tok) and reloaded.vocab_size == maxlm_tok.vocab_size
    for text in texts:
        want = maxlm_tok.encode(text, add_bos=True, add_eos=False).tolist()
        assert auto(text).input_ids == want, text
        assert reloaded.encode(text).tolist() == maxlm_tok.encode(text).tolist(), text
        back = auto.decode(want, skip_special_tokens=True)
        assert back == maxlm_tok.decode(want), text
        if decodes_back(text):
            assert back == text, text


def test_byte_tokenizer_files(tmp_path):
    tok = ByteTokenizer()
    names = hf.write_tokenizer(tok, tmp_path, model_max_length=4096)
    assert sorted(names) == sorted(p.name for p in tmp_path.iterdir())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["model_max_length"] == 4096
    assert "chat_template" not in config
    # The byte tokenizer spells special-token strings in text as bytes, and so must transformers.
    _check_tokenizer(tok, tmp_path, TEXTS + ["".join(map(chr, range(1, 600)))], lambda _: True)


def test_bpe_tokenizer_files(tmp_path):
    corpus = [t * 20 for t in TEXTS] + ["import os\nprint(os.getcwd())\n"] * 50
    path = tmp_path / "bpe.json"
    train_bpe(iter(corpus), 400, show_progress=False).save(str(path))
    tok = BPETokenizer(str(path))
    hf.write_tokenizer(tok, tmp_path / "out")
    # maxlm's BPE (the same tokenizers library) matches special-token strings in text: so does HF;
    # they then carry no text when decoded.
    _check_tokenizer(tok, tmp_path / "out", TEXTS, lambda text: "<|" not in text)


def test_load_tokenizer_of_a_foreign_hf_tokenizer(tmp_path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(hf.tokenizer_files.byte_alphabet())},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 256}))
    loaded = hf.load_tokenizer(tmp_path)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.vocab_size) == (256, 256, 256, 257)
    # No add_bos_token and a post-processor that adds none: transformers prepends nothing, nor does maxlm.
    ids = loaded.encode("hé <|endoftext|>")
    assert ids.tolist() == [104, 195, 169, 32, 256, 256] and loaded.decode(ids) == "hé "
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                                "add_bos_token": True}))
    assert hf.load_tokenizer(tmp_path).encode("h", add_eos=False).tolist() == [256, 104]


def test_gpt2_style_tokenizer_gets_no_bos_as_in_transformers(tmp_path):
    """bos = eos = <|endoftext|>, add_bos_token false or absent: transformers adds no bos, nor does maxlm."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(hf.tokenizer_files.byte_alphabet())},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.save_pretrained(tmp_path / "absent")
    fast.add_bos_token = False
    fast.save_pretrained(tmp_path / "false")
    for name in ("absent", "false"):
        auto = transformers.AutoTokenizer.from_pretrained(tmp_path / name)
        loaded = hf.load_tokenizer(tmp_path / name)
        assert loaded.bos_id == auto.bos_token_id == 256, name
        for text in ("hello world", "<|endoftext|> x", " "):
            assert loaded.encode(text, add_eos=False).tolist() == auto(text).input_ids, (name, text)
