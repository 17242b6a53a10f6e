"""Generation over the preallocated KV cache: one jitted prefill, then a jitted decode loop.

``run(cfg, params, prompts, max_new_tokens, ...)`` continues a batch of token-id prompts of
different lengths and returns a ``Generation`` (tokens, texts and finish reason per prompt, prefill
and decode timings). How it runs:

- Shapes come in buckets, so a new prompt length rarely compiles: the batch is padded to a power of
  two (and to a multiple of the mesh's batch degree) with rows that are finished from the start;
  the prompt width and the cache length are padded to powers of two (at least ``MIN_BUCKET``, at
  most ``max_seq_len``). Prompts are right-padded; the padding columns have segment id 0, so the
  cache never stores them (a padding row has length 1: its slot 0 holds one filler token, which
  nothing reads). Each (bucket, sampling mode, mesh) compiles one prefill and one decode executable
  (ahead of time, so compile time is reported apart; ``COMPILES`` counts them).
- The decode executable is a ``while_loop`` over single-token steps that stops at a step bound
  passed in at run time or when every row is finished. Without streaming or stop strings one call
  runs the whole decode: no host sync per token. Streaming and stop strings call the same
  executable for chunks of steps (a run-time bound, so never a recompile). The decode state (cache
  included) is donated, so the cache is updated in place.
- A row finishes on a stop token (checked on device), on a stop string (checked on the decoded
  text between chunks; the completion text ends before it), or at its token limit: max_new_tokens,
  or the context (``max_seq_len``) when that comes first. A finished row writes nothing more to the
  cache and its later outputs are padding.
- Any mesh works: the cache is laid out by its logical names (kv heads over ``tensor``, as the
  weights ``maxlm.hf.load`` places), so tensor-parallel decode needs nothing special here.

``generate`` (fixed-width token arrays) is the short form the evaluation helpers call; training's
closing sample calls ``run``; ``python -m maxlm.generate`` is the CLI.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import time
from typing import Any, Callable, Sequence, TextIO

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from maxlm.config import ModelConfig
from maxlm.infer.sampling import Mode, SamplingParams, mask_vocab, pick
from maxlm.infer.text import safe_end as text_safe_end
from maxlm.infer.text import stop_at
from maxlm.model import KVCache, forward
from maxlm.model.cache import LOGICAL_KV, LOGICAL_SLOTS
from maxlm.parallel import sharding

MIN_BUCKET = 16  # smallest padded prompt width and cache length
STOP_SLOTS = 8  # stop-token ids are padded (with -1) to a multiple of this, a static shape
FILLER = 0  # token fed by finished and padding rows (segment 0: it is stored nowhere)
RUNNING, LENGTH, STOP_TOKEN, STOP_STRING = 0, 1, 2, 3
FINISH_NAMES = {LENGTH: "length", STOP_TOKEN: "stop_token", STOP_STRING: "stop_string"}
STOP_STRING_CHUNK = 16  # decode steps between stop-string checks when not streaming

COMPILES: collections.Counter = collections.Counter()  # executables built: "prefill", "decode"
_EXECUTABLES: dict[tuple, Any] = {}
_MAX_EXECUTABLES = 64


class PromptError(ValueError):
    """A prompt that cannot be generated from (empty, or no room left in the context)."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


@flax.struct.dataclass
class DecodeState:
    """Everything the decode loop carries; rows are the padded batch, columns of ``out`` are steps."""

    cache: KVCache
    out: jax.Array  # [B, S] int32: token generated at each step (FILLER once a row is finished)
    step: jax.Array  # [] int32: steps taken (every row's next column)
    lengths: jax.Array  # [B] int32: prompt lengths
    limit: jax.Array  # [B] int32: most tokens a row may generate
    count: jax.Array  # [B] int32: tokens each row generated
    finish: jax.Array  # [B] int32: RUNNING, LENGTH, STOP_TOKEN or STOP_STRING
    logits: jax.Array  # [B, V] float32: the model's logits that chose each row's latest token
    seen: jax.Array | None  # [B, V] bool: tokens in prompt + output (repetition penalty only)
    rng: jax.Array


def bucket(n: int, cap: int) -> int:
    """The padded size of ``n``: the next power of two, at least MIN_BUCKET, at most ``cap``."""
    return min(cap, max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length()))


def _constrain_cache(cache: KVCache) -> KVCache:
    return cache.replace(k=sharding.constrain(cache.k, LOGICAL_KV), v=sharding.constrain(cache.v, LOGICAL_KV),
                         segments=sharding.constrain(cache.segments, LOGICAL_SLOTS))


def _advance(state: DecodeState, token: jax.Array, logits: jax.Array, stop_ids: jax.Array) -> DecodeState:
    """Record the token each running row picked at column ``state.step`` and who finished."""
    running = state.finish == RUNNING
    token = jnp.where(running, token, FILLER)
    out = jax.lax.dynamic_update_index_in_dim(state.out, token[:, None], state.step, axis=1)
    count = state.count + running
    stopped = running & jnp.any(token[:, None] == stop_ids[None, :], axis=1)
    full = running & ~stopped & (count >= state.limit)
    finish = jnp.where(stopped, STOP_TOKEN, jnp.where(full, LENGTH, state.finish))
    seen = state.seen
    if seen is not None:
        rows = jnp.arange(token.shape[0])
        seen = seen.at[rows, token].set(seen[rows, token] | running)
    return state.replace(out=out, step=state.step + 1, count=count, finish=finish, logits=logits, seen=seen)


def _prefill(cfg: ModelConfig, mode: Mode, cache_len: int, params: Any, tokens: jax.Array, lengths: jax.Array,
             limit: jax.Array, stop_ids: jax.Array, knobs: jax.Array, rng: jax.Array) -> DecodeState:
    batch, width = tokens.shape
    cache = _constrain_cache(KVCache.create(cfg, batch, cache_len))
    valid = jnp.arange(width)[None] < lengths[:, None]
    positions = jnp.where(valid, jnp.arange(width, dtype=jnp.int32)[None], 0)
    logits, cache = forward(cfg, params, tokens, valid.astype(jnp.int32), positions, cache)
    last = jnp.take_along_axis(logits, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    last = mask_vocab(last, cfg.vocab_size)
    seen = None
    if mode.penalised:  # the prompt's tokens count as seen (Hugging Face penalises input_ids)
        rows = jnp.broadcast_to(jnp.arange(batch)[:, None], tokens.shape)
        seen = jnp.zeros(last.shape, bool).at[rows, tokens].max(valid)
    rng, key = jax.random.split(rng)
    state = DecodeState(cache=_constrain_cache(cache), out=jnp.zeros((batch, cache_len), jnp.int32),
                        step=jnp.int32(0), lengths=lengths, limit=limit, count=jnp.zeros_like(lengths),
                        finish=jnp.where(limit > 0, RUNNING, LENGTH).astype(jnp.int32), logits=last,
                        seen=seen, rng=rng)
    return _advance(state, pick(last, key, mode, knobs, seen), last, stop_ids)


def _decode(cfg: ModelConfig, mode: Mode, params: Any, state: DecodeState, stop_ids: jax.Array,
            knobs: jax.Array, until: jax.Array) -> DecodeState:
    """Decode steps until ``state.step == until`` or every row is finished."""

    def running(state):
        return (state.step < until) & jnp.any(state.finish == RUNNING)

    def step(state):
        live = state.finish == RUNNING
        token = jax.lax.dynamic_index_in_dim(state.out, state.step - 1, axis=1)  # [B, 1]
        position = jnp.where(live, state.lengths + state.step - 1, 0)[:, None]
        logits, cache = forward(cfg, params, token, live.astype(jnp.int32)[:, None], position, state.cache)
        logits = mask_vocab(logits[:, 0], cfg.vocab_size)
        rng, key = jax.random.split(state.rng)
        state = state.replace(cache=_constrain_cache(cache), rng=rng)
        return _advance(state, pick(logits, key, mode, knobs, state.seen), logits, stop_ids)

    return jax.lax.while_loop(running, step, state)


def _executable(kind: str, key: tuple, build: Callable[[], Any]) -> Any:
    """A compiled executable by (kind, key), built once (AOT, so its compile time is apart)."""
    exe = _EXECUTABLES.get((kind, key))
    if exe is None:
        if len(_EXECUTABLES) >= _MAX_EXECUTABLES:
            _EXECUTABLES.clear()
        exe = _EXECUTABLES[(kind, key)] = build()
        COMPILES[kind] += 1
    return exe


def mesh_of(params: Any) -> jax.sharding.Mesh:
    """The mesh the parameters live on; a one-device mesh for unsharded parameters."""
    leaf = jax.tree.leaves(params)[0]
    where = getattr(leaf, "sharding", None)
    if isinstance(where, NamedSharding):
        return where.mesh
    device = min(where.device_set, key=lambda d: d.id) if where is not None else jax.devices()[0]
    return sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1, "pipeline": 1}, [device])


def _place_params(cfg: ModelConfig, params: Any, mesh: jax.sharding.Mesh) -> Any:
    leaf = jax.tree.leaves(params)[0]
    if isinstance(getattr(leaf, "sharding", None), NamedSharding):
        return params
    from maxlm.infer.placement import param_shardings

    return jax.device_put(params, param_shardings(cfg, mesh))


@dataclasses.dataclass
class Progress:
    """What a streaming callback sees after each chunk of steps (real rows only)."""

    tokens: list[np.ndarray]  # the new tokens of each prompt so far
    finish: list[str | None]  # None while a row is running
    texts: list[str] | None  # completions so far (cut before a stop string), with a tokenizer
    logits: jax.Array  # [B, V]: the logits that chose each row's latest token (padding rows dropped)


@dataclasses.dataclass
class Generation:
    tokens: list[np.ndarray]  # per prompt: the new tokens (a stop token or stop string's tokens included)
    finish: list[str]  # per prompt: "length", "stop_token" or "stop_string"
    texts: list[str] | None  # per prompt: the completion text (cut before a stop string), with a tokenizer
    prefill_tokens: int
    prefill_s: float
    decode_tokens: int  # tokens produced by decode steps (the first of each row comes from prefill)
    decode_s: float
    compile_s: float  # building executables this call (0 when every bucket was seen before)
    steps: int  # tokens each row could have generated: 1 from the prefill, then one per decode step
    batch: int  # padded batch, prompt width and cache length: the bucket that ran
    width: int
    cache_length: int

    def summary(self) -> str:
        def rate(n, s):
            return f"{n / s:,.0f} tokens/s" if s > 0 else "n/a"
        return (f"prefill {self.prefill_tokens} tokens in {self.prefill_s:.3f} s ({rate(self.prefill_tokens, self.prefill_s)})"
                f"; decode {self.decode_tokens} tokens in {self.decode_s:.3f} s ({rate(self.decode_tokens, self.decode_s)})"
                f"; {len(self.tokens)} prompts (bucket: batch {self.batch}, width {self.width}, "
                f"cache {self.cache_length}); compile {self.compile_s:.1f} s")


def _check(cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: SamplingParams,
           stop_strings: Sequence[str], tokenizer: Any, chunk: int) -> list[np.ndarray]:
    """The prompts as 1-D int32 arrays; a ValueError (PromptError for one prompt) for bad input."""
    problem = sampling.problem()
    if problem:
        raise ValueError(problem)
    if max_new_tokens < 1 or chunk < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens} and chunk = {chunk} must be >= 1")
    if stop_strings and tokenizer is None:
        raise ValueError("stop strings are matched on decoded text: pass a tokenizer")
    if any(not s for s in stop_strings):
        raise ValueError("a stop string must not be empty")
    prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    if not prompts:
        raise PromptError(0, "no prompts to generate from")
    for i, p in enumerate(prompts):
        if p.size == 0:
            raise PromptError(i, "prompt is empty (no tokens)")
        if p.size >= cfg.max_seq_len:
            raise PromptError(i, f"prompt has {p.size} tokens; the context (ModelConfig.max_seq_len = "
                                 f"{cfg.max_seq_len}) leaves room for at most {cfg.max_seq_len - 1}")
        if p.min() < 0 or p.max() >= cfg.vocab_size:
            raise PromptError(i, f"prompt holds token ids outside [0, {cfg.vocab_size})")
    return prompts


@dataclasses.dataclass
class _Layout:
    """The padded batch: the bucket's shapes and the host arrays the executables take."""

    batch: int
    width: int
    cache_len: int
    tokens: np.ndarray  # [batch, width] right-padded prompts
    lengths: np.ndarray  # [batch]; padding rows have length 1
    limit: np.ndarray  # [batch] new tokens each row may take (0 for padding rows)
    stop_ids: np.ndarray  # stop token ids, padded with -1 to a multiple of STOP_SLOTS


def _layout(cfg: ModelConfig, prompts: list[np.ndarray], max_new_tokens: int, stop_tokens: Sequence[int],
            mesh: jax.sharding.Mesh) -> _Layout:
    rows = len(prompts)
    degree = mesh.shape["data"] * mesh.shape["fsdp"]
    batch = -(-(1 << (rows - 1).bit_length()) // degree) * degree
    lengths = np.ones(batch, np.int32)
    lengths[:rows] = [p.size for p in prompts]
    width = bucket(int(lengths.max()), cfg.max_seq_len)
    cache_len = bucket(int(lengths.max()) + max_new_tokens, cfg.max_seq_len)
    limit = np.zeros(batch, np.int32)  # padding rows: finished before they start
    limit[:rows] = np.minimum(max_new_tokens, cache_len - lengths[:rows])
    tokens = np.full((batch, width), FILLER, np.int32)
    for r, p in enumerate(prompts):
        tokens[r, :p.size] = p
    stops = sorted({int(t) for t in stop_tokens})
    stop_ids = np.full(-(-max(len(stops), 1) // STOP_SLOTS) * STOP_SLOTS, -1, np.int32)
    stop_ids[:len(stops)] = stops
    return _Layout(batch, width, cache_len, tokens, lengths, limit, stop_ids)


class _HostStops:
    """The host's side of a chunked decode: after each chunk of steps, decode every running row's
    text, look for stop strings, and report progress. Rows it stops are ``finish``ed here."""

    def __init__(self, rows: int, tokenizer: Any, stop_strings: Sequence[str]):
        self.rows, self.tokenizer, self.stop_strings = rows, tokenizer, stop_strings
        self.finish = np.zeros(rows, np.int32)  # STOP_STRING where a stop string was found
        self.kept = np.zeros(rows, np.int64)  # tokens kept by a stop string
        self.texts: list[str] | None = [""] * rows if tokenizer is not None else None
        self.checked = np.zeros(rows, np.int64)

    def scan(self, out: np.ndarray, count: np.ndarray) -> None:
        for r in range(self.rows):
            if self.finish[r] or (self.checked[r] == count[r] and self.texts is not None and self.texts[r]):
                continue
            seq = out[r, :count[r]]
            hit = stop_at(self.tokenizer, seq, self.stop_strings, int(self.checked[r])) if self.stop_strings else None
            self.checked[r] = count[r]
            if hit:
                self.finish[r], self.kept[r] = STOP_STRING, hit[0]
                self.texts[r] = hit[1]
            elif self.texts is not None:
                self.texts[r] = self.tokenizer.decode(seq)

    def progress(self, out: np.ndarray, count: np.ndarray, finish: np.ndarray, logits: jax.Array) -> Progress:
        rows = range(self.rows)
        return Progress([out[r, :self.kept[r] if self.finish[r] else count[r]] for r in rows],
                        [FINISH_NAMES.get(int(self.finish[r] or finish[r])) for r in rows],
                        list(self.texts) if self.texts is not None else None, logits[:self.rows])

    def results(self, out: np.ndarray, count: np.ndarray, finish: np.ndarray) -> tuple[list, list, list | None]:
        """(new tokens, finish reasons, texts) of every real row."""
        tokens, reasons, texts = [], [], self.texts
        for r in range(self.rows):
            if self.finish[r]:
                tokens.append(out[r, :self.kept[r]].copy())
                reasons.append(FINISH_NAMES[STOP_STRING])
            else:
                tokens.append(out[r, :count[r]].copy())
                reasons.append(FINISH_NAMES[int(finish[r])])
                if texts is not None:
                    texts[r] = self.tokenizer.decode(tokens[-1])
        return tokens, reasons, texts


def run(cfg: ModelConfig, params: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
        sampling: SamplingParams | None = None, stop_tokens: Sequence[int] = (),
        stop_strings: Sequence[str] = (), tokenizer: Any = None, seed: int = 0,
        mesh: jax.sharding.Mesh | None = None, on_progress: Callable[[Progress], None] | None = None,
        chunk: int = 1) -> Generation:
    """Continue each prompt (token ids; lengths may differ, each below ``max_seq_len``) by at most
    ``max_new_tokens`` tokens. ``on_progress`` is called after the prefill and after every
    ``chunk`` decode steps (streaming). Stop strings and texts need a ``tokenizer``. Runs on
    ``mesh`` (default: the parameters' own). ``sampling`` defaults to greedy."""
    sampling = sampling or SamplingParams()
    prompts = _check(cfg, prompts, max_new_tokens, sampling, stop_strings, tokenizer, chunk)
    mesh = mesh or mesh_of(params)
    rows = len(prompts)
    lay = _layout(cfg, prompts, max_new_tokens, stop_tokens, mesh)
    host = _HostStops(rows, tokenizer, stop_strings)

    compile_s = 0.0
    with jax.set_mesh(mesh):
        params = _place_params(cfg, params, mesh)
        replicated = NamedSharding(mesh, PartitionSpec())
        tokens, lengths_d, limit_d, stop_ids_d, knobs, rng = jax.device_put(
            (lay.tokens, lay.lengths, lay.limit, lay.stop_ids, sampling.knobs(), jax.random.PRNGKey(seed)), replicated)
        # Shape, dtype and placement of every parameter: the same cfg with (say) bf16-cast
        # parameters is a different executable.
        param_key = tuple((x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(params))
        mode = sampling.mode()
        key = (cfg, mode, lay.batch, lay.width, lay.cache_len, lay.stop_ids.size, mesh, param_key)

        def build_prefill():
            fn = jax.jit(lambda *a: _prefill(cfg, mode, lay.cache_len, *a))
            return fn.lower(params, tokens, lengths_d, limit_d, stop_ids_d, knobs, rng).compile()

        start = time.perf_counter()
        prefill = _executable("prefill", key, build_prefill)
        compile_s += time.perf_counter() - start

        start = time.perf_counter()
        state = jax.block_until_ready(prefill(params, tokens, lengths_d, limit_d, stop_ids_d, knobs, rng))
        prefill_s = time.perf_counter() - start

        def build_decode():
            fn = jax.jit(lambda p, s, i, k, u: _decode(cfg, mode, p, s, i, k, u), donate_argnums=1,
                         out_shardings=prefill.output_shardings)
            return fn.lower(params, state, stop_ids_d, knobs, jax.device_put(np.int32(0), replicated)).compile()

        start = time.perf_counter()  # max_new_tokens 1: the prefill picked every token there is
        decode = _executable("decode", key, build_decode) if lay.limit.max() > 1 else None
        compile_s += time.perf_counter() - start

        def until(step: int) -> jax.Array:
            return jax.device_put(np.int32(step), replicated)

        start = time.perf_counter()
        if on_progress is not None or stop_strings:  # one host sync per chunk of steps
            step = chunk if on_progress is not None else STOP_STRING_CHUNK
            steps_taken = 1  # the prefill picked the first token
            while True:
                out, count, finish = (np.array(x) for x in jax.device_get((state.out, state.count, state.finish)))
                host.scan(out, count)
                newly = (host.finish > 0) & (finish[:rows] == RUNNING)
                if newly.any():  # tell the device, so those rows stop writing
                    finish[:rows][newly] = STOP_STRING
                    state = state.replace(finish=jax.device_put(finish, state.finish.sharding))
                if on_progress is not None:
                    on_progress(host.progress(out, count, finish, state.logits))
                if not (finish == RUNNING).any():
                    break
                steps_taken += step  # the loop ends early only when every row is finished
                state = decode(params, state, stop_ids_d, knobs, until(steps_taken))
        elif decode is not None:  # the whole decode in one call: no host sync per token
            state = jax.block_until_ready(decode(params, state, stop_ids_d, knobs, until(lay.cache_len)))
        steps_taken = int(state.step)
        decode_s = time.perf_counter() - start
        out, count, finish = (np.asarray(x) for x in jax.device_get((state.out, state.count, state.finish)))

    new_tokens, reasons, texts = host.results(out, count, finish)
    return Generation(new_tokens, reasons, texts, prefill_tokens=int(lay.lengths[:rows].sum()), prefill_s=prefill_s,
                      decode_tokens=int(sum(max(len(t) - 1, 0) for t in new_tokens)), decode_s=decode_s,
                      compile_s=compile_s, steps=steps_taken, batch=lay.batch, width=lay.width,
                      cache_length=lay.cache_len)


def generate(cfg: ModelConfig, params: Any, prompts: Sequence[np.ndarray], new_tokens: int, *,
             temperature: float = 0.8, top_k: int = 40, top_p: float = 1.0, repetition_penalty: float = 1.0,
             seed: int = 0, mesh: jax.sharding.Mesh | None = None) -> np.ndarray:
    """Continue each prompt (1-D token ids, lengths may differ) by exactly ``new_tokens`` tokens
    (no stop tokens). Returns [B, new_tokens]. Each prompt keeps its last ``max_seq_len -
    new_tokens`` tokens, so every row has room."""
    if not 0 < new_tokens < cfg.max_seq_len:
        raise ValueError(f"new_tokens = {new_tokens} must lie in [1, max_seq_len = {cfg.max_seq_len})")
    keep = cfg.max_seq_len - new_tokens
    prompts = [np.asarray(p, np.int32).reshape(-1)[-keep:] for p in prompts]
    if not prompts or min(len(p) for p in prompts) == 0:
        raise ValueError("every prompt needs at least one token")
    result = run(cfg, params, prompts, new_tokens, seed=seed, mesh=mesh,
                 sampling=SamplingParams(temperature, top_k, top_p, repetition_penalty))
    return np.stack(result.tokens)


class TerminalStream:
    """An ``on_progress`` that prints as tokens come: one prompt's text token by token; with
    several prompts, each completion whole as soon as its row finishes (in finishing order).
    Text that could be the start of a stop string, or a partial UTF-8 character, is held back."""

    def __init__(self, labels: Sequence[str], stop_strings: Sequence[str] = (), file: TextIO | None = None):
        self.labels, self.stops, self.file = list(labels), list(stop_strings), file
        self.printed = [0] * len(labels)
        self.done = [False] * len(labels)

    def __call__(self, progress: Progress) -> None:
        out = self.file or sys.stdout  # looked up now: tests and notebooks replace sys.stdout
        texts = progress.texts or [""] * len(self.labels)
        for r, text in enumerate(texts):
            if self.done[r]:
                continue
            finished = progress.finish[r] is not None
            if len(self.labels) == 1:
                end = len(text) if finished else text_safe_end(text, self.stops)
                if end > self.printed[0]:
                    out.write(text[self.printed[0]:end])
                    self.printed[0] = end
                if finished:
                    out.write("\n")
            elif finished:
                out.write(f"{self.labels[r]}{text}\n")
            self.done[r] = finished
            out.flush()
