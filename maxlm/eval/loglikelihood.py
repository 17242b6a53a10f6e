"""Log-likelihoods of token sequences and of (context, continuation) pairs, in padded batches.

Tokenisation follows lm-evaluation-harness's Hugging Face model (``HFLM._encode_pair``):

- whitespace at the end of the context moves to the start of the continuation, so
  ("Answer: ", "Paris") is scored as ("Answer:", " Paris");
- the continuation's tokens are ``encode(ctx + cont)[len(encode(ctx)):]``: the tokens the pair
  gets when tokenised as one text, so a BPE merge across the boundary counts to the continuation;
- BOS: every sequence starts with the tokenizer's <|bos|>, as every training document does. In
  lm-eval that is ``--model_args add_bos_token=True`` with the exported tokenizer (whose
  post-processor prepends <|bos|>); both then score ``[bos] + context`` -> continuation;
- a sequence longer than the model's context keeps its last ``max_seq_len + 1`` tokens.

``Scorer`` runs one forward per padded batch. Requests are sorted by length (longest first) and
each batch is padded to a bucket (a power of two, at least 16, at most ``max_seq_len``) and to the
full batch size, so a whole evaluation compiles once per bucket, not once per request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.config import ModelConfig
from maxlm.infer.generate import MIN_BUCKET, bucket  # noqa: F401 (MIN_BUCKET: re-exported)
from maxlm.model import forward as model_forward
from maxlm.model import token_nll


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[np.ndarray, np.ndarray]:
    """(context tokens with <|bos|>, continuation tokens), as lm-eval's HFLM splits a pair."""
    stripped = context.rstrip()
    if len(stripped) < len(context):
        context, continuation = stripped, context[len(stripped):] + continuation
    context_enc = tokenizer.encode(context, add_bos=True, add_eos=False)
    whole = tokenizer.encode(context + continuation, add_bos=True, add_eos=False)
    return context_enc, whole[len(context_enc):]


class Scorer:
    """Per-token log-probabilities under one model.

    ``forward(params, tokens, segment_ids, positions) -> (logits, cache)`` defaults to
    ``maxlm.model.forward``; the training loop passes its pipeline-aware one. ``mesh``, when given,
    is entered around every call (the parameters' mesh). ``batch_size`` must divide by the mesh's
    batch axes when there is one."""

    def __init__(self, cfg: ModelConfig, params: Any, *, batch_size: int = 8,
                 forward: Callable | None = None, mesh: jax.sharding.Mesh | None = None):
        self.cfg, self.params, self.batch_size, self.mesh = cfg, params, batch_size, mesh
        fwd = forward or (lambda p, t, s, pos: model_forward(cfg, p, t, s, pos))
        vocab = cfg.vocab_size

        def scores(params, tokens, segments, positions, targets):
            logits, _ = fwd(params, tokens, segments, positions)
            nll, _ = token_nll(logits, targets, vocab)
            greedy = jnp.argmax(logits[..., :vocab].astype(jnp.float32), axis=-1) == targets
            return -nll, greedy

        self._scores = jax.jit(scores)

    def with_params(self, params: Any) -> Scorer:
        """Same compiled function, other parameters (the training loop's latest)."""
        self.params = params
        return self

    def rows(self, tokens: np.ndarray, segments: np.ndarray, positions: np.ndarray,
             targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(log p(target), target == argmax) for [B, T] rows, B == batch_size."""
        if self.mesh is None:
            out = self._scores(self.params, tokens, segments, positions, targets)
        else:
            with jax.set_mesh(self.mesh):
                out = self._scores(self.params, tokens, segments, positions, targets)
        if jax.process_count() > 1:  # outputs span hosts: every process gathers the whole batch
            from jax.experimental import multihost_utils

            return tuple(np.asarray(x) for x in multihost_utils.process_allgather(out, tiled=True))
        return tuple(np.asarray(x) for x in jax.device_get(out))

    def sequences(self, seqs: Sequence[np.ndarray], n_scored: Sequence[int]) -> list[tuple[float, bool, np.ndarray]]:
        """For each token sequence, the summed log-probability of its last ``n_scored`` tokens given
        everything before them, whether each of those tokens is the greedy choice, and the
        per-token log-probabilities. Sequences longer than ``max_seq_len + 1`` lose their head."""
        limit = self.cfg.max_seq_len + 1
        seqs = [np.asarray(s, np.int32)[-limit:] for s in seqs]
        for s, n in zip(seqs, n_scored):
            if not 1 <= n < len(s):
                raise ValueError(f"cannot score {n} of a sequence of {len(s)} tokens (the context must "
                                 f"keep at least one token; max_seq_len = {self.cfg.max_seq_len})")
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        out: list[Any] = [None] * len(seqs)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            width = bucket(max(len(seqs[i]) - 1 for i in chunk), self.cfg.max_seq_len)
            tokens = np.zeros((self.batch_size, width), np.int32)
            targets = np.zeros_like(tokens)
            segments = np.zeros_like(tokens)
            for row, i in enumerate(chunk):
                n = len(seqs[i]) - 1
                tokens[row, :n], targets[row, :n], segments[row, :n] = seqs[i][:-1], seqs[i][1:], 1
            positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
            logp, greedy = self.rows(tokens, segments, positions, targets)
            for row, i in enumerate(chunk):
                end, n = len(seqs[i]) - 1, n_scored[i]
                lp = logp[row, end - n:end].astype(np.float64)
                out[i] = (float(lp.sum()), bool(greedy[row, end - n:end].all()), lp)
        return out

    def pairs(self, tokenizer: Any, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        """lm-eval's ``loglikelihood``: (log p(continuation | context), is_greedy) per pair."""
        seqs, counts = [], []
        for context, continuation in pairs:
            ctx, cont = encode_pair(tokenizer, context, continuation)
            if len(cont) == 0:
                raise ValueError(f"continuation {continuation!r} encodes to no tokens")
            seqs.append(np.concatenate([ctx, cont]))
            counts.append(len(cont))
        return [(ll, greedy) for ll, greedy, _ in self.sequences(seqs, counts)]
