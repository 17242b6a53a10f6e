"""Perplexity scoring with a maxlm checkpoint, for the optional last stage of ``clean``.

``PerplexityScorer(run_dir)`` reads the run's operative config (``RUN_DIR/config.gin``), its
tokenizer, and the parameters of its newest checkpoint (``RUN_DIR/checkpoints/<step>/state``), or
a parameter folder written by ``maxlm.train.checkpoint.save_params`` (``maxlm.hf import``) when given
``params_dir``. ``score(texts)`` returns each document's perplexity over its first ``max_tokens``
tokens, computed on one device in fixed-shape batches (one compilation).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tqdm import tqdm


def _latest_state_dir(run_dir: Path) -> Path:
    steps = sorted((int(p.name), p) for p in (run_dir / "checkpoints").glob("*")
                   if p.name.isdigit() and (p / "state").is_dir())
    if not steps:
        raise ValueError(f"perplexity filter: {run_dir} has no checkpoints/<step>/state to score with "
                         "(train a model first, e.g. `python -m maxlm.train --config=tiny.gin`)")
    return steps[-1][1] / "state"


class PerplexityScorer:
    def __init__(self, run_dir: str, max_tokens: int = 512, batch: int = 8, params_dir: str = ""):
        import jax
        import orbax.checkpoint as ocp

        from maxlm import config
        from maxlm.data.tokenizer import get_tokenizer

        run = Path(run_dir).expanduser().resolve()
        gin_path = run / "config.gin"
        if not gin_path.is_file():
            raise ValueError(f"perplexity filter: {gin_path} not found (give a maxlm run directory)")
        self.cfg = config.load(str(gin_path))
        self.tokenizer = get_tokenizer(self.cfg.data.tokenizer)
        self.max_tokens = max(2, min(max_tokens, self.cfg.model.max_seq_len))
        self.batch = batch
        path = Path(params_dir).expanduser().resolve() if params_dir else _latest_state_dir(run)
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(path)
        params = restored["params"] if "params" in restored else restored
        self.params = jax.device_put(params, jax.devices()[0])
        self._fn = jax.jit(self._nll)

    def _nll(self, params, inputs, targets, weights):
        import jax.numpy as jnp

        from maxlm.model import forward, token_nll

        segment_ids = (weights > 0).astype(jnp.int32) | (jnp.arange(inputs.shape[1]) == 0)
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
        logits, _ = forward(self.cfg.model, params, inputs, segment_ids, positions)
        nll, _ = token_nll(logits, targets, self.cfg.model.vocab_size)
        return jnp.sum(nll * weights, axis=1), jnp.sum(weights, axis=1)

    def score(self, texts: Iterable[str], total: int | None = None, progress: bool = False) -> np.ndarray:
        """Perplexity per document (exp of the mean next-token loss over its first tokens)."""
        T, pad = self.max_tokens, self.tokenizer.pad_id
        out: list[float] = []
        rows: list[np.ndarray] = []

        def flush():
            inputs = np.full((self.batch, T), pad, np.int32)
            targets = np.full((self.batch, T), pad, np.int32)
            weights = np.zeros((self.batch, T), np.float32)
            for i, ids in enumerate(rows):
                n = len(ids) - 1
                inputs[i, :n], targets[i, :n], weights[i, :n] = ids[:-1], ids[1:], 1.0
            sums, counts = self._fn(self.params, inputs, targets, weights)
            sums, counts = np.asarray(sums), np.asarray(counts)
            out.extend(float(np.exp(s / max(c, 1.0))) for s, c in zip(sums[:len(rows)], counts[:len(rows)]))
            rows.clear()

        bar = tqdm(total=total, desc="perplexity", unit="doc", disable=not progress, dynamic_ncols=True)
        for text in texts:
            rows.append(self.tokenizer.encode(text, add_bos=True, add_eos=True)[:T + 1])
            if len(rows) == self.batch:
                flush()
                bar.update(self.batch)
        if rows:
            n = len(rows)
            flush()
            bar.update(n)
        bar.close()
        return np.asarray(out, dtype=np.float64)
