"""Calibration and held-out data of a run, and the perplexity that judges a compressed model.

``calibration_batches`` takes the first batches of the run's own training stream and
``heldout_batches`` the held-out split the trainer evaluates on, both through the trainer's data
pipeline (``maxlm.train.tasks.open_lm_data``), so their keys are a training batch's: inputs,
targets, segment_ids, positions, weights. ``perplexity`` is exp of the mean token NLL over the
weighted tokens, the trainer's eval loss. Used by quantization (GPTQ/AWQ statistics) and pruning.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np

from maxlm import model
from maxlm.config import Config, ModelConfig
from maxlm.train.tasks import open_lm_data


def _data(cfg: Config, count: int, batch_size: int | None):
    """The run's (train_batches, eval_batches) with ``batch_size`` rows per batch (default: the
    run's TrainConfig.global_batch) and ``count`` held-out batches."""
    if count < 1:
        raise ValueError(f"batch count must be >= 1, got {count}")
    rows = batch_size or cfg.train.global_batch
    return open_lm_data(cfg.replace(train={"global_batch": rows, "eval_batches": count}))


def _host(batch: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in batch.items()}


def calibration_batches(cfg: Config, count: int, batch_size: int | None = None) -> list[dict[str, np.ndarray]]:
    """The first ``count`` batches of the run's training stream (its seed and shuffle), each of
    ``batch_size`` rows (default TrainConfig.global_batch) of TrainConfig.seq_len tokens."""
    train_batches, _ = _data(cfg, count, batch_size)
    iterator = train_batches()
    try:
        return [_host(next(iterator)) for _ in range(count)]
    finally:
        iterator.close()


def heldout_batches(cfg: Config, count: int, batch_size: int | None = None) -> list[dict[str, np.ndarray]]:
    """The first ``count`` batches of the held-out split the trainer evaluates on (unshuffled,
    the same tokens every call; a small split is cycled)."""
    _, eval_batches = _data(cfg, count, batch_size)
    return [_host(b) for b in eval_batches()]


def run_batches(cfg: Config, args: Any, calibrate: bool) -> tuple[list, list]:
    """(calibration batches, held-out batches) of a run's own data for a command's ``args``
    (``checkpoint``, ``calib_samples``, ``eval_batches``); unreadable data is a one-line UserError."""
    from maxlm.cli_args import UserError
    from maxlm.config import ConfigError

    try:
        held = heldout_batches(cfg, args.eval_batches or cfg.train.eval_batches)
        calib = calibration_batches(cfg, -(-args.calib_samples // cfg.train.global_batch)) if calibrate else []
    except (ConfigError, ValueError, OSError) as err:
        raise UserError(f"{args.checkpoint}: cannot read the run's data "
                        f"(DataConfig.source = {cfg.data.source!r}): {' '.join(str(err).split())}") from None
    return calib, held


@functools.lru_cache(maxsize=16)
def _nll_fn(model_cfg: ModelConfig):
    """(summed NLL, summed weight) of one batch, jitted once per model config."""
    def nll(params, batch):
        logits, _ = model.forward(model_cfg, params, batch["inputs"], batch["segment_ids"], batch["positions"])
        return model.cross_entropy(logits, batch["targets"], batch["weights"], model_cfg.vocab_size)
    return jax.jit(nll)


def mean_nll(model_cfg: ModelConfig, params: Any, batches: list[dict[str, np.ndarray]]) -> float:
    """Mean next-token NLL (nats) over the weighted tokens of ``batches``."""
    fn, total, weight = _nll_fn(model_cfg), 0.0, 0.0
    keys = ("inputs", "targets", "segment_ids", "positions", "weights")
    for batch in batches:
        loss_sum, w = jax.device_get(fn(params, {k: batch[k] for k in keys}))
        total, weight = total + float(loss_sum), weight + float(w)
    if weight <= 0:
        raise ValueError("the batches hold no weighted tokens to score")
    return total / weight


def perplexity(model_cfg: ModelConfig, params: Any, batches: list[dict[str, np.ndarray]]) -> float:
    """exp of the mean token NLL over the weighted tokens of ``batches``."""
    return math.exp(min(mean_nll(model_cfg, params, batches), 50.0))
