"""Held-out perplexity and bits per byte.

Each document is tokenised as in training, ``[bos] + text + [eos]``, and every token after the bos
is predicted (the eos too: ending the document is part of modelling it). A document longer than
the model's context is cut into consecutive windows of ``max_seq_len`` predictions; each window
restarts its context at its first token, as a packed training row does.

    perplexity     = exp(total NLL / predicted tokens)
    bits_per_byte  = total NLL / ln 2 / UTF-8 bytes of the texts

Bits per byte does not depend on the tokenizer, so models with different vocabularies compare.
A data source contributes the documents of its held-out split: the split the trainer holds out
(``maxlm.data.sources.split`` with the run's ``DataConfig.eval_fraction``), so ``perplexity:stdlib``
of a model trained on stdlib scores text it never trained on.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from maxlm.eval.loglikelihood import Scorer
from maxlm.eval.tasks import Task, TaskError

DEFAULT_EVAL_FRACTION = 0.02  # DataConfig's default, for Hugging Face directories (no run config)


def source_documents(spec: str, *, eval_fraction: float = DEFAULT_EVAL_FRACTION,
                     max_doc_bytes: int = 32 << 20, limit: int | None = None,
                     max_chars: int | None = None) -> list[str]:
    """The held-out documents of a raw source (or ';'-separated mixture): the first ``limit`` of
    them, or as many as reach ``max_chars`` characters."""
    from maxlm.data import sources
    from maxlm.data.spec import split_sources

    texts: list[str] = []
    chars = 0
    for part in split_sources(spec):
        try:
            _, held = sources.split(sources.get_source(part, max_doc_bytes), eval_fraction)
        except ValueError as err:
            raise TaskError(f"perplexity:{spec}: {err}") from None
        for i in range(len(held)):
            record = held.read(i)
            if not record.problem and record.text:
                texts.append(record.text)
                chars += len(record.text)
            if (limit and len(texts) >= limit) or (max_chars and chars >= max_chars):
                return texts
    return texts


def windows(tokens: np.ndarray, max_len: int) -> list[np.ndarray]:
    """Consecutive pieces of ``tokens`` that together predict tokens[1:], each predicting at most
    ``max_len`` tokens from the piece's own first token on."""
    return [tokens[start:start + max_len + 1] for start in range(0, len(tokens) - 1, max_len)]


def score_texts(scorer: Scorer, tokenizer: Any, texts: list[str]) -> dict[str, float]:
    seqs = []
    for text in texts:
        seqs += windows(tokenizer.encode(text, add_bos=True, add_eos=True), scorer.cfg.max_seq_len)
    results = scorer.sequences(seqs, [len(s) - 1 for s in seqs])
    nll = -sum(ll for ll, _, _ in results)
    tokens = sum(len(s) - 1 for s in seqs)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return {"perplexity": math.exp(min(nll / tokens, 700.0)), "bits_per_byte": nll / math.log(2) / n_bytes,
            "nll_per_token": nll / tokens, "tokens": tokens, "bytes": n_bytes, "documents": len(texts)}


def budget(texts: list[str], max_chars: int | None) -> list[str]:
    """The texts cut to ``max_chars`` characters in all (the last one kept is truncated)."""
    if not max_chars:
        return texts
    out, left = [], max_chars
    for text in texts:
        if left <= 0:
            break
        out.append(text[:left])
        left -= len(out[-1])
    return out


def evaluate(task: Task, scorer: Scorer, tokenizer: Any, *, run_config: Any = None,
             limit: int | None = None, max_chars: int | None = None) -> dict[str, Any]:
    """Metrics of a perplexity task (documents in the file, or a data source's held-out split);
    ``max_chars`` bounds the text scored (the training loop's per-eval budget)."""
    texts = list(task.docs[:limit] if limit else task.docs)
    if not texts:
        spec = task.source
        if not spec:
            if run_config is None:
                raise TaskError("task 'perplexity' scores the run's own data source, but a Hugging Face "
                                "directory has none: name one, e.g. perplexity:stdlib")
            spec = run_config.data.source
        data = run_config.data if run_config is not None else None
        texts = source_documents(spec, eval_fraction=data.eval_fraction if data else DEFAULT_EVAL_FRACTION,
                                 max_doc_bytes=data.max_doc_bytes if data else 32 << 20, limit=limit,
                                 max_chars=max_chars)
        if not texts:
            raise TaskError(f"perplexity:{spec}: its held-out split holds no readable document")
    return {"metrics": score_texts(scorer, tokenizer, budget(texts, max_chars)), "samples": []}
