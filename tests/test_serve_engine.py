"""The serving engine against ``maxlm.infer.generate`` (the independent reference: one dense cache,
one batch, no scheduler): continuous batching, chunked prefill, paging, preemption and prefix
caching must change no greedy token. Also: no KV block leaks, copy-on-write, aborts, seeded
sampling that does not depend on the batch, stop strings and tokens, bad requests."""

import jax
import numpy as np
import pytest

from maxlm import model
from maxlm.config import ModelConfig
from maxlm.data.tokenizer import ByteTokenizer
from maxlm.infer import generate as gen
from maxlm.infer.placement import inference_mesh, param_shardings
from maxlm.serve.engine import (
    Engine,
    EngineConfig,
    QueueFull,
    RequestError,
    RequestParams,
)

LLAMA = dict(vocab_size=259, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=128,
             dtype="float32", init_std=0.2)
MOST_NEW = 27


@pytest.fixture(scope="module")
def llama():
    cfg = ModelConfig(**LLAMA)
    return cfg, model.init_params(cfg, jax.random.PRNGKey(1))


def load(n=200, seed=0, shared=0):
    """n prompts of 2..100 tokens (after a common prefix of ``shared`` tokens) and output limits."""
    rng = np.random.default_rng(seed)
    head = list(rng.integers(0, 256, shared))
    prompts = [head + list(rng.integers(0, 256, int(rng.integers(2, 100 - shared)))) for _ in range(n)]
    return prompts, [int(rng.integers(1, MOST_NEW + 1)) for _ in range(n)]


def reference(cfg, params, prompts):
    """Greedy tokens from maxlm.generate (MOST_NEW each; a shorter limit is a prefix)."""
    return gen.run(cfg, params, [np.asarray(p, np.int32) for p in prompts], MOST_NEW).tokens


def serve(engine, prompts, limits, **params):
    """Submit every request at once and step the engine until all finish; per request:
    (tokens, finish reason, text, cached tokens)."""
    results = {}

    def collect(out):
        r = results.setdefault(out.request_id, {"tokens": [], "text": "", "finish": None, "cached": 0})
        r["tokens"] += out.token_ids
        r["text"] += out.text
        r["finish"], r["cached"] = out.finish_reason, out.cached_tokens
    ids = [engine.submit(p, RequestParams(max_tokens=n, ignore_eos=True, **params), collect)
           for p, n in zip(prompts, limits)]
    while engine.busy():
        engine.step()
    return [results[i] for i in ids]


def assert_equal_reference(results, ref, limits):
    for i, (r, want, n) in enumerate(zip(results, ref, limits)):
        assert r["tokens"] == list(want[:n]), f"request {i}: {r['tokens']} != {list(want[:n])}"
        assert r["finish"] == "length"


def assert_no_leak(engine):
    assert engine.blocks.leaks() == []
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1


@pytest.mark.slow
def test_concurrent_load_equals_generate_and_leaks_nothing(llama):
    cfg, params = llama
    prompts, limits = load()
    engine = Engine(cfg, params, config=EngineConfig(max_num_seqs=32, block_size=8, max_prefill_tokens=64))
    results = serve(engine, prompts, limits)
    assert_equal_reference(results, reference(cfg, params, prompts), limits)
    assert max(map(len, prompts)) > 64  # some prompts were prefilled in chunks
    assert_no_leak(engine)
    # Only the last block of each sequence is part-filled: with 8-token blocks and these short
    # sequences (10-125 tokens) that is a few percent of the slots.
    print(f"KV waste over the run: {engine.kv_waste():.1%}")
    assert 0 < engine.kv_waste() < 0.10


@pytest.mark.slow
def test_preemption_changes_no_token(llama):
    cfg, params = llama
    prompts, limits = load(64, seed=1)
    # Room for two full contexts: 32 requests cannot all keep their blocks.
    engine = Engine(cfg, params, config=EngineConfig(max_num_seqs=32, block_size=8, num_blocks=2 * 16 + 1))
    results = serve(engine, prompts, limits)
    assert engine.preemptions > 0
    assert_equal_reference(results, reference(cfg, params, prompts), limits)
    assert_no_leak(engine)


@pytest.mark.slow
def test_prefix_cache_hits_and_changes_no_token(llama):
    cfg, params = llama
    prompts, limits = load(24, seed=2, shared=64)  # a long shared "system prompt"
    config = EngineConfig(max_num_seqs=8, block_size=8)
    cached = Engine(cfg, params, config=config)
    with_cache = serve(cached, prompts, limits)
    without = serve(Engine(cfg, params, config=EngineConfig(max_num_seqs=8, block_size=8, prefix_caching=False)),
                    prompts, limits)
    assert [r["tokens"] for r in with_cache] == [r["tokens"] for r in without]
    assert_equal_reference(with_cache, reference(cfg, params, prompts), limits)
    rate = cached.blocks.hit_rate()
    print(f"prefix-cache hit rate: {rate:.1%}")
    assert rate > 0.4 and sum(r["cached"] > 0 for r in with_cache) >= len(prompts) - config.max_num_seqs
    assert all(r["cached"] == 0 for r in without)
    assert_no_leak(cached)


def test_a_fully_cached_prompt_copies_its_last_block_before_writing(llama):
    cfg, params = llama
    prompt = list(np.random.default_rng(3).integers(0, 256, 32))  # four whole 8-token blocks
    engine = Engine(cfg, params, config=EngineConfig(max_num_seqs=4, block_size=8))
    first = serve(engine, [prompt], [10])[0]
    second = serve(engine, [prompt], [10])[0]  # every block cached: recompute the last token only
    assert engine.blocks.copies == 1 and second["cached"] == 31
    assert first["tokens"] == second["tokens"] == list(reference(cfg, params, [prompt])[0][:10])
    third = serve(engine, [prompt], [10])[0]  # the cached blocks were not overwritten
    assert third["tokens"] == first["tokens"]
    assert_no_leak(engine)


def test_abort_frees_the_blocks(llama):
    cfg, params = llama
    engine = Engine(cfg, params, config=EngineConfig(max_num_seqs=4, block_size=8))
    seen = []
    rid = engine.submit(list(range(40)), RequestParams(max_tokens=80, ignore_eos=True), seen.append)
    for _ in range(5):
        engine.step()
    assert engine.blocks.num_used > 0 and seen[-1].finish_reason is None
    engine.abort(rid)
    engine.step()
    assert seen[-1].finish_reason == "abort" and not engine.busy()
    assert_no_leak(engine)


def test_seeded_sampling_does_not_depend_on_the_batch(llama):
    cfg, params = llama
    prompts, _ = load(6, seed=4)
    engine = Engine(cfg, params, config=EngineConfig(max_num_seqs=8, block_size=8))
    knobs = dict(temperature=0.9, top_k=40, top_p=0.9, seed=7)
    alone = serve(engine, prompts[:1], [20], **knobs)[0]["tokens"]
    crowd = serve(engine, prompts, [20] * 6, **knobs)[0]["tokens"]
    assert alone == crowd
    other = serve(engine, prompts[:1], [20], **dict(knobs, seed=8))[0]["tokens"]
    assert other != alone
    greedy = serve(engine, prompts[:1], [20], temperature=0.7, top_k=1)[0]["tokens"]
    assert greedy == list(reference(cfg, params, prompts[:1])[0][:20])


def test_stop_strings_and_stop_tokens(llama):
    cfg, params = llama
    tok = ByteTokenizer()
    engine = Engine(cfg, params, tok, config=EngineConfig(max_num_seqs=4, block_size=8))
    prompt = [int(t) for t in tok.encode("def main(", add_eos=False)]
    full = serve(engine, [prompt], [24])[0]
    text = tok.decode(np.asarray(full["tokens"]))
    assert full["text"] == text and full["finish"] == "length"
    at = next(i for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) == i)
    stop = text[at:at + 2]
    cut = serve(engine, [prompt], [24], stop=(stop,))[0]
    assert cut["finish"] == "stop" and cut["text"] == text[:text.find(stop)]
    by_token = serve(engine, [prompt], [24], stop_token_ids=(full["tokens"][5],))[0]
    assert by_token["finish"] == "stop" and by_token["tokens"] == full["tokens"][:full["tokens"].index(full["tokens"][5]) + 1]
    assert_no_leak(engine)


def test_bad_requests_are_refused_with_the_field(llama):
    cfg, params = llama
    engine = Engine(cfg, params, config=EngineConfig(max_num_seqs=2, block_size=8, max_queue=2))
    cases = [([], {}, "prompt"), (list(range(128)), {}, "prompt"), ([1, 2], {"max_tokens": 0}, "max_tokens"),
             ([1] * 100, {"max_tokens": 29}, "max_tokens"), ([300], {}, "prompt"),
             ([1, 2], {"temperature": -1.0}, "temperature"), ([1, 2], {"top_p": 0.0}, "top_p")]
    for prompt, params_, field in cases:
        with pytest.raises(RequestError) as err:
            engine.submit(prompt, RequestParams(**params_), lambda o: None)
        assert err.value.param == field
    engine.submit([1, 2], RequestParams(), lambda o: None)
    engine.submit([1, 2], RequestParams(), lambda o: None)
    with pytest.raises(QueueFull):
        engine.submit([1, 2], RequestParams(), lambda o: None)
    with pytest.raises(ValueError, match="--num-blocks"):
        Engine(cfg, params, config=EngineConfig(block_size=8, num_blocks=10))


@pytest.mark.slow
def test_tensor_parallel_engine_equals_generate(llama):
    cfg, params = llama
    mesh = inference_mesh(2)
    placed = jax.device_put(params, param_shardings(cfg, mesh))
    prompts, limits = load(16, seed=5)
    engine = Engine(cfg, placed, config=EngineConfig(max_num_seqs=8, block_size=8), mesh=mesh)
    assert_equal_reference(serve(engine, prompts, limits), reference(cfg, params, prompts), limits)


@pytest.mark.slow
def test_sliding_window_engine_equals_generate():
    # A window shorter than most prompts and not a block multiple: the paged attention masks by
    # position within the blocks it reads, as the dense cache of generate masks its slots.
    cfg = ModelConfig(**{**LLAMA, "sliding_window": 13})
    params = model.init_params(cfg, jax.random.PRNGKey(4))
    prompts, limits = load(16, seed=6)
    engine = Engine(cfg, params, config=EngineConfig(max_num_seqs=8, block_size=8, max_prefill_tokens=32))
    assert_equal_reference(serve(engine, prompts, limits), reference(cfg, params, prompts), limits)
    assert_no_leak(engine)
