"""A reward model as a task of the shared loop: the transformer with a scalar head, trained with
the Bradley-Terry loss on preference pairs (``maxlm.data.preference``, the data DPO reads).

The reward of a sequence is ``score . h + bias``, h the hidden state the LM head would read
(after the final norm; ``model.forward_hidden(final=True)``) at the sequence's last reply position:
the position whose next token is the reply's closing eos, having read the prompt and the whole
reply (``RewardConfig.pooling = "last"``, what Hugging Face's ``LlamaForSequenceClassification``
computes); or, with ``pooling = "mean"``, the mean of ``score . h_t + bias`` over every reply
position t, which lets a small model judge each token where it sees it. Per pair, with r_c and r_r the chosen and rejected rewards, the loss is TRL's
``RewardTrainer``'s:

    -log sigmoid(r_c - r_r)  +  center_rewards_coefficient * (r_c + r_r)^2

(the second term, off by default, keeps rewards centred on zero). Logged per pair: ``accuracy``
(r_c > r_r), ``margin`` (r_c - r_r), ``rewards/chosen`` and ``rewards/rejected``.

The head (``score`` [d_model] and ``bias`` []) is the task's own parameters (``step.TaskParams``):
it sits beside the transformer's in the train state under ``step.TASK_PARAMS``, is trained,
checkpointed and restored with it, and a warm start (``TrainConfig.init_from``, an SFT'd model as
the guides recommend) brings the transformer alone. With ``ModelConfig.lora_rank`` the trunk trains
through its adapters and the head trains in full. ``Scorer`` scores (prompt, reply) conversations
with a trained model, for RL from rewards and for people; ``maxlm.hf export`` of a reward run
writes the head beside the model as ``reward_head.safetensors`` (``HEAD_FILE``), in the layout of
Hugging Face's ``LlamaForSequenceClassification`` ``score`` Linear (one label) plus a bias.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from maxlm import data, model
from maxlm.config import Config, ConfigError
from maxlm.data import preference
from maxlm.parallel import sharding
from maxlm.train import step
from maxlm.train.tasks import Task

HEAD = "reward_head"  # the task's parameters: {"score": [d_model], "bias": []}
HEAD_FILE = "reward_head.safetensors"  # in an export: score.weight [1, d_model], score.bias [1]
METRICS = ("accuracy", "margin", "rewards/chosen", "rewards/rejected")


def head_params(cfg: Config) -> step.TaskParams:
    """The scalar head: ``score`` starts small and random (as Hugging Face's ``score`` Linear),
    ``bias`` at zero."""
    d = cfg.model.d_model

    def init(rng):
        score = jax.random.normal(rng, (d,), jnp.float32) * cfg.model.init_std
        return {HEAD: {"score": score.astype(cfg.model.param_dtype), "bias": jnp.zeros((), cfg.model.param_dtype)}}
    return step.TaskParams(init, {HEAD: {"score": PartitionSpec("embed"), "bias": PartitionSpec()}})


def last_reply_index(weights: jax.Array) -> jax.Array:
    """[B] the last position of each row whose weight is non-zero (its reply's last token before eos)."""
    positions = jnp.arange(weights.shape[-1])
    return jnp.max(jnp.where(weights > 0, positions, 0), axis=-1)


def rewards(model_cfg, params: Any, head: dict, features: dict, rng=None, pooling: str = "last") -> jax.Array:
    """[B] rewards of the rows ``features`` holds (``inputs``, ``segment_ids``, ``positions``,
    ``weights``): the head on the final hidden state at the last reply token (``pooling`` "last"), or
    the mean of the head over every reply token's (``pooling`` "mean")."""
    _, hidden = model.forward_hidden(model_cfg, params, features["inputs"], features["segment_ids"],
                                     features["positions"], dropout_rng=rng, final=True)
    score, bias = head["score"].astype(jnp.float32), head["bias"].astype(jnp.float32)
    if pooling == "mean":
        per_token = hidden.astype(jnp.float32) @ score + bias  # [B, T]
        w = features["weights"]
        return jnp.sum(per_token * w, -1) / jnp.maximum(jnp.sum(w, -1), 1.0)
    at = last_reply_index(features["weights"])
    last = jnp.take_along_axis(hidden, at[:, None, None], axis=1)[:, 0].astype(jnp.float32)
    return last @ score + bias


def reward_loss(chosen: jax.Array, rejected: jax.Array, center: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss per pair, {metric: value per pair}) from the two sides' rewards ([pairs] each)."""
    losses = -jax.nn.log_sigmoid(chosen - rejected) + center * (chosen + rejected) ** 2
    margin = jax.lax.stop_gradient(chosen - rejected)
    return losses, {"accuracy": (margin > 0).astype(jnp.float32), "margin": margin,
                    "rewards/chosen": jax.lax.stop_gradient(chosen),
                    "rewards/rejected": jax.lax.stop_gradient(rejected)}


def make_loss(cfg: Config) -> step.LossFn:
    from maxlm.posttrain.dpo import FEATURES

    center, pooling = cfg.reward.center_rewards_coefficient, cfg.reward.pooling

    def loss_fn(params, batch, rng):
        both = {k: jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]]) for k in FEATURES}
        r = rewards(cfg.model, step.model_part(params), params[step.TASK_PARAMS][HEAD], both, rng, pooling)
        n = batch["chosen_inputs"].shape[0]
        losses, metrics = reward_loss(r[:n], r[n:], center)
        w = batch["weights"]  # one per pair
        return jnp.sum(losses * w), jnp.sum(w), {k: jnp.sum(v * w) for k, v in metrics.items()}
    return loss_fn


def load_data(cfg: Config) -> preference.PreferenceData:
    from maxlm.posttrain.dpo import load_pairs

    return load_pairs(cfg, "reward")


def reward_task(cfg: Config, forward: Callable, mesh=None) -> Task:
    """The Task (``forward`` is unused: the head needs the final hidden states, which
    ``model.forward_hidden`` returns)."""
    from maxlm.posttrain.dpo import PAIR_BATCH, heldout_metrics, pair_batches

    del forward
    # MeshConfig.pipeline > 1 never gets here: validate refuses it (the pipeline does not collect
    # the final hidden states).
    mesh = mesh or sharding.make_mesh(cfg.mesh.shape(jax.device_count()))
    pairs = load_data(cfg)
    tokenizer = data.get_tokenizer(cfg.data.tokenizer)
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    say(pairs.report.summary("preference data"), flush=True)
    if pairs.eval_report is not None:
        say(pairs.eval_report.summary("preference eval data"), flush=True)
    loss_fn = make_loss(cfg)
    train_batches, eval_batches, all_held_out = pair_batches(cfg, pairs, tokenizer, {"task": "reward"})

    def sample(params) -> str:
        m = heldout_metrics(loss_fn, params, all_held_out(), mesh, PAIR_BATCH)
        return (f"held-out pairs ({int(m['pairs'])}): loss {m['loss']:.4f}, "
                + ", ".join(f"{k} {m[k]:.4g}" for k in METRICS))

    return Task("reward", loss_fn, PAIR_BATCH, train_batches, eval_batches, sample=sample, params=head_params(cfg))


# ---- scoring with a trained reward model


def read_head(source: str | Path, model_cfg: Any, run: Config | None = None) -> tuple[dict, str]:
    """(head, pooling) of a reward model: from its run's checkpoint folder ``source`` (``run`` its
    config), or from an export's ``HEAD_FILE``; a ConfigError (one line) when it holds none. For a
    model opened by ``maxlm.hf.load.load_model``: ``read_head(loaded.source, loaded.cfg, loaded.run_config)``."""
    source = Path(source)
    shapes = {"score": jax.ShapeDtypeStruct((model_cfg.d_model,), jnp.dtype(model_cfg.param_dtype)),
              "bias": jax.ShapeDtypeStruct((), jnp.dtype(model_cfg.param_dtype))}
    if (source / HEAD_FILE).is_file():
        from safetensors import safe_open

        with safe_open(source / HEAD_FILE, "numpy") as f:
            pooling = (f.metadata() or {}).get("pooling", "last")
            head = {"score": jnp.asarray(f.get_tensor("score.weight")[0]),
                    "bias": jnp.asarray(f.get_tensor("score.bias")[0])}
        return head, pooling
    if (source / "state").is_dir() and run is not None and run.train.task == "reward":
        from maxlm.train import checkpoint

        replicated = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        tree = checkpoint.restore_state_params(source, {step.TASK_PARAMS: {HEAD: shapes}},
                                               {step.TASK_PARAMS: {HEAD: {k: replicated for k in shapes}}})
        return tree[step.TASK_PARAMS][HEAD], run.reward.pooling
    raise ConfigError(f"{source}: no reward head (a run with TrainConfig.task = 'reward', or an export of one "
                      f"with {HEAD_FILE})")


def head_file(head: dict, pooling: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of ``HEAD_FILE``: Hugging Face's ``score`` Linear of
    ``LlamaForSequenceClassification`` with one label, weight [1, d_model], its bias [1], and the
    pooling in the file's metadata."""
    return ({"score.weight": np.asarray(head["score"], np.float32)[None],
             "score.bias": np.asarray(head["bias"], np.float32).reshape(1)}, {"pooling": pooling})


class Scorer:
    """A trained reward model as a scoring function: ``scorer(conversations)`` -> [n] rewards, each
    conversation a prompt's messages followed by its reply's (assistant) messages. Open one with
    ``loaded = maxlm.hf.load.load_model(PATH)`` and ``read_head(loaded.source, loaded.cfg, loaded.run_config)``."""

    def __init__(self, model_cfg, params: Any, tokenizer: Any, head: dict, batch: int = 16, pooling: str = "last"):
        self.cfg, self.params, self.tokenizer, self.head, self.batch = model_cfg, params, tokenizer, head, batch
        self._fn = jax.jit(lambda p, h, f: rewards(model_cfg, p, h, f, pooling=pooling))

    def __call__(self, conversations: list[list[dict[str, str]]]) -> np.ndarray:
        from maxlm.data import chat

        out = []
        for start in range(0, len(conversations), self.batch):
            part = conversations[start:start + self.batch]
            encoded = [chat.encode_chat(self.tokenizer, c) for c in part]
            width = max(ids.size for ids, _ in encoded)
            if width > self.cfg.max_seq_len:
                raise ValueError(f"a conversation of {width} tokens is longer than the model's context "
                                 f"({self.cfg.max_seq_len})")
            rows = [preference.side_features(ids, mask, width, self.tokenizer.pad_id) for ids, mask in encoded]
            rows += [rows[-1]] * (self.batch - len(rows))  # one compiled shape per width
            feats = {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}
            out.append(np.asarray(self._fn(self.params, self.head, feats))[:len(part)])
        return np.concatenate(out) if out else np.zeros(0, np.float32)
