"""maxlm.infer.generate and python -m maxlm.generate: greedy tokens equal transformers' greedy
``generate`` on the same weights; KV-cache logits equal full recomputation at every step (also
tensor-parallel); sampling options, stop tokens and stop strings; one compile per shape bucket;
one-line errors from the command line.

Executables are cached by (config, bucket, sampling mode, mesh), so the tests share models and
prompt shapes to compile as little as possible."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config, hf, model
from maxlm.config import ModelConfig
from maxlm.data.tokenizer import ByteTokenizer
from maxlm.infer import generate as gen
from maxlm.infer.placement import inference_mesh, param_shardings
from maxlm.infer.sampling import SamplingParams, penalise

# init_std 0.2: logits far apart, so fp32 argmax does not flip between implementations.
LLAMA = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=300, vocab_multiple=8,
             max_seq_len=128, dtype="float32", init_std=0.2)
GPT2 = dict(LLAMA, n_kv_heads=0, norm="layer", activation="gelu", position="learned", use_bias=True,
            tie_embeddings=True)
FAMILIES = {"llama": LLAMA, "gpt2": GPT2}
PROMPT_LENGTHS = (7, 19, 3, 12)
NEW = 64


@pytest.fixture(scope="module")
def models():
    out = {}
    for family, fields in FAMILIES.items():
        cfg = ModelConfig(**fields)
        out[family] = cfg, model.init_params(cfg, jax.random.PRNGKey(1))
    return out


def prompts(vocab=256, lengths=PROMPT_LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).astype(np.int32) for n in lengths]


@pytest.fixture(scope="module")
def greedy(models):
    """Greedy tokens of every family for PROMPTS (no stop tokens)."""
    return {f: gen.run(cfg, params, prompts(), NEW).tokens for f, (cfg, params) in models.items()}


_forward = jax.jit(lambda cfg, p, t: model.forward(cfg, p, t)[0], static_argnums=0)


def full_logits(cfg, params, rows):
    """Logits of the full forward (no cache) over each row, [T, vocab] per row. The rows are
    right-padded to max_seq_len (one compile per model; causal, so padding changes nothing before it)."""
    batch = np.zeros((len(rows), cfg.max_seq_len), np.int32)
    for i, r in enumerate(rows):
        batch[i, :len(r)] = r
    logits = np.asarray(_forward(cfg, params, batch))
    return [logits[i, :len(r), :cfg.vocab_size] for i, r in enumerate(rows)]


# ---- (a) parity with transformers


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_tokens_equal_transformers_generate(family, models, greedy):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg, params = models[family]
    fields = hf.config_to_hf(cfg, family)
    hf_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    net = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager", dtype=torch.float32)
    tensors = hf.export_params(jax.device_get(params), cfg, family)
    missing, unexpected = net.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()},
                                              strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    net.eval()
    net.generation_config.eos_token_id = None  # random weights: run all NEW tokens, as maxlm does here
    net.generation_config.pad_token_id = 0
    for prompt, ours in zip(prompts(), greedy[family]):
        ids = torch.from_numpy(prompt.astype(np.int64))[None]
        with torch.no_grad():
            out = net.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                               use_cache=True)
        assert out[0, len(prompt):].tolist() == ours.tolist()


@pytest.fixture(scope="module")
def exported(models, tmp_path_factory):
    """Each family written by ``maxlm.hf.export_model`` and read back by transformers from disk."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from maxlm.hf.load import LoadedModel

    nets = {}
    for family, (cfg, params) in models.items():
        out = tmp_path_factory.mktemp("export") / family
        hf.export_model(LoadedModel(cfg, jax.device_get(params), ByteTokenizer(), None, f"random {family}"), out)
        net = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                                dtype=torch.float32).eval()
        net.generation_config.eos_token_id = None  # random weights: run every token, as maxlm does here
        net.generation_config.pad_token_id = 0
        nets[family] = net
    return nets


def _hf_generate(net, prompt, new, **kwargs):
    import torch

    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    with torch.no_grad():
        out = net.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                           use_cache=True, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_tokens_equal_transformers_through_the_exported_directory(family, exported, greedy):
    for prompt, ours in zip(prompts(), greedy[family]):  # lengths 7, 19, 3, 12; NEW = 64 tokens
        assert _hf_generate(exported[family], prompt, NEW) == ours.tolist()


@pytest.mark.slow
def test_repetition_penalty_over_decode_steps_equals_transformers(models, exported):
    cfg, params = models["llama"]
    rows = prompts(lengths=(7, 19, 3, 12), seed=11)
    ours = gen.run(cfg, params, rows, 16, sampling=SamplingParams(repetition_penalty=1.3)).tokens
    plain = gen.run(cfg, params, rows, 16).tokens
    assert any((a != b).any() for a, b in zip(ours, plain))  # the penalty changed something
    for prompt, got in zip(rows, ours):
        assert _hf_generate(exported["llama"], prompt, 16, repetition_penalty=1.3) == got.tolist()


# ---- (b) cached decode equals recomputation, on one device and tensor-parallel


def stepwise_errors(cfg, params, mesh=None):
    """Max |logits - full forward| at the prefill and at every decode step of generate.run,
    streamed one step at a time (the executables of the one-call decode, driven in chunks)."""
    seen = []
    result = gen.run(cfg, params, prompts(), NEW, mesh=mesh, on_progress=lambda p: seen.append(np.asarray(p.logits)))
    assert len(seen) == NEW and result.finish == ["length"] * 4
    full = full_logits(cfg, jax.device_get(params), [np.concatenate([p, t]) for p, t in zip(prompts(), result.tokens)])
    errors = []
    for step, logits in enumerate(seen):
        for row, (p, f) in enumerate(zip(prompts(), full)):
            errors.append(np.abs(logits[row, :cfg.vocab_size] - f[len(p) - 1 + step]).max())
            assert (logits[row, cfg.vocab_size:] == -np.inf).all()  # the padded vocab is never picked
    return np.array(errors), result


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cached_decode_equals_recomputation(family, models):
    errors, _ = stepwise_errors(*models[family])
    assert errors.max() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family,tensor", [("llama", 2), ("gpt2", 4)])
def test_tensor_parallel_decode_equals_recomputation(family, tensor, models, greedy):
    cfg, params = models[family]
    mesh = inference_mesh(tensor)
    placed = jax.device_put(params, param_shardings(cfg, mesh))
    assert placed["layers"]["attn"]["k_proj"]["kernel"].sharding.spec[2] == "tensor"  # kv heads split
    errors, result = stepwise_errors(cfg, placed, mesh)
    assert errors.max() < 1e-4
    assert all((a == b).all() for a, b in zip(greedy[family], result.tokens))


# ---- (c) sampling options, stops


def test_top_k_one_and_tiny_top_p_equal_greedy(models, greedy):
    cfg, params = models["llama"]
    for sampling in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)):
        out = gen.run(cfg, params, prompts(), NEW, sampling=sampling, seed=7).tokens
        assert all((a == b).all() for a, b in zip(out, greedy["llama"])), sampling


def test_top_p_removes_by_rank_as_transformers_does():
    """Top-p is Hugging Face's TopPLogitsWarper: the same tokens without ties; with ties, the same
    number of tokens and the same kept logits (torch.sort orders tied logits arbitrarily, so which
    of the tied tokens survive is unspecified there; here the lower ids go first, as a stable sort
    ascending puts them)."""
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import TopPLogitsWarper

    from maxlm.infer.sampling import _top_p

    def ours(logits, top_p):
        return np.isfinite(np.asarray(_top_p(jnp.asarray(logits, jnp.float32), jnp.float32(top_p))))

    def theirs(logits, top_p):
        warped = TopPLogitsWarper(top_p)(None, torch.from_numpy(np.asarray(logits, np.float32)))
        return torch.isfinite(warped).numpy()

    tied = np.array([[1.0, 1.0, 1.0, 0.0]])
    # Each tied token has probability ~0.31: two of the three are kept (by rank), not all three.
    assert ours(tied, 0.5).tolist() == [[False, True, True, False]] and theirs(tied, 0.5).sum() == 2
    rng = np.random.default_rng(0)
    for trial in range(40):
        top_p = float(rng.uniform(0.05, 0.95))
        logits = rng.standard_normal((8, 50)).astype(np.float32) * 3
        assert (ours(logits, top_p) == theirs(logits, top_p)).all(), (trial, top_p)
        logits = rng.integers(-3, 3, size=(8, 33)).astype(np.float32) * rng.choice([0.5, 1.0, 2.0])  # many ties
        a, b = ours(logits, top_p), theirs(logits, top_p)
        assert (a.sum(1) == b.sum(1)).all(), (trial, top_p)
        for row, x, y in zip(logits, a, b):
            assert sorted(row[x]) == sorted(row[y]), (trial, top_p)


def test_cache_key_holds_the_parameter_dtypes(models):
    """The same cfg with bf16-cast parameters is another executable, not the float32 one's."""
    cfg, params = models["llama"]
    gen.run(cfg, params, prompts()[:1], 4)
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    before = dict(gen.COMPILES)
    result = gen.run(cfg, half, prompts()[:1], 4)
    assert gen.COMPILES["prefill"] - before.get("prefill", 0) == 1 and len(result.tokens[0]) == 4
    before = dict(gen.COMPILES)
    gen.run(cfg, half, prompts()[:1], 4)
    assert gen.COMPILES == before


def test_same_seed_same_output(models, greedy):
    cfg, params = models["llama"]
    sampling = SamplingParams(temperature=3.0, top_p=0.99)  # the top-p mode: no new compile
    a, b, c = (gen.run(cfg, params, prompts(), NEW, sampling=sampling, seed=s).tokens for s in (3, 3, 4))
    assert all((x == y).all() for x, y in zip(a, b))
    assert any((x != y).any() for x, y in zip(a, c))
    assert any((x != y).any() for x, y in zip(a, greedy["llama"]))


def test_repetition_penalty_matches_a_hand_computation_and_the_context_ends_rows(models):
    cfg, params = models["llama"]
    penalty = 50.0
    rows = prompts(vocab=cfg.vocab_size, lengths=(100, 100, 100, 120), seed=5)
    result = gen.run(cfg, params, rows, 20, sampling=SamplingParams(repetition_penalty=penalty))
    changed = 0
    for prompt, logits, got in zip(rows, full_logits(cfg, params, rows), result.tokens):
        last = logits[-1].astype(np.float64)
        hand = last.copy()
        for t in set(prompt.tolist()):  # Hugging Face: divide a positive logit, multiply a negative one
            hand[t] = last[t] / penalty if last[t] > 0 else last[t] * penalty
        assert got[0] == int(np.argmax(hand))
        changed += int(np.argmax(hand) != np.argmax(last))
    assert changed  # the penalty decided at least one row
    # The 120-token row reaches the context (max_seq_len 128) after 8 tokens.
    assert [len(t) for t in result.tokens] == [20, 20, 20, 8] and result.finish == ["length"] * 4
    x = np.array([[2.0, -2.0, 1.0, -1.0]], np.float32)
    seen = np.array([[True, True, False, False]])
    assert np.asarray(penalise(x, seen, 2.0)).tolist() == [[1.0, -4.0, 1.0, -1.0]]


def test_stop_tokens_end_rows_and_the_loop(models, greedy):
    cfg, params = models["llama"]
    ref = greedy["llama"]
    stop = [int(r[2]) for r in ref]  # every row meets one of these by its third token
    result = gen.run(cfg, params, prompts(), NEW, stop_tokens=stop)
    for want, got, finish in zip(ref, result.tokens, result.finish):
        end = min(i for i, t in enumerate(want.tolist()) if t in stop) + 1
        assert got.tolist() == want[:end].tolist() and finish == "stop_token"
    assert result.steps == 3  # the loop exited when the last row finished, not after NEW steps
    one = gen.run(cfg, params, prompts(), NEW, stop_tokens=[int(ref[0][4])]).finish
    assert one[0] == "stop_token" and "length" in one


def test_stop_strings_end_rows_with_their_text_cut(models, greedy):
    cfg, params = models["llama"]
    tok = ByteTokenizer()
    ref = greedy["llama"]
    text0 = tok.decode(ref[0])
    stop = text0[len(text0) // 3:len(text0) // 3 + 2]
    assert stop
    result = gen.run(cfg, params, prompts(), NEW, stop_strings=[stop], tokenizer=tok)
    assert result.finish[0] == "stop_string"
    assert result.texts[0] == text0[:text0.find(stop)]
    got = result.tokens[0]
    assert got.tolist() == ref[0][:len(got)].tolist()
    assert stop in tok.decode(got) and stop not in tok.decode(got[:-1])  # ends on the completing token
    for want, text, finish in zip(ref[1:], result.texts[1:], result.finish[1:]):
        full = tok.decode(want)
        assert (finish == "stop_string") == (stop in full)
        assert text == (full[:full.find(stop)] if stop in full else full)


def test_one_compile_per_bucket(models):
    cfg, params = models["gpt2"]
    gen.run(cfg, params, [np.arange(1, 40)], 1)  # another bucket: warms jax's own small executables
    compiles = []
    listener = lambda name, *_, **__: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        before = dict(gen.COMPILES)
        for n in (5, 9, 14):  # width bucket 16, cache bucket 32 (n + 17 new tokens), batch 1: one bucket
            gen.run(cfg, params, [np.arange(1, n + 1)], 17)
        built = {k: gen.COMPILES[k] - before.get(k, 0) for k in ("prefill", "decode")}
        assert built == {"prefill": 1, "decode": 1}
        assert len(compiles) == 2, compiles  # XLA compiled exactly those two
        gen.run(cfg, params, [np.arange(1, 30)], 1)  # width 32: the next bucket (prefill only)
        assert gen.COMPILES["prefill"] - before.get("prefill", 0) == 2
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_streaming_prints_the_completion_as_it_comes(models, capsys):
    cfg, params = models["gpt2"]  # the bucket of test_one_compile_per_bucket
    tok = ByteTokenizer()
    printed = []
    stream = gen.TerminalStream([""])
    result = gen.run(cfg, params, [np.arange(65, 70)], 17, tokenizer=tok,
                     on_progress=lambda p: (stream(p), printed.append(capsys.readouterr().out)))
    assert len(printed) == 17 and sum(bool(p) for p in printed) > 1 and "".join(printed) == result.texts[0] + "\n"


# ---- (d) one compile per bucket


def test_buckets_and_prompt_errors(models):
    assert [gen.bucket(n, 128) for n in (1, 16, 17, 64, 65, 200)] == [16, 16, 32, 64, 128, 128]
    cfg, params = models["llama"]
    with pytest.raises(gen.PromptError, match="prompt has 128 tokens") as err:
        gen.run(cfg, params, [np.ones(3, np.int32), np.ones(128, np.int32)], 4)
    assert err.value.index == 1
    with pytest.raises(ValueError, match="top_p = 0"):
        gen.run(cfg, params, [np.ones(3, np.int32)], 4, sampling=SamplingParams(top_p=0.0))


# ---- (e) the command line


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as ``maxlm.hf import`` makes one: config.gin + params, no checkpoint."""
    from maxlm.train import checkpoint

    path = tmp_path_factory.mktemp("run")
    cfg = config.build(num_devices=1, model=dict(LLAMA, vocab_size=259, max_seq_len=64),
                       train=dict(global_batch=8, seq_len=32, steps=10, sample_tokens=0,
                                  init_params=str(path / "params")))
    checkpoint.save_params(path / "params", model.init_params(cfg.model, jax.random.PRNGKey(0)))
    (path / "config.gin").write_text(config.operative_gin(cfg))
    return path


def cli(argv, capsys):
    from maxlm.generate import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


def test_cli_bad_input_is_one_line_and_exit_2(run_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"prompt": 1\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"text": "a"}\n')
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "ok"}\n' + json.dumps({"prompt": "x" * 100}) + "\n")
    ck = ["--checkpoint", run_dir]
    cases = [
        (["--checkpoint", tmp_path / "nope", "--prompt", "a"], "nope: does not exist"),
        ([*ck, "--prompts", tmp_path / "missing.jsonl"], "missing.jsonl: --prompts file does not exist"),
        ([*ck, "--prompts", empty], "empty.jsonl: --prompts file holds no prompts"),
        ([*ck, "--prompts", bad], "bad.jsonl:3: not valid JSON"),
        ([*ck, "--prompts", nofield], 'nofield.jsonl:1: expected an object with a "prompt" field'),
        ([*ck, "--prompts", long], "long.jsonl:2: prompt has 101 tokens"),
        ([*ck, "--prompt", "a", "--prompt", "b" * 80], "--prompt 2: prompt has 81 tokens"),
        ([*ck, "--prompt", "a", "--top-p", "0"], "--top-p: 0 must lie in (0, 1]"),
        ([*ck, "--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens: 0 must be >= 1"),
        ([*ck, "--prompt", "a", "--temperature", "x"], "--temperature: 'x' is not a number"),
        ([*ck, "--prompt", "a", "--seed", str(2**70)], f"--seed: {2**70} must lie in [0, 2**32)"),
        ([*ck, "--prompt", "a", "--seed", "-1"], "--seed: -1 must lie in [0, 2**32)"),
        ([*ck, "--prompt", "a", "--stop-token", "900"], "--stop-token 900: not a token id"),
        ([*ck, "--prompt", "a", "--stop", ""], "--stop: a stop string must not be empty"),
        ([*ck, "--prompt", "a", "--step", "3"], "no checkpoint of step 3"),
        ([*ck, "--prompt", "a", "--tensor", "3"], "ModelConfig.n_heads = 4 does not divide by --tensor = 3"),
        ([*ck, "--prompt", "a", "--out", tmp_path / "no" / "x.jsonl"], "--out's directory"),
        ([*ck], "one of the arguments --prompt --prompts is required"),
    ]
    for argv, message in cases:
        code, out, err = cli(argv, capsys)
        assert code == 2 and len(err) == 1 and message in err[0], (argv, err)
        assert "Traceback" not in err[0] and out == "", (argv, out)


@pytest.mark.slow
def test_cli_generates_streams_and_writes_results(run_dir, tmp_path, capsys):
    out_file = tmp_path / "results.jsonl"
    code, out, err = cli(["--checkpoint", run_dir, "--prompt", "def ", "--max-new-tokens", 6, "--out", out_file],
                         capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("def ") and lines[-1].startswith("prefill 5 tokens in")
    assert "decode" in lines[-1] and "tokens/s" in lines[-1]
    (row,) = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert row["prompt"] == "def " and row["finish_reason"] in ("length", "stop_token")
    assert lines[0] == "def " + row["completion"] and 1 <= len(row["tokens"]) <= 6
    # Two prompts from a file, printed at the end; the same bucket as above but for the batch.
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text('{"prompt": "ab"}\n\n{"prompt": "def "}\n')
    code, out, err = cli(["--checkpoint", run_dir, "--prompts", prompts_file, "--max-new-tokens", 6,
                          "--no-stream", "--out", out_file], capsys)
    assert code == 0, err
    assert out.startswith("[1] ab") and "\n[2] def " in out and "prefill 8 tokens" in out
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["ab", "def "] and rows[1] == row  # greedy: same completion
