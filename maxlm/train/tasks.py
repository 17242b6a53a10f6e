"""Tasks: what a training run optimises, separate from how the loop runs it.

A ``Task`` is a loss over batches plus where its batches come from. ``loss_fn(params, batch, rng)
-> (loss_sum, weight, aux)`` (rng None when evaluating) sums the loss over the batch and returns its weight (e.g. the number of
loss-bearing tokens; the step divides one by the other across microbatches) and a dict of summed
auxiliary metrics (logged per unit of weight). ``batch_spec`` names each batch key's logical axes
(they decide its sharding). ``trainable``, when set, marks the parameters that train; the rest are
frozen. Pre-training's next-token cross-entropy is ``pretraining`` below; SFT, DPO and distillation
are tasks too, and ``maxlm.train.loop.run`` drives any of them. A task may train parameters of its own
beside the model's (``params``, ``maxlm.train.step.TaskParams``): they live in the same state under
``step.TASK_PARAMS``, and its ``loss_fn`` sees them there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import jax
import numpy as np

from maxlm import data
from maxlm.config import Config, ConfigError
from maxlm.model import cross_entropy
from maxlm.train.step import LossFn, TaskParams

TOKENS = ("batch", "length")
LM_BATCH = {"inputs": TOKENS, "targets": TOKENS, "segment_ids": TOKENS, "positions": TOKENS, "weights": TOKENS}


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    loss_fn: LossFn
    batch_spec: dict[str, tuple[str, ...]]
    train_batches: Callable[[], Iterator[dict[str, np.ndarray]]]  # with get_state/set_state/close
    eval_batches: Callable[[], list[dict[str, np.ndarray]]]
    trainable: Callable[[Any], Any] | None = None  # params -> tree of bools; None trains everything
    sample: Callable[[Any], str] | None = None  # params -> a short text shown when the run ends
    weight_key: str = "weights"  # the batch entry whose sum normalises the loss
    params: TaskParams | None = None  # the task's own trained parameters beside the model's, if any
    # (params, batch, step) -> the batch the step trains on, made from the current parameters: RL's
    # rollout (sampling completions and scoring them). Called after each batch is drawn; it must be
    # a function of its arguments alone (seeded by the step), so a resumed run repeats it exactly.
    rollout: Callable[[Any, dict[str, np.ndarray], int], dict[str, np.ndarray]] | None = None
    # params -> metrics logged with every evaluation (beside the eval loss, if eval_batches gives any)
    eval_metrics: Callable[[Any], dict[str, float]] | None = None


def lm_loss(forward: Callable, vocab_size: int, z_loss: float = 0.0) -> LossFn:
    """Next-token cross-entropy (+ z-loss) on an LM batch (``LM_BATCH``)."""
    def loss_fn(params, batch, rng):
        logits, _ = forward(params, batch["inputs"], batch["segment_ids"], batch["positions"], dropout_rng=rng)
        loss_sum, weight = cross_entropy(logits, batch["targets"], batch["weights"], vocab_size, z_loss)
        return loss_sum, weight, {}
    return loss_fn


def open_lm_data(cfg: Config) -> tuple[Callable, Callable]:
    """(train_batches, eval_batches) of the configured data, checked against the model when opened
    (the tokenizer's vocabulary and packed sources' fingerprints are read here, not in validation)."""
    try:
        data.check_config(cfg.data)
        data.check_vocab(cfg.data, cfg.model.vocab_size)
    except ValueError as err:
        raise ConfigError(f"{cfg.source}: {err}") from None
    where = dict(process_index=jax.process_index(), process_count=jax.process_count())
    tc = cfg.train

    def train_batches():
        return data.make_train_iterator(cfg.data, seq_len=tc.seq_len, global_batch=tc.global_batch, **where)

    def eval_batches():
        return data.make_eval_batches(cfg.data, seq_len=tc.seq_len, global_batch=tc.global_batch,
                                      num_batches=tc.eval_batches, **where)
    return train_batches, eval_batches


def pretraining(cfg: Config, forward: Callable) -> Task:
    """Next-token prediction on the configured data, closing with a sample from "def "."""
    from maxlm.infer import generate

    train_batches, eval_batches = open_lm_data(cfg)
    tokenizer = data.get_tokenizer(cfg.data.tokenizer)

    def sample(params) -> str:
        prompt = tokenizer.encode("def ", add_eos=False)
        result = generate.run(cfg.model, params, [prompt], cfg.train.sample_tokens, tokenizer=tokenizer,
                              sampling=generate.SamplingParams(temperature=0.8, top_k=40),
                              stop_tokens=[tokenizer.eos_id], seed=cfg.train.seed)
        return "def " + result.texts[0]

    return Task("pretraining", lm_loss(forward, cfg.model.vocab_size, cfg.train.z_loss), LM_BATCH,
                train_batches, eval_batches, sample=sample if cfg.train.sample_tokens else None)


def lm_steps(cfg: Config, mesh, optimizer, shardings) -> tuple[Callable, Callable]:
    """(train_step, eval_step) of pre-training's loss on this mesh, for benchmarks, the planner's
    ``--aot`` compile and tests that drive the step without the loop."""
    from maxlm.train.step import compile_steps, model_forward

    loss_fn = lm_loss(model_forward(cfg, mesh), cfg.model.vocab_size, cfg.train.z_loss)
    return compile_steps(cfg, mesh, optimizer, shardings, loss_fn, LM_BATCH)
