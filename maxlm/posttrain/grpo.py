"""GRPO as a task of the shared loop: RL from verifiable rewards with group-relative advantages
(Shao et al., DeepSeekMath; TRL's ``GRPOTrainer`` with its defaults: one update per rollout).

Each step the loop draws ``prompts_per_step`` = TrainConfig.global_batch / ``group_size`` prompts
(``maxlm.data.prompts``, checkpointable), and the task's ``rollout`` samples ``group_size``
completions of each from the current policy with ``maxlm.infer.generate`` (the KV-cache sampler;
temperature, top-k, top-p), seeded by the step so a resumed run samples the same. A verifier scores
each completion against the prompt's answer (``GRPOConfig.reward``: ``exact`` match of the reply,
``contains``, ``similarity`` (partial credit: difflib's ratio of matching characters),
``python:MODULE:FUNCTION`` called as f(reply, answer) -> float, or ``model:RUN_DIR``, a reward model
trained with ``maxlm.reward``, scoring each prompt with its reply). Within a group the
advantage is A_i = (r_i - mean(r)) / (std(r) + 1e-4) (``scale_rewards``; without it r_i - mean(r),
as Dr. GRPO: a group whose rewards barely differ then teaches little instead of as much as any). The loss per completion o_i, over its tokens t
(with ratio_t = pi(o_t) / pi_old(o_t), pi_old the policy that sampled, equal to pi in value with one
update per rollout, so only its gradient acts), is GRPO's:

    (1 / |o_i|) sum_t [ -min(ratio_t A_i, clip(ratio_t, 1 - eps, 1 + eps) A_i) + beta KL_t ]
    KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (the k3 estimator, >= 0)

averaged over completions (the step's weight is one per row). The reference is the run's start,
frozen (``dpo.load_reference``: a copy, or the base without LoRA adapters); with beta = 0 it is not
run. Logged per completion: ``reward`` (mean), ``reward_std`` (the mean of the groups' standard
deviations), ``kl``, ``clip_fraction`` and ``completion_length``; each evaluation logs the held-out
prompts' mean reward of greedy replies (``eval/reward``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import zlib
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxlm import data
from maxlm.config import Config, ConfigError
from maxlm.data import chat, prompts as prompt_data
from maxlm.parallel import sharding
from maxlm.posttrain.dpo import load_reference, token_logps
from maxlm.train import step
from maxlm.train.tasks import TOKENS, Task

ROW = ("batch",)
GRPO_BATCH = {"inputs": TOKENS, "targets": TOKENS, "segment_ids": TOKENS, "positions": TOKENS, "weights": TOKENS,
              "advantages": ROW, "rewards": ROW, "reward_std": ROW, "rows": ROW}
METRICS = ("reward", "reward_std", "kl", "clip_fraction", "completion_length")


# ---- rewards and advantages (host side)


def verifier(spec: str) -> Callable[[str, str], float]:
    """The reward function GRPOConfig.reward names; a ConfigError (one line) if it cannot be had."""
    if spec == "exact":
        return lambda reply, answer: float(reply.strip() == answer.strip())
    if spec == "contains":
        return lambda reply, answer: float(answer.strip() in reply)
    if spec == "similarity":  # partial credit: difflib's ratio, 2 * matching characters / total
        return lambda reply, answer: difflib.SequenceMatcher(None, reply.strip(), answer.strip()).ratio()
    if spec.startswith("python:"):
        try:
            module, name = spec.removeprefix("python:").rsplit(":", 1)
            fn = getattr(importlib.import_module(module), name)
        except (ValueError, ImportError, AttributeError) as err:
            raise ConfigError(f"GRPOConfig.reward = {spec!r}: cannot import it ({err}); expected "
                              "python:MODULE:FUNCTION") from None
        return lambda reply, answer: float(fn(reply, answer))
    raise ConfigError(f"GRPOConfig.reward = {spec!r} is not exact, contains, similarity, python:MODULE:FUNCTION "
                      "or model:RUN_DIR")


def load_reward_model(cfg: Config, spec: str) -> Any:
    """``reward.Scorer`` of the reward run ``model:RUN_DIR`` names (its newest good checkpoint, on one
    device); a ConfigError (one line) when it is not one."""
    from maxlm import config as config_lib, model
    from maxlm.posttrain import reward
    from maxlm.train import checkpoint, loop

    run = Path(spec.removeprefix("model:")).expanduser().resolve()
    where = f"{cfg.source}: GRPOConfig.reward = {spec!r}"
    if not (run / "config.gin").is_file():
        raise ConfigError(f"{where}: {run / 'config.gin'} is missing (expected the run directory of a reward model)")
    try:
        run_cfg = config_lib.load(str(run / "config.gin"))
    except ConfigError as err:
        raise ConfigError(f"{where}: {' '.join(str(err).split())}") from None
    if run_cfg.train.task != "reward":
        raise ConfigError(f"{where}: that run trained TrainConfig.task = {run_cfg.train.task!r}, not a reward model")
    step_dir = loop.warm_start_dir(run_cfg.replace(train={"init_from": str(run)}))
    model_cfg = dataclasses.replace(run_cfg.model, remat="none")
    abstract = model.abstract_params(model_cfg)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = checkpoint.restore_state_params(step_dir, abstract, jax.tree.map(lambda _: one, abstract))
    head, pooling = reward.read_head(step_dir, model_cfg, run_cfg)
    return reward.Scorer(model_cfg, params, data.get_tokenizer(run_cfg.data.tokenizer), head, pooling=pooling)


def reward_function(cfg: Config) -> Callable[[list[prompt_data.Prompt], list[str]], np.ndarray]:
    """(prompts, replies) -> rewards [n]: the verifier GRPOConfig.reward names on each reply and its
    prompt's answer, or a reward model (``model:RUN_DIR``) on each conversation."""
    spec = cfg.grpo.reward
    if spec.startswith("model:"):
        scorer = load_reward_model(cfg, spec)
        return lambda prompts, replies: scorer([p.messages + [{"role": "assistant", "content": r}]
                                                for p, r in zip(prompts, replies)]).astype(np.float32)
    fn = verifier(spec)
    return lambda prompts, replies: np.array([fn(r, p.answer) for p, r in zip(prompts, replies)], np.float32)


def group_advantages(rewards: np.ndarray, group_size: int, scale: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, each row's group std) for rewards [prompts * group_size], groups contiguous;
    ``scale`` divides by the group's std (GRPO's; without it, Dr. GRPO's r - mean)."""
    r = rewards.reshape(-1, group_size).astype(np.float64)
    std = r.std(axis=1, ddof=1, keepdims=True) if group_size > 1 else np.zeros_like(r[:, :1])
    adv = r - r.mean(axis=1, keepdims=True)
    if scale:
        adv = adv / (std + 1e-4)
    return adv.reshape(-1).astype(np.float32), np.broadcast_to(std, r.shape).reshape(-1).astype(np.float32)


# ---- the loss (what the tests compare with numpy)


def grpo_loss(logps: jax.Array, old_logps: jax.Array, ref_logps: jax.Array | None, advantages: jax.Array,
              weights: jax.Array, *, clip: float, beta: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss per completion, {metric: value per completion}) from token log-probs [B, T] of the
    policy, the sampling policy and the reference (None when beta = 0), advantages [B] and the
    completion tokens' weights [B, T]."""
    ratio = jnp.exp(logps - old_logps)
    a = advantages[:, None]
    clipped_ratio = jnp.clip(ratio, 1 - clip, 1 + clip)
    per_token = -jnp.minimum(ratio * a, clipped_ratio * a)
    n = jnp.maximum(jnp.sum(weights, -1), 1.0)
    if ref_logps is not None:
        diff = ref_logps - logps
        kl = jnp.exp(diff) - diff - 1
        per_token = per_token + beta * kl
        kl_row = jax.lax.stop_gradient(jnp.sum(kl * weights, -1) / n)
    else:
        kl_row = jnp.zeros(logps.shape[:1])
    clipped = ((ratio < 1 - clip) & (a < 0)) | ((ratio > 1 + clip) & (a > 0))
    losses = jnp.sum(per_token * weights, -1) / n
    return losses, {"kl": kl_row, "clip_fraction": jnp.sum(clipped * weights, -1) / n,
                    "completion_length": jnp.sum(weights, -1)}


def make_loss(cfg: Config, forward: Callable, reference: Any) -> step.LossFn:
    g, vocab = cfg.grpo, cfg.model.vocab_size

    def loss_fn(params, batch, rng):
        args = (batch["inputs"], batch["segment_ids"], batch["positions"])
        logits, _ = forward(step.model_part(params), *args, dropout_rng=rng)
        logps = token_logps(logits, batch["targets"], vocab)
        ref = None
        if reference is not None:
            ref = jax.lax.stop_gradient(token_logps(reference.forward(params, *args), batch["targets"], vocab))
        losses, metrics = grpo_loss(logps, jax.lax.stop_gradient(logps), ref, batch["advantages"], batch["weights"],
                                    clip=g.clip_range, beta=g.kl_coef)
        metrics = {**metrics, "reward": batch["rewards"], "reward_std": batch["reward_std"]}
        w = batch["rows"]  # one per completion: the loss and metrics are means over completions
        return jnp.sum(losses * w), jnp.sum(w), {k: jnp.sum(v * w) for k, v in metrics.items()}
    return loss_fn


# ---- rollouts


def training_rows(prompt_ids: list[np.ndarray], completions: list[np.ndarray], seq_len: int,
                  pad_id: int) -> dict[str, np.ndarray]:
    """Prompt + completion as padded rows: each row's weights cover exactly its completion's tokens
    (the eos that ended it included), one segment, positions from 0."""
    n = len(prompt_ids)
    out = {k: np.full((n, seq_len), pad_id if k in ("inputs", "targets") else 0,
                      np.float32 if k == "weights" else np.int32) for k in ("inputs", "targets", "segment_ids", "weights")}
    out["positions"] = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (n, seq_len)).copy()
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        full = np.concatenate([p, c]).astype(np.int32)[:seq_len + 1]
        m = full.size - 1
        out["inputs"][i, :m], out["targets"][i, :m], out["segment_ids"][i, :m] = full[:-1], full[1:], 1
        out["weights"][i, p.size - 1:m] = 1.0
    return out


class Rollout:
    """``rollout(params, {"index": [P]}, step)`` -> a GRPO_BATCH of P * group_size completions."""

    def __init__(self, cfg: Config, pdata: prompt_data.PromptData, tokenizer: Any):
        self.cfg, self.data, self.tokenizer = cfg, pdata, tokenizer
        self.reward = reward_function(cfg)
        self._held: tuple | None = None  # (a leaf of the parameters, held-out prompts, replies, rewards)

    def sample(self, params: Any, prompts: list[prompt_data.Prompt], n: int, seed: int,
               greedy: bool = False) -> tuple[list[np.ndarray], list[str], np.ndarray]:
        """(completion tokens, replies, rewards) of ``n`` samples of each prompt (groups contiguous)."""
        from maxlm.infer import generate
        from maxlm.infer.sampling import SamplingParams

        g = self.cfg.grpo
        sampling = SamplingParams() if greedy else SamplingParams(g.temperature, g.top_k, g.top_p)
        ids = [p.ids for p in prompts for _ in range(n)]
        out = generate.run(self.cfg.model, step.model_part(params), ids, g.max_new_tokens, sampling=sampling,
                           stop_tokens=[self.tokenizer.eos_id], tokenizer=self.tokenizer, seed=seed)
        replies = [chat.read_reply(t) for t in out.texts]
        return out.tokens, replies, self.reward([p for p in prompts for _ in range(n)], replies)

    def __call__(self, params: Any, batch: dict[str, np.ndarray], at_step: int) -> dict[str, np.ndarray]:
        g, tc = self.cfg.grpo, self.cfg.train
        prompts = [self.data.train[int(i)] for i in np.asarray(batch["index"])]
        seed = zlib.crc32(f"grpo/{tc.seed}/{at_step}".encode())  # a function of the step: resumes repeat it
        completions, _, rewards = self.sample(params, prompts, g.group_size, seed)
        advantages, std = group_advantages(rewards, g.group_size, g.scale_rewards)
        rows = training_rows([p.ids for p in prompts for _ in range(g.group_size)], completions, tc.seq_len,
                             self.tokenizer.pad_id)
        return {**rows, "advantages": advantages, "rewards": rewards, "reward_std": std,
                "rows": np.ones(rewards.size, np.float32)}

    def heldout(self, params: Any) -> tuple[list[prompt_data.Prompt], list[str], np.ndarray]:
        """(prompts, greedy replies, rewards) of the held-out prompts (``GRPOConfig.eval_prompts`` of
        them). The run's last evaluation and its closing sample ask for the same parameters: the
        answer for the newest parameters is kept, so they are generated once."""
        leaf = jax.tree.leaves(params)[0]
        if self._held is None or self._held[0] is not leaf:
            held = self.data.eval[:self.cfg.grpo.eval_prompts]
            _, replies, rewards = self.sample(params, held, 1, 0, greedy=True) if held else ([], [], np.zeros(0))
            self._held = (leaf, held, replies, rewards)
        return self._held[1:]


def load_data(cfg: Config) -> prompt_data.PromptData:
    g = cfg.grpo
    try:
        data.check_vocab(dataclasses.replace(cfg.data, source="stdlib"), cfg.model.vocab_size)
        tokenizer = data.get_tokenizer(cfg.data.tokenizer)
        return prompt_data.load(g.prompts, g.eval_fraction, tokenizer, cfg.train.seq_len, g.max_new_tokens)
    except ValueError as err:
        raise ConfigError(f"{cfg.source}: GRPOConfig.prompts: {err}") from None


def grpo_task(cfg: Config, forward: Callable, mesh=None) -> Task:
    """The Task; ``mesh`` defaults to the one the config's MeshConfig gives (as the loop's)."""
    mesh = mesh or sharding.make_mesh(cfg.mesh.shape(jax.device_count()))
    if jax.process_count() > 1:
        raise ConfigError(f"{cfg.source}: TrainConfig.task = 'grpo' samples its rollouts on one process; "
                          f"run it with one process (it has {jax.process_count()})")
    g, tc = cfg.grpo, cfg.train
    pdata = load_data(cfg)
    tokenizer = data.get_tokenizer(cfg.data.tokenizer)
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    say(pdata.report.summary("GRPO prompts") + f"; {len(pdata.train)} train, {len(pdata.eval)} held out", flush=True)
    reference = load_reference(cfg, mesh, forward, "GRPO") if g.kl_coef > 0 else None
    say(f"grpo: {tc.global_batch // g.group_size} prompts x {g.group_size} completions a step, reward "
        f"{g.reward!r}, clip {g.clip_range}, KL coefficient {g.kl_coef}"
        + (f" to {reference.what}" if reference is not None else " (no reference)"), flush=True)
    rollout = Rollout(cfg, pdata, tokenizer)  # samples on the parameters' own mesh

    def train_batches():
        return prompt_data.index_iterator(pdata, prompts_per_step=tc.global_batch // g.group_size,
                                          seed=cfg.data.seed)

    def eval_metrics(params) -> dict[str, float]:
        return {"reward": float(rollout.heldout(params)[2].mean())} if pdata.eval[:g.eval_prompts] else {}

    def sample(params) -> str:
        held, replies, rewards = rollout.heldout(params)
        if not held:
            return "no held-out prompts (GRPOConfig.eval_fraction = 0 or eval_prompts = 0)"
        lines = [f"held-out prompts ({len(held)}): mean reward of greedy replies {rewards.mean():.3f}"]
        for p, reply in list(zip(held, replies))[:5]:
            lines.append(f"  {p.messages[-1]['content']!r} -> {reply!r} (answer {p.answer!r})")
        return "\n".join(lines)

    return Task("grpo", make_loss(cfg, forward, reference), GRPO_BATCH, train_batches, lambda: [],
                sample=sample, weight_key="rows", rollout=rollout, eval_metrics=eval_metrics)
