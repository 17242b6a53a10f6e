"""DPO as a task of the shared loop: Direct Preference Optimization (and IPO, robust DPO) on
preference pairs (``maxlm.data.preference``), with the metrics TRL reports.

Each batch row is one pair, its chosen and rejected sequences side by side (``PAIR_BATCH``:
``chosen_*`` and ``rejected_*`` token features, and ``weights``, one per pair: 1 on a real row, 0 on
an eval batch's padding). One forward of the
policy runs both sides (concatenated along the batch); a sequence's log-prob is the sum of its reply
tokens' log-probs (weights = exactly the reply tokens, as SFT's mask). With the reference's log-probs
of the same sequences and h = (pi_c - ref_c) - (pi_r - ref_r), the loss per pair is, as TRL's
``DPOTrainer`` defines it (``loss_type``):

    sigmoid   -(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h)     (ls = label_smoothing; cDPO)
    robust    (-(1 - ls) log sigmoid(beta h) + ls log sigmoid(-beta h)) / (1 - 2 ls)
    ipo       (h' - 1 / (2 beta))^2, h' the same difference with each side's log-ratio divided by its
              reply length (TRL's length normalisation for IPO)

Metrics per pair (the task's weight is the per-pair ``weights``, so the loop's sums divided by the weight are means
over pairs, as TRL's): ``rewards/chosen`` = beta (pi_c - ref_c), ``rewards/rejected``,
``rewards/accuracies`` (chosen reward > rejected reward), ``rewards/margins``, ``logps/chosen`` and
``logps/rejected`` (the policy's summed reply log-probs).

The reference is the run's starting point, frozen: with ``ModelConfig.lora_rank`` > 0 it is the
same parameters with the adapters removed (``lora.without_adapters`` under ``lora_rank = 0``: the
base is frozen, so no second copy of the weights); otherwise a copy of the starting parameters
(``TrainConfig.init_from`` / ``init_params``, or the seed's random initialisation), read by the task
itself and placed on the mesh with the model's parameter shardings, so a resumed run keeps the same
reference. ``DPOConfig.precompute_ref`` computes the reference log-probs of every pair once, before
training, carries them in the batches, and frees the copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from maxlm import data, model
from maxlm.config import Config, ConfigError
from maxlm.data import preference
from maxlm.data.sft import Example
from maxlm.model import lora
from maxlm.parallel import sharding
from maxlm.train import step
from maxlm.train.tasks import TOKENS, Task

FEATURES = ("inputs", "targets", "segment_ids", "positions", "weights")
PAIR_BATCH = {**{f"{s}_{k}": TOKENS for s in preference.SIDES for k in FEATURES}, "weights": ("batch",)}
REF_BATCH = {**PAIR_BATCH, "ref_chosen_logps": ("batch",), "ref_rejected_logps": ("batch",)}
LOSS_TYPES = ("sigmoid", "ipo", "robust")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


# ---- the loss on sequence log-probs (what the tests compare with numpy and with TRL)


def dpo_loss(policy_chosen: jax.Array, policy_rejected: jax.Array, ref_chosen: jax.Array, ref_rejected: jax.Array,
             *, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             chosen_len: jax.Array | None = None, rejected_len: jax.Array | None = None
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss per pair, {metric: value per pair}) from summed reply log-probs ([pairs] each);
    ``*_len`` (reply tokens) are needed by IPO only."""
    chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    h = chosen_ratio - rejected_ratio
    ls = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1 - ls) * jax.nn.log_sigmoid(beta * h) - ls * jax.nn.log_sigmoid(-beta * h)
    elif loss_type == "robust":
        losses = (-(1 - ls) * jax.nn.log_sigmoid(beta * h) + ls * jax.nn.log_sigmoid(-beta * h)) / (1 - 2 * ls)
    elif loss_type == "ipo":
        h = chosen_ratio / jnp.maximum(chosen_len, 1.0) - rejected_ratio / jnp.maximum(rejected_len, 1.0)
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    chosen_rewards = jax.lax.stop_gradient(beta * chosen_ratio)
    rejected_rewards = jax.lax.stop_gradient(beta * rejected_ratio)
    metrics = {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
               "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(jnp.float32),
               "rewards/margins": chosen_rewards - rejected_rewards,
               "logps/chosen": jax.lax.stop_gradient(policy_chosen),
               "logps/rejected": jax.lax.stop_gradient(policy_rejected)}
    return losses, metrics


def token_logps(logits: jax.Array, targets: jax.Array, vocab_size: int) -> jax.Array:
    """[B, T] log-probs of each target token under ``logits`` (padded vocab columns ignored), in fp32."""
    logp = jax.nn.log_softmax(logits[..., :vocab_size].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def sequence_logps(forward: Callable, params: Any, batch: dict, vocab_size: int, rng=None) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) summed reply-token log-probs, [pairs] each, from one forward over both sides."""
    both = {k: jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]]) for k in FEATURES}
    logits, _ = forward(params, both["inputs"], both["segment_ids"], both["positions"], dropout_rng=rng)
    summed = jnp.sum(token_logps(logits, both["targets"], vocab_size) * both["weights"], axis=-1)
    n = batch["chosen_inputs"].shape[0]
    return summed[:n], summed[n:]


# ---- the reference


@dataclasses.dataclass
class Reference:
    """The frozen reference: ``forward(policy_params, tokens, segment_ids, positions)`` -> logits
    (``policy_params`` is read only when the reference is the policy without its adapters), and
    ``logps(policy_params, pair_batch)`` -> the pair's summed reply log-probs."""

    what: str
    forward: Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]
    params: Any = None  # the frozen copy, when there is one
    vocab: int = 0

    def logps(self, policy_params: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
        fwd = lambda p, tokens, seg, pos, dropout_rng=None: (self.forward(p, tokens, seg, pos), None)
        return sequence_logps(fwd, policy_params, batch, self.vocab)


def _placed(cfg: Config, mesh) -> tuple[Any, Any]:
    names = sharding.logical_specs(model.abstract_params(cfg.model, boxed=True))
    return model.abstract_params(cfg.model), sharding.mesh_shardings(names, mesh)


def load_reference(cfg: Config, mesh, forward: Callable, section: str = "DPO") -> Reference:
    """The frozen reference of a run that starts from TrainConfig.init_from / init_params (module
    docstring); DPO's and GRPO's (``section`` names the task in errors)."""
    vocab = cfg.model.vocab_size
    if cfg.model.lora_rank:
        base_cfg = dataclasses.replace(cfg, model=lora.base_config(cfg.model))
        base_forward = step.model_forward(base_cfg, mesh)

        def base_logits(params, tokens, seg, pos):
            return base_forward(lora.without_adapters(step.model_part(params)), tokens, seg, pos)[0]
        return Reference("the policy without its LoRA adapters (no second copy)", base_logits, vocab=vocab)
    from maxlm.train import checkpoint, loop

    abstract, shards = _placed(cfg, mesh)
    tc = cfg.train
    try:
        if tc.init_params:
            params, what = checkpoint.restore_params(tc.init_params, abstract, shards), tc.init_params
        elif tc.init_from:
            step_dir = loop.warm_start_dir(cfg)
            params, what = checkpoint.restore_state_params(step_dir, abstract, shards), str(step_dir)
        else:
            key = jax.random.split(jax.random.PRNGKey(tc.seed))[1]  # as step.init_state initialises the model
            params = jax.jit(lambda k: model.init_params(cfg.model, k), out_shardings=shards)(key)
            what = f"the random initialisation (seed {tc.seed})"
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - Orbax/tensorstore raise many types for damaged files
        raise ConfigError(f"{cfg.source}: cannot read the {section} reference from TrainConfig.init_from / "
                          f"init_params ({type(err).__name__}: {' '.join(str(err).split())[:200]})") from None

    def copy_logits(_params, tokens, seg, pos):
        return forward(params, tokens, seg, pos)[0]
    return Reference(f"a frozen copy of {what}", copy_logits, params, vocab)


# ---- the task


def make_loss(cfg: Config, forward: Callable, reference: Reference | None) -> step.LossFn:
    """The DPO loss on a pair batch; with ``reference`` None the batch carries the reference's
    precomputed log-probs (``ref_chosen_logps``, ``ref_rejected_logps``)."""
    d, vocab = cfg.dpo, cfg.model.vocab_size

    def loss_fn(params, batch, rng):
        pc, pr = sequence_logps(forward, step.model_part(params), batch, vocab, rng)
        if reference is None:
            rc, rr = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        else:
            rc, rr = jax.lax.stop_gradient(reference.logps(params, batch))
        losses, metrics = dpo_loss(pc, pr, rc, rr, beta=d.beta, loss_type=d.loss_type,
                                   label_smoothing=d.label_smoothing,
                                   chosen_len=jnp.sum(batch["chosen_weights"], -1),
                                   rejected_len=jnp.sum(batch["rejected_weights"], -1))
        w = batch["weights"]  # one per pair
        return jnp.sum(losses * w), jnp.sum(w), {k: jnp.sum(v * w) for k, v in metrics.items()}
    return loss_fn


def load_pairs(cfg: Config, section: str = "dpo") -> preference.PreferenceData:
    """The preference pairs of a config section (DPOConfig's, or RewardConfig's: the same fields);
    unusable data as a whole is a ConfigError naming the section's field."""
    d = getattr(cfg, section)
    try:
        data.check_vocab(dataclasses.replace(cfg.data, source="stdlib"), cfg.model.vocab_size)
        tokenizer = data.get_tokenizer(cfg.data.tokenizer)
        return preference.load(d.data, d.eval_data, d.eval_fraction, tokenizer, cfg.train.seq_len, d.normalise)
    except ValueError as err:
        raise ConfigError(f"{cfg.source}: {type(d).__name__}.data: {err}") from None


def load_data(cfg: Config) -> preference.PreferenceData:
    return load_pairs(cfg, "dpo")


def pair_batches(cfg: Config, pairs: preference.PreferenceData, tokenizer: Any,
                 extra_identity: dict) -> tuple[Callable, Callable, Callable]:
    """(train_batches, eval_batches, every held-out batch) of a preference task's pairs on this
    process (DPO's and the reward model's)."""
    tc = cfg.train
    where = dict(process_index=jax.process_index(), process_count=jax.process_count())

    def train_batches():
        return preference.train_iterator(pairs, tokenizer, seq_len=tc.seq_len, global_batch=tc.global_batch,
                                         seed=cfg.data.seed, prefetch=cfg.data.prefetch, **where,
                                         extra_identity=extra_identity)

    def held_out(num_batches):
        return preference.eval_batches(pairs.eval, tokenizer, seq_len=tc.seq_len, global_batch=tc.global_batch,
                                       num_batches=num_batches, **where)

    return train_batches, lambda: held_out(tc.eval_batches), lambda: held_out(None)


def heldout_metrics(loss_fn: step.LossFn, params: Any, batches: list[dict], mesh, batch_spec: dict) -> dict[str, float]:
    """The loss and TRL's metrics, means over the held-out pairs of ``batches``."""
    fn = jax.jit(lambda p, b: loss_fn(p, b, None))
    total: dict[str, float] = {}
    weight = 0.0
    for b in batches:
        loss_sum, w, aux = jax.device_get(fn(params, step.device_batch(b, mesh, batch_spec)))
        weight += float(w)
        for k, v in {"loss": loss_sum, **aux}.items():
            total[k] = total.get(k, 0.0) + float(v)
    return {k: v / max(weight, 1.0) for k, v in total.items()} | {"pairs": weight}


def _with_ref_logps(rows: list[dict], ref: Reference, cfg: Config, mesh, tokenizer) -> None:
    """Each row gets the reference's log-probs of its two sides (``precompute_ref``)."""
    fn = jax.jit(lambda b: ref.logps(None, b))
    n = cfg.train.global_batch
    for start in range(0, len(rows), n):
        part = rows[start:start + n]
        (b,) = preference.eval_batches(part, tokenizer, seq_len=cfg.train.seq_len, global_batch=n, num_batches=None)
        c, r = jax.device_get(fn(step.device_batch(b, mesh, PAIR_BATCH)))
        for i, row in enumerate(part):
            row["ref_chosen_logps"], row["ref_rejected_logps"] = float(c[i]), float(r[i])


def examples_of(pairs: list[preference.Pair]) -> list[Example]:
    """Held-out pairs as SFT examples (prompt + chosen), for ``maxlm.posttrain.sft.exact_match``."""
    return [Example(p.messages("chosen"), p.where) for p in pairs]


def dpo_task(cfg: Config, forward: Callable, mesh=None) -> Task:
    """The Task; ``mesh`` defaults to the one the config's MeshConfig gives (as the loop's)."""
    from maxlm.posttrain import sft

    mesh = mesh or sharding.make_mesh(cfg.mesh.shape(jax.device_count()))
    d = cfg.dpo
    pairs = load_data(cfg)
    tokenizer = data.get_tokenizer(cfg.data.tokenizer)
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    say(pairs.report.summary("preference data"), flush=True)
    if pairs.eval_report is not None:
        say(pairs.eval_report.summary("preference eval data"), flush=True)
    reference = load_reference(cfg, mesh, forward)
    batch_spec = PAIR_BATCH
    if d.precompute_ref:
        if jax.process_count() > 1:
            raise ConfigError(f"{cfg.source}: DPOConfig.precompute_ref runs on one process only; set it False")
        _with_ref_logps(pairs.train, reference, cfg, mesh, tokenizer)
        _with_ref_logps(pairs.eval, reference, cfg, mesh, tokenizer)
        say(f"dpo: reference log-probs of {len(pairs.train) + len(pairs.eval)} pairs precomputed from "
            f"{reference.what}", flush=True)
        reference, batch_spec = None, REF_BATCH
    else:
        say(f"dpo: reference = {reference.what}; beta {d.beta}, loss {d.loss_type}"
            + (f", label smoothing {d.label_smoothing}" if d.label_smoothing else ""), flush=True)
    loss_fn = make_loss(cfg, forward, reference)
    train_batches, eval_batches, all_held_out = pair_batches(cfg, pairs, tokenizer,
                                                             {"DPOConfig.precompute_ref": d.precompute_ref})

    def sample(params) -> str:
        m = heldout_metrics(loss_fn, params, all_held_out(), mesh, batch_spec)
        lines = [f"held-out pairs ({int(m['pairs'])}): loss {m['loss']:.4f}, "
                 + ", ".join(f"{k} {m[k]:.4g}" for k in METRICS)]
        if d.eval_prompts:
            em = sft.exact_match(cfg, step.model_part(params), examples_of(pairs.eval_pairs[:d.eval_prompts]),
                                 tokenizer, d.max_new_tokens)
            lines += [f"{em} (chosen reply)"] + [f"  {p!r} -> {g!r} (wanted {w!r})" for p, w, g in em.rows[:5]]
        return "\n".join(lines)

    return Task("dpo", loss_fn, batch_spec, train_batches, eval_batches, sample=sample)
