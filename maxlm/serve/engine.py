"""The serving engine: continuous batching over a paged KV cache.

``Engine(cfg, params, tokenizer, EngineConfig(...))`` takes requests from any thread
(``submit``, ``abort``) and runs them on its own thread (``start``). Each step:

1. **Admit**: waiting requests join while fewer than ``max_num_seqs`` are in flight and the pool
   has their blocks (their prompt's whole blocks may come from the prefix cache). When the engine
   is idle, the first arrival waits up to ``batch_wait_ms`` for company (dynamic batching).
2. **Prefill**: at most ``max_prefill_tokens`` prompt tokens across the admitted requests, in rows
   of ``prefill_chunk``, so a long prompt is computed in chunks over several steps and never stalls
   the decodes.
   A request whose prompt is complete picks its first token and starts decoding.
3. **Decode**: one token for every decoding request, in one jitted call whose batch is padded to a
   bucket. A request that needs a new block and finds the
   pool empty preempts the newest request (its blocks are freed; it waits at the head of the queue
   and is recomputed later, its full blocks likely still in the prefix cache).
4. Requests that finish (stop token, stop string, max tokens, the context) leave at once and their
   callback gets the last ``Output``; their places go to waiting requests in the next step.

Shapes: a decode's batch is padded to a power of two, and above 8 to a multiple of 8; a prefill
is rows of ``prefill_chunk`` tokens (a prompt may span several rows of one call), their number a
power of two. Block tables are always as wide as the context: attention reads only the blocks the
rows hold (``maxlm.serve.paged_cache``), so the table width costs no work and no compile. ``warmup``
compiles every shape before serving. Greedy requests
give exactly ``maxlm.infer.generate``'s tokens: batching, paging and preemption change no result.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from maxlm.config import ModelConfig
from maxlm.infer.generate import mesh_of
from maxlm.infer.sampling import SamplingParams, mask_vocab, pick_rows
from maxlm.infer.text import safe_end
from maxlm.model import forward
from maxlm.serve.blocks import BlockManager, OutOfBlocks
from maxlm.serve.metrics import Metrics
from maxlm.serve.paged_cache import PagedKVCache, copy_blocks

log = logging.getLogger("maxlm.serve")

# Decode batch buckets: powers of two up to this, then multiples of it. A padding row costs a
# decode step's weights-bound work as much as a real one, so the buckets are finer where they are
# large; each is one more compile at start-up.
BATCH_STEP = 8
THROUGHPUT_WINDOW_S = 10.0  # the tokens/s gauge counts the tokens of this many recent seconds


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32  # requests in flight (prefilling or decoding) at most
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 0  # KV blocks in the pool; 0: room for max_num_seqs full contexts
    max_prefill_tokens: int = 512  # prompt tokens computed per step, all requests together
    prefill_chunk: int = 32  # tokens per row of a prefill call (a prompt spans several rows)
    batch_wait_ms: float = 0.0  # an idle engine waits this long after an arrival for more
    max_queue: int = 256  # waiting requests at most; more are refused (HTTP 429)
    prefix_caching: bool = True

    def problem(self, cfg: ModelConfig) -> str | None:
        """The first impossible setting as one line (naming the flag), else None."""
        if self.max_num_seqs < 1:
            return f"--max-num-seqs = {self.max_num_seqs} must be >= 1"
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            return f"--block-size = {self.block_size} must be a power of two"
        if self.prefill_chunk < 1:
            return f"--prefill-chunk = {self.prefill_chunk} must be >= 1"
        if self.max_prefill_tokens < self.prefill_chunk:
            return f"--max-prefill-tokens = {self.max_prefill_tokens} must be >= --prefill-chunk = {self.prefill_chunk}"
        if self.batch_wait_ms < 0:
            return f"--batch-wait-ms = {self.batch_wait_ms} must be >= 0"
        if self.max_queue < 1:
            return f"--max-queue = {self.max_queue} must be >= 1"
        need = -(-cfg.max_seq_len // self.block_size) + 1
        if self.num_blocks and self.num_blocks < need:
            return (f"--num-blocks = {self.num_blocks} cannot hold one full context: max_seq_len "
                    f"{cfg.max_seq_len} / block size {self.block_size} needs {need} (one is reserved)")
        return None


@dataclasses.dataclass(frozen=True)
class RequestParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclasses.dataclass
class Output:
    """What a request's callback gets after each step that moved it (on the engine thread)."""

    request_id: str
    token_ids: list[int]  # new tokens
    text: str  # new text (a partial character or a possible stop string's start is held back)
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens read from the prefix cache


class RequestError(ValueError):
    """A request the engine cannot take (str: one line naming the field)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFull(Exception):
    """The waiting queue is at ``max_queue``: try later."""


class Draining(Exception):
    """The engine is shutting down and takes no new requests."""


@dataclasses.dataclass(eq=False)
class _Seq:
    id: str
    tokens: list[int]  # prompt + output
    prompt_len: int
    limit: int  # output tokens at most
    params: RequestParams
    stop_ids: frozenset
    seed: int
    callback: Callable[[Output], None]
    arrival: float
    blocks: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # leading tokens whose K/V are in the pool
    cached: int = 0
    sent_text: int = 0  # characters of the completion already handed out
    sent_tokens: int = 0
    first_token: float | None = None

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]


def _bucket(n: int, cap: int, step: int = 0) -> int:
    """The padded size of ``n``: a power of two, or with ``step``, above ``step`` a multiple of it
    (finer buckets where padding costs the most), at most ``cap``."""
    if step and n > step:
        return min(cap, -(-n // step) * step)
    return min(cap, 1 << max(n - 1, 0).bit_length())


# A step's inputs travel as two arrays: two host-to-device transfers instead of eleven (on a
# 2-device CPU mesh ~0.13 ms of Python per step instead of ~0.4, more under load). ``_fields``
# names their columns, on the host (views to fill) and in the step (slices to read) alike.
_PER_ROW = ("lengths", "last", "top_k", "seeds", "counts")


def _fields(ints: Any, floats: Any, table_w: int) -> dict[str, Any]:
    """ints [B, 3 * T + table_w + 5] int32 and floats [B, 2] float32 -> the named fields: tokens,
    positions, valid ([B, T] each), tables [B, table_w], the per-row ``_PER_ROW`` ints,
    temperature and top_p."""
    width = (ints.shape[1] - table_w - len(_PER_ROW)) // 3
    fields = {name: ints[:, i * width:(i + 1) * width] for i, name in enumerate(("tokens", "positions", "valid"))}
    fields["tables"] = ints[:, 3 * width:3 * width + table_w]
    fields.update({name: ints[:, 3 * width + table_w + i] for i, name in enumerate(_PER_ROW)})
    return {**fields, "temperature": floats[:, 0], "top_p": floats[:, 1]}


def _step(cfg: ModelConfig, block_size: int, params: Any, pool_k: jax.Array, pool_v: jax.Array, ints: jax.Array,
          floats: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One forward over [B, T] tokens through the paged cache; the next token of each row, picked
    from the logits at its column ``last``."""
    f = _fields(ints, floats, -(-cfg.max_seq_len // block_size))
    cache = PagedKVCache(pool_k, pool_v, f["tables"], f["lengths"], block_size)
    logits, cache = forward(cfg, params, f["tokens"], f["valid"], f["positions"], cache)
    logits = mask_vocab(logits[jnp.arange(ints.shape[0]), f["last"]], cfg.vocab_size)
    return cache.k, cache.v, pick_rows(logits, f["temperature"], f["top_k"], f["top_p"], f["seeds"], f["counts"])


@functools.cache
def _jitted(cfg: ModelConfig, block_size: int, pool: NamedSharding, replicated: NamedSharding):
    """The step and block-copy functions, shared by engines of one model and layout (so a second
    engine, e.g. a test's, reuses the compiled executables)."""
    forward_fn = jax.jit(lambda *a: _step(cfg, block_size, *a), donate_argnums=(1, 2),
                         out_shardings=(pool, pool, replicated))
    copy_fn = jax.jit(copy_blocks, donate_argnums=0,
                      out_shardings=pool)
    return forward_fn, copy_fn


class Engine:
    def __init__(self, cfg: ModelConfig, params: Any, tokenizer: Any = None, config: EngineConfig = EngineConfig(),
                 mesh: jax.sharding.Mesh | None = None, metrics: Metrics | None = None):
        problem = config.problem(cfg)
        if problem:
            raise ValueError(problem)
        self.cfg, self.params, self.tokenizer, self.config = cfg, params, tokenizer, config
        self.mesh = mesh or mesh_of(params)
        bs = config.block_size
        self.max_blocks = -(-cfg.max_seq_len // bs)
        num_blocks = config.num_blocks or config.max_num_seqs * self.max_blocks + 1
        self.blocks = BlockManager(num_blocks, bs, config.prefix_caching)
        tensor = self.mesh.shape["tensor"]
        heads = "tensor" if cfg.kv_heads % tensor == 0 else None
        self._pool_sharding = NamedSharding(self.mesh, PagedKVCache.pool_spec(heads))
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        shape = PagedKVCache.pool_shape(cfg, num_blocks, bs)
        from maxlm.model.linear import DTYPES

        dtype = DTYPES[cfg.dtype]
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self._pool_sharding)
        self.pool_k, self.pool_v = zeros(), zeros()
        self._forward, self._copy = _jitted(cfg, bs, self._pool_sharding, self._replicated)
        self.eos_id = getattr(tokenizer, "eos_id", None)
        self.metrics = metrics or Metrics()

        self.waiting: collections.deque[_Seq] = collections.deque()
        self.prefilling: list[_Seq] = []
        self.running: list[_Seq] = []
        self._inbox: list[_Seq] = []
        self._aborts: set[str] = set()
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._rng = np.random.default_rng()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.draining = False
        self.preemptions = 0
        self.kv_filled = 0  # summed over steps: pool slots holding a real token ...
        self.kv_allocated = 0  # ... and slots of allocated blocks
        self._recent: collections.deque[float] = collections.deque()  # when recent tokens came

    # ---- any thread

    def submit(self, prompt: Sequence[int], params: RequestParams, callback: Callable[[Output], None],
               request_id: str | None = None) -> str:
        """Queue a request (token ids); ``callback`` gets its ``Output``s on the engine thread.
        Raises RequestError (a bad request), QueueFull or Draining."""
        cfg = self.cfg
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise RequestError("the prompt is empty", "prompt")
        if len(prompt) >= cfg.max_seq_len:
            raise RequestError(f"the prompt has {len(prompt)} tokens; this model's context is {cfg.max_seq_len} "
                               f"tokens, which leaves room for at most {cfg.max_seq_len - 1}", "prompt")
        if min(prompt) < 0 or max(prompt) >= cfg.vocab_size:
            raise RequestError(f"the prompt holds token ids outside [0, {cfg.vocab_size})", "prompt")
        problem = SamplingParams(params.temperature, params.top_k, params.top_p).problem()
        if problem:
            raise RequestError(problem, problem.split(" ", 1)[0])
        if params.max_tokens < 1:
            raise RequestError(f"max_tokens = {params.max_tokens} must be >= 1", "max_tokens")
        if params.max_tokens > cfg.max_seq_len - len(prompt):
            raise RequestError(f"max_tokens = {params.max_tokens} is more than the context leaves: the prompt has "
                               f"{len(prompt)} tokens of {cfg.max_seq_len}, so at most "
                               f"{cfg.max_seq_len - len(prompt)}", "max_tokens")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, and this model has none", "stop")
        stop_ids = set(params.stop_token_ids)
        if self.eos_id is not None and not params.ignore_eos:
            stop_ids.add(self.eos_id)
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31 - 1))
        with self._cv:
            if self.draining:
                raise Draining("the server is shutting down")
            if len(self.waiting) + len(self._inbox) >= self.config.max_queue:
                raise QueueFull(f"{self.config.max_queue} requests are waiting already; retry later")
            seq = _Seq(request_id or f"req-{next(self._ids)}", prompt, len(prompt), params.max_tokens, params,
                       frozenset(stop_ids), seed % (2**31 - 1), callback, time.monotonic())
            self._inbox.append(seq)
            self._cv.notify()
        return seq.id

    def abort(self, request_id: str) -> None:
        """Stop a request (a client went away): its blocks are freed at the next step."""
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="maxlm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Take no new requests; with ``drain``, let the ones in flight finish; then stop."""
        with self._cv:
            self.draining = True
            if not drain:
                self._aborts.update(s.id for s in self._all())
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def busy(self) -> bool:
        with self._cv:
            return bool(self._inbox or self.waiting or self.prefilling or self.running)

    # ---- the engine thread

    def _all(self) -> list[_Seq]:
        return [*self._inbox, *self.waiting, *self.prefilling, *self.running]

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._inbox or self._aborts or self.waiting or self.prefilling or self.running):
                    if self._stop:
                        return
                    self._cv.wait()
                idle = not (self.prefilling or self.running)
            if idle and self.config.batch_wait_ms > 0:
                self._batch_wait()
            try:
                self.step()
            except Exception:  # an engine bug must not hang every client: fail what is in flight
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all()

    def _batch_wait(self) -> None:
        with self._cv:
            if not self._inbox:
                return
            deadline = self._inbox[0].arrival + self.config.batch_wait_ms / 1000
            while len(self._inbox) < self.config.max_num_seqs and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)

    def _fail_all(self) -> None:
        with self._cv:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
        for seq in [*self.waiting, *self.prefilling, *self.running]:
            self._finish(seq, "error")
        self.waiting.clear()
        self.prefilling.clear()
        self.running.clear()

    def step(self) -> None:
        """One engine step: take arrivals and aborts, admit, prefill a chunk, decode one token."""
        with self._cv:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
            aborts, self._aborts = self._aborts, set()
        if aborts:
            for group in (self.waiting, self.prefilling, self.running):
                for seq in [s for s in group if s.id in aborts]:
                    group.remove(seq)
                    self._finish(seq, "abort")
        if self.prefilling or self.waiting:
            self._prefill()
        if self.running:
            self._decode()
        self._account()

    def _cow(self, seq: _Seq, index: int) -> None:
        src = self.blocks.writable(seq.blocks, index)
        if src is not None:
            src_d, dst_d = jax.device_put((np.array([src], np.int32), np.array([seq.blocks[index]], np.int32)),
                                          self._replicated)
            with jax.set_mesh(self.mesh):
                self.pool_k = self._copy(self.pool_k, src_d, dst_d)
                self.pool_v = self._copy(self.pool_v, src_d, dst_d)

    def _run(self, kind: str, rows: list[tuple[_Seq, int, int, int]], padding: bool = False) -> np.ndarray:
        """One jitted forward over ``rows`` of (request, first position, tokens, the request's
        length once this call is done); returns each row's pick of the token after its last one.

        A request's prompt may span several rows of one prefill call: every row's new K/V is
        scattered into the pool before any row gathers its blocks (in each layer), so a later
        chunk attends to an earlier one of the same call, and the positional mask keeps each
        query causal. Shapes: a decode pads its rows to a batch bucket; a prefill has rows of
        ``prefill_chunk`` tokens, their number a power of two; tables span the whole context.
        ``padding``: every row is padding (the warm-up's compiles), so nothing is written."""
        if kind == "decode":
            batch, width = _bucket(len(rows), self.config.max_num_seqs, BATCH_STEP), 1
        else:
            batch, width = self.prefill_rows(len(rows)), self.config.prefill_chunk
        ints = np.zeros((batch, 3 * width + self.max_blocks + len(_PER_ROW)), np.int32)
        floats = np.zeros((batch, 2), np.float32)
        f = _fields(ints, floats, self.max_blocks)  # views: filling them fills the two arrays
        f["top_p"][:] = 1.0
        for i, (seq, start, n, end) in enumerate(rows):
            f["tokens"][i, :n] = seq.tokens[start:start + n]
            f["positions"][i, :n] = np.arange(start, start + n)
            f["valid"][i, :n] = 0 if padding else 1
            f["tables"][i, :len(seq.blocks)] = seq.blocks
            f["lengths"][i], f["last"][i] = end, n - 1
            p = seq.params
            f["temperature"][i], f["top_k"][i], f["top_p"][i] = p.temperature, p.top_k, p.top_p
            f["seeds"][i], f["counts"][i] = seq.seed, len(seq.tokens) - seq.prompt_len
        args = jax.device_put((ints, floats), self._replicated)
        with jax.set_mesh(self.mesh):
            self.pool_k, self.pool_v, picked = self._forward(self.params, self.pool_k, self.pool_v, *args)
        return np.asarray(picked)[:len(rows)]

    def _grow(self, seq: _Seq, tokens: int) -> bool:
        """Give ``seq`` the blocks its first ``tokens`` tokens need (copying a shared block it is
        about to write); False, holding what it had, when the pool runs out."""
        bs = self.config.block_size
        try:
            while len(seq.blocks) * bs < tokens:
                seq.blocks.append(self.blocks.allocate())
        except OutOfBlocks:
            return False
        self._cow(seq, seq.computed // bs)
        return True

    def _prefill(self) -> None:
        """Prompt tokens within the step's budget (``prefill_rows``), in rows of
        ``prefill_chunk``: requests already prefilling first (in arrival order), then waiting
        requests admitted while rows, ``max_num_seqs`` and the pool allow. Blocks are taken per
        chunk, so a queued prompt holds no empty blocks."""
        chunk, bs = self.config.prefill_chunk, self.config.block_size
        free_rows = self.config.max_prefill_tokens // chunk
        plan: list[tuple[_Seq, int]] = []  # (request, tokens computed this call)
        for seq in list(self.prefilling):
            if not free_rows:
                break
            n = min(len(seq.tokens) - seq.computed, free_rows * chunk)
            while not self._grow(seq, seq.computed + n):
                victims = self.running or [s for s in self.prefilling if s is not seq and s not in dict(plan)]
                if not victims:  # only chunks already planned hold the pool: wait a step
                    n = 0
                    break
                self._preempt(victims[-1])
            if n:
                plan.append((seq, n))
                free_rows -= -(-n // chunk)
        while (self.waiting and free_rows
               and len(self.prefilling) + len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            hit = self.blocks.match_prefix(seq.tokens)
            computed = min(len(hit) * bs, len(seq.tokens) - 1)
            n = min(len(seq.tokens) - computed, free_rows * chunk)
            need = max(-(-(computed + n) // bs) - len(hit), 0) + (computed < len(hit) * bs)  # + a copy
            # Keep a block per decoding request in hand, so admitting does not force a preemption.
            if need + len(self.running) > self.blocks.num_free:
                self.blocks.unmatch(seq.tokens, hit)
                break
            self.waiting.popleft()
            seq.blocks, seq.computed = hit, computed
            if seq.first_token is None:
                seq.cached = computed
            self._grow(seq, computed + n)
            self.prefilling.append(seq)
            plan.append((seq, n))
            free_rows -= -(-n // chunk)
        if not plan:
            return
        rows = [(seq, start, min(chunk, seq.computed + n - start), seq.computed + n)
                for seq, n in plan for start in range(seq.computed, seq.computed + n, chunk)]
        picked = self._run("prefill", rows)
        now = time.monotonic()
        last = {id(seq): token for (seq, *_), token in zip(rows, picked)}  # each request's last row
        for seq, n in plan:
            seq.computed += n
            self.blocks.register(seq.tokens, seq.blocks, seq.computed)
            if seq.computed == len(seq.tokens):  # (joins before it leaves: busy() never sees a gap)
                self.running.append(seq)
                self.prefilling.remove(seq)
                self._append(seq, int(last[id(seq)]), now)

    def _preempt(self, seq: _Seq) -> None:
        """Free a request's blocks and send it back to the head of the queue (recomputed later)."""
        self.waiting.appendleft(seq)
        (self.running if seq in self.running else self.prefilling).remove(seq)
        self.blocks.release(seq.blocks)
        seq.blocks, seq.computed = [], 0
        self.preemptions += 1
        self.metrics.preemptions.inc()

    def _decode(self) -> None:
        bs = self.config.block_size
        for seq in list(self.running):
            if seq not in self.running:  # preempted for an older one's block
                continue
            index = seq.computed // bs
            while index >= len(seq.blocks):
                try:
                    seq.blocks.append(self.blocks.allocate())
                except OutOfBlocks:
                    victim = self.running[-1]  # the newest request
                    self._preempt(victim)
                    if victim is seq:
                        break
            if seq in self.running:
                self._cow(seq, index)
        if not self.running:
            return
        rows = list(self.running)
        picked = self._run("decode", [(seq, seq.computed, 1, seq.computed + 1) for seq in rows])
        now = time.monotonic()
        for seq, token in zip(rows, picked):
            seq.computed += 1
            if seq.computed % bs == 0:
                self.blocks.register(seq.tokens, seq.blocks, seq.computed)
            self._append(seq, int(token), now)

    def _append(self, seq: _Seq, token: int, now: float) -> None:
        """A row picked ``token``: record it, find out whether it finished, tell the callback."""
        seq.tokens.append(token)
        self.metrics.generation_tokens.inc()
        self._recent.append(now)
        if seq.first_token is None:
            seq.first_token = now
            self.metrics.ttft.observe(now - seq.arrival)
        n = len(seq.tokens) - seq.prompt_len
        finish = None
        if token in seq.stop_ids:
            finish = "stop"
        elif n >= seq.limit:
            finish = "length"
        text, stopped = self._text(seq)  # decoded once per step, for the stop check and the stream
        if finish is None and stopped:
            finish = "stop"
        if finish is not None:
            self.running.remove(seq)
            self._finish(seq, finish, text)
        else:
            self._emit(seq, None, text)

    def _text(self, seq: _Seq) -> tuple[str, bool]:
        """(the completion so far, ended before a stop token or the first stop string; whether a
        stop string was found)."""
        out = seq.output
        if out and out[-1] in seq.stop_ids:
            out = out[:-1]
        if self.tokenizer is None:
            return "", False
        text = self.tokenizer.decode(np.asarray(out, np.int32))
        cut = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
        return (text[:min(cut)], True) if cut else (text, False)

    def _emit(self, seq: _Seq, finish: str | None, text: str | None = None) -> None:
        text = self._text(seq)[0] if text is None else text
        end = len(text) if finish is not None else safe_end(text, seq.params.stop)
        out = seq.output
        new_tokens = out[seq.sent_tokens:]
        delta = text[seq.sent_text:end] if end > seq.sent_text else ""
        seq.sent_tokens, seq.sent_text = len(out), max(seq.sent_text, end)
        try:
            seq.callback(Output(seq.id, new_tokens, delta, finish, seq.prompt_len, len(out), seq.cached))
        except Exception:  # a client's callback must not stop the engine
            log.exception("request %s: output callback failed", seq.id)

    def _finish(self, seq: _Seq, reason: str, text: str | None = None) -> None:
        self.blocks.release(seq.blocks)
        seq.blocks = []
        n = len(seq.output)
        if seq.first_token is not None and n > 1:
            self.metrics.tpot.observe((time.monotonic() - seq.first_token) / (n - 1))
        self.metrics.finished.labels(reason).inc()
        self.metrics.prompt_tokens.inc(seq.prompt_len)
        self._emit(seq, reason, text)

    def _account(self) -> None:
        """KV memory use this step: slots of allocated blocks, and those holding a real token."""
        bs, fill = self.config.block_size, {}
        for seq in (*self.prefilling, *self.running):
            for i, block in enumerate(seq.blocks):
                fill[block] = max(fill.get(block, 0), min(max(seq.computed - i * bs, 0), bs))
        self.kv_filled += sum(fill.values())
        self.kv_allocated += len(fill) * bs
        m = self.metrics
        m.waiting.set(len(self.waiting) + len(self._inbox))
        m.running.set(len(self.running) + len(self.prefilling))
        m.blocks_used.set(self.blocks.num_used)
        m.blocks_free.set(self.blocks.num_free)
        m.prefix_hit_rate.set(self.blocks.hit_rate())
        horizon = time.monotonic() - THROUGHPUT_WINDOW_S
        while self._recent and self._recent[0] < horizon:
            self._recent.popleft()
        m.tokens_per_s.set(len(self._recent) / THROUGHPUT_WINDOW_S)
        m.kv_waste.set(self.kv_waste())

    def prefill_rows(self, rows: int) -> int:
        """The rows of a prefill call holding ``rows`` chunks: a power of two, at most the step's
        budget (``max_prefill_tokens / prefill_chunk``), so there are only a handful of prefill
        shapes to compile."""
        most = max(self.config.max_prefill_tokens // self.config.prefill_chunk, 1)
        return _bucket(rows, most)

    def decode_buckets(self) -> list[int]:
        """The batch sizes decode steps are padded to."""
        n = self.config.max_num_seqs
        return sorted({_bucket(b, n, BATCH_STEP) for b in range(1, n + 1)})

    def warmup(self) -> float:
        """Compile the decode step for every batch bucket and a one-row prefill of
        every chunk width, with rows of padding (they write nothing). Returns the seconds taken."""
        start = time.perf_counter()
        pad = _Seq("warmup", [0] * max(self.cfg.max_seq_len, self.config.prefill_chunk), 0, 1, RequestParams(), frozenset(), 0, lambda o: None, 0.0)
        for batch in self.decode_buckets():
            self._run("decode", [(pad, 0, 1, 1)] * batch, padding=True)
        null = jax.device_put(np.zeros(1, np.int32), self._replicated)  # block 0 onto itself: zeros stay zeros
        with jax.set_mesh(self.mesh):
            self.pool_k = self._copy(self.pool_k, null, null)
        chunk = self.config.prefill_chunk
        for rows in sorted({self.prefill_rows(n) for n in range(1, self.config.max_prefill_tokens // chunk + 1)}):
            self._run("prefill", [(pad, 0, chunk, chunk)] * rows, padding=True)
        return time.perf_counter() - start

    def kv_waste(self) -> float:
        """Fraction of allocated KV slots that held no token, over every step so far."""
        return 1 - self.kv_filled / self.kv_allocated if self.kv_allocated else 0.0
