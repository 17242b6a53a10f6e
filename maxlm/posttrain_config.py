"""The post-training sections of the configuration (SFT, distillation, DPO, reward models, GRPO) and their checks.

Each task of ``maxlm.posttrain`` reads one section; ``maxlm.config`` puts them in ``Config``, takes
their numeric ranges (``POSTTRAIN_RANGES``) into its table, and calls ``check_posttrain`` from
``validate``. A section's data fields set while another task runs are an error, never silently
ignored (``_unread``). Imports only the standard library and gin at import time; ConfigError and
``_choice`` come from ``maxlm.config`` when a check runs (that module imports this one).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import gin

@gin.configurable
@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning data (TrainConfig.task = "sft"; maxlm/data/sft.py has the stages).
    DataConfig.tokenizer tokenizes it; the chat template is maxlm/data/chat_template.jinja."""

    # JSONL files (globs, ';'-separated) of instruction or chat examples, or synthetic:TASK[:N]
    # (reverse | upper | sort | capitalize, or a mixture a+b: N generated examples of a string transformation).
    data: str = ""
    eval_data: str = ""  # held-out JSONL; "" holds out eval_fraction of data (by a hash of each example)
    eval_fraction: float = 0.05
    format: str = "auto"  # auto | instruction | chat ("auto" decides per line: "messages" means chat)
    min_reply_chars: int = 1  # drop examples with an assistant reply shorter than this (counted)
    normalise: bool = True  # Unicode NFC, control characters, whitespace (maxlm.data.clean)
    quality: str = "none"  # a maxlm.data.quality preset judged on each reply: none | web | books | code
    exact_dedup: bool = True
    near_dedup: bool = False  # MinHash near-duplicates (maxlm.data.dedup)
    near_threshold: float = 0.8
    pii: bool = False  # replace e-mails, phones, IDs ... in every message (maxlm.data.pii)
    packing_bins: int = 8  # rows open at once in first-fit packing (more bins: less padding)
    # Held-out prompts answered greedily at the end of the run (and by tests), scored by exact match
    # of the reply; 0 skips it.
    eval_prompts: int = 64
    max_new_tokens: int = 32  # reply length those answers may reach


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Knowledge distillation (TrainConfig.task = "distill"; maxlm/posttrain/distill.py): the model
    of ModelConfig, the student, learns from a trained teacher on DataConfig's data. The loss is
    logit_weight * (alpha T^2 KL(teacher_T || student_T) + (1 - alpha) CE) + feature_weight * F,
    over the loss-bearing tokens; F matches student hidden states, projected to the teacher's width
    by a trained linear map, to the teacher's at feature_layers. Teacher and student share the
    tokenizer and vocabulary; each has its own size and its own sharding on the run's mesh."""

    # The teacher: a run directory (its newest good checkpoint) or RUN_DIR/checkpoints/STEP; its
    # config.gin gives its ModelConfig. A `maxlm.hf import` directory (config.gin + params/) too.
    teacher: str = ""
    alpha: float = 0.5  # weight of the KL term; 1 - alpha weighs the data's cross-entropy
    temperature: float = 2.0  # both distributions are softened by it; T^2 keeps the KL's gradient scale
    logit_weight: float = 1.0  # 0: feature matching alone (the first stage of the two-stage recipe)
    # "online": the teacher runs inside every step. A directory: the teacher's top_k log-probs per
    # token, computed once per batch and kept there as .npz shards under a fingerprint of teacher,
    # data and top_k (a cache made for another teacher or data is refused); later runs read them.
    teacher_logits: str = "online"
    top_k: int = 64  # cached log-probs per token; the KL is over them, renormalised (exact if >= vocab)
    # Student layer : teacher layer pairs whose outputs are matched, 1-based (layer i's output is
    # Hugging Face's hidden_states[i]), e.g. "2:4,4:8"; "" matches none.
    feature_layers: str = ""
    feature_loss: str = "mse"  # mse (mean over the teacher's width) | cosine (1 - cosine similarity)
    feature_weight: float = 0.0

    def feature_pairs(self) -> list[tuple[int, int]]:
        """feature_layers as (student layer, teacher layer) pairs; ValueError (one line) if malformed."""
        pairs = []
        for part in (p.strip() for p in self.feature_layers.split(",")):
            if not part and not self.feature_layers.strip():
                continue
            m = re.fullmatch(r"(\d+)\s*:\s*(\d+)", part)
            if not m or min(int(m[1]), int(m[2])) < 1:
                raise ValueError(f"entry {part!r} is not STUDENT_LAYER:TEACHER_LAYER with layers counted from 1 "
                                 "(e.g. '2:4,4:8')")
            pair = (int(m[1]), int(m[2]))
            if pair in pairs:
                raise ValueError(f"entry {part!r} is listed twice")
            pairs.append(pair)
        return pairs


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """Direct Preference Optimization (TrainConfig.task = "dpo"; maxlm/posttrain/dpo.py, the data in
    maxlm/data/preference.py): the policy starts from TrainConfig.init_from / init_params (an SFT'd
    model) and the reference is that start, frozen (with ModelConfig.lora_rank > 0: the same weights
    without the adapters, no second copy)."""

    # JSONL files (globs, ';'-separated) of {"prompt", "chosen", "rejected"} (strings or chat message
    # lists), or synthetic:TASK[:N[:KINDS]] (SFT's string tasks: the right answer chosen, a wrong one
    # rejected; KINDS as maxlm/data/preference.py lists them).
    data: str = ""
    eval_data: str = ""  # held-out JSONL; "" holds out eval_fraction of data (by a hash of the prompt)
    eval_fraction: float = 0.05
    normalise: bool = True  # Unicode NFC, control characters, whitespace (maxlm.data.clean)
    beta: float = 0.1  # the KL strength: rewards are beta * (policy - reference) log-prob of a reply
    loss_type: str = "sigmoid"  # sigmoid (DPO) | ipo | robust (as TRL's DPOTrainer defines them)
    label_smoothing: float = 0.0  # the chance a label is flipped (cDPO with sigmoid; robust DPO), in [0, 0.5)
    # Compute the reference's log-probs of every pair once before training (and free its copy);
    # False runs the reference inside every step.
    precompute_ref: bool = False
    # Held-out prompts answered greedily at the end of the run, scored by exact match with the
    # chosen reply; 0 skips it. The held-out reward metrics are printed either way.
    eval_prompts: int = 64
    max_new_tokens: int = 32

@gin.configurable
@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """A reward model (TrainConfig.task = "reward"; maxlm/posttrain/reward.py): the transformer with a
    scalar head, trained with the Bradley-Terry loss on preference pairs (DPOConfig's data format),
    usually from an SFT'd model (TrainConfig.init_from)."""

    # JSONL files (globs, ';'-separated) of {"prompt", "chosen", "rejected"}, or synthetic:TASK[:N[:KINDS]].
    data: str = ""
    eval_data: str = ""  # held-out JSONL; "" holds out eval_fraction of data (by a hash of the prompt)
    eval_fraction: float = 0.05
    normalise: bool = True  # Unicode NFC, control characters, whitespace (maxlm.data.clean)
    # TRL's center_rewards_coefficient: adds c * (r_chosen + r_rejected)^2, keeping rewards near zero.
    center_rewards_coefficient: float = 0.0
    # Where the head reads: "last" (the last reply token's final hidden state, as Hugging Face's
    # LlamaForSequenceClassification) | "mean" (the mean of the head over every reply token).
    pooling: str = "last"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """GRPO, RL from verifiable rewards (TrainConfig.task = "grpo"; maxlm/posttrain/grpo.py, the
    prompts in maxlm/data/prompts.py): the policy starts from TrainConfig.init_from / init_params (an
    SFT'd model), samples group_size completions of each prompt every step, and learns from their
    group-relative advantages with a clipped objective and a KL penalty to its frozen start.
    TrainConfig.global_batch counts completions: global_batch / group_size prompts a step."""

    # JSONL files (globs, ';'-separated) of {"prompt": str | messages, "answer": str}, or synthetic:TASK[:N].
    prompts: str = ""
    eval_fraction: float = 0.05  # held-out prompts (by a hash of the prompt), scored at each evaluation
    eval_prompts: int = 64  # how many of them (greedy replies; 0: none)
    # exact (the reply equals the answer) | contains (the answer is in the reply) | similarity
    # (partial credit: difflib's ratio of matching characters) | python:MODULE:FUNCTION (f(reply, answer) -> float)
    # | model:RUN_DIR (a reward model trained with TrainConfig.task = "reward" scores prompt + reply)
    reward: str = "exact"
    group_size: int = 8  # completions sampled per prompt
    # Divide each group's advantages by its reward std (GRPO, TRL's scale_rewards); False: r - mean (Dr. GRPO).
    scale_rewards: bool = True
    max_new_tokens: int = 16
    temperature: float = 1.0  # sampling of the rollouts (top_k 0 and top_p 1: off)
    top_k: int = 0
    top_p: float = 1.0
    clip_range: float = 0.2  # epsilon of the clipped ratio
    kl_coef: float = 0.04  # beta of the KL penalty to the reference; 0 runs no reference


POSTTRAIN_RANGES: dict[str, tuple[float, float, str]] = {
    "SFTConfig.eval_fraction": (0, 1, "[low, high)"), "SFTConfig.near_threshold": (0, 1, "(low, high]"),
    **{f"SFTConfig.{f}": (0, math.inf, ">= 0") for f in ("min_reply_chars", "eval_prompts")},
    **{f"SFTConfig.{f}": (0, math.inf, "positive") for f in ("packing_bins", "max_new_tokens")},
    "DistillConfig.alpha": (0, 1, "[low, high]"),
    **{f"DistillConfig.{f}": (0, math.inf, "positive") for f in ("temperature", "top_k")},
    **{f"DistillConfig.{f}": (0, math.inf, ">= 0") for f in ("logit_weight", "feature_weight")},
    "DPOConfig.beta": (0, math.inf, "positive"), "DPOConfig.label_smoothing": (0, 0.5, "[low, high)"),
    "DPOConfig.eval_fraction": (0, 1, "[low, high)"),
    **{f"DPOConfig.{f}": (0, math.inf, ">= 0") for f in ("eval_prompts",)},
    **{f"DPOConfig.{f}": (0, math.inf, "positive") for f in ("max_new_tokens",)},
    "RewardConfig.eval_fraction": (0, 1, "[low, high)"),
    "RewardConfig.center_rewards_coefficient": (0, math.inf, ">= 0"),
    "GRPOConfig.eval_fraction": (0, 1, "[low, high)"), "GRPOConfig.top_p": (0, 1, "(low, high]"),
    "GRPOConfig.clip_range": (0, 1, "(low, high]"),
    **{f"GRPOConfig.{f}": (0, math.inf, ">= 0") for f in ("eval_prompts", "top_k", "kl_coef", "temperature")},
    **{f"GRPOConfig.{f}": (0, math.inf, "positive") for f in ("max_new_tokens",)},
    "GRPOConfig.group_size": (2, math.inf, "[low, high)"),
}


def _choice(src: str, field: str, value: str, allowed: tuple[str, ...]) -> None:
    from maxlm.config import _choice as choice

    choice(src, field, value, allowed)


def _unread(cfg: Any, section: str, fields: tuple[str, ...]) -> bool:
    """True when the run's task is not ``section`` (each section is named after the task that reads
    it): then each of ``fields`` must keep its default (a ConfigError names the first that does not)."""
    from maxlm.config import ConfigError

    task = section
    if cfg.train.task == task:
        return False
    values = getattr(cfg, section)
    defaults = {f.name: f.default for f in dataclasses.fields(values)}
    for field in fields:
        if getattr(values, field) != defaults[field]:
            raise ConfigError(f"{cfg.source}: {type(values).__name__}.{field} = {getattr(values, field)!r} is set, "
                              f"but TrainConfig.task = {cfg.train.task!r} does not read it (set TrainConfig.task = "
                              f"{task!r})")
    return True


def _check_sft(cfg: Any) -> None:
    from maxlm.config import ConfigError

    src, sft = cfg.source, cfg.sft
    _choice(src, "SFTConfig.format", sft.format, ("auto", "instruction", "chat"))
    _choice(src, "SFTConfig.quality", sft.quality, ("none", "web", "books", "code"))
    if _unread(cfg, "sft", ("data", "eval_data")):
        return
    if not sft.data.strip():
        raise ConfigError(f"{src}: TrainConfig.task = 'sft' needs SFTConfig.data (JSONL files, or "
                          "synthetic:reverse for a generated task)")
    if not sft.eval_data and sft.eval_fraction == 0 and sft.eval_prompts:
        raise ConfigError(f"{src}: SFTConfig.eval_prompts = {sft.eval_prompts} needs held-out examples: "
                          "set SFTConfig.eval_data or SFTConfig.eval_fraction > 0 (or eval_prompts = 0)")
    if sft.max_new_tokens >= cfg.model.max_seq_len:
        raise ConfigError(f"{src}: SFTConfig.max_new_tokens = {sft.max_new_tokens} must be below "
                          f"ModelConfig.max_seq_len = {cfg.model.max_seq_len}")


def _check_distill(cfg: Any) -> None:
    """DistillConfig complete and consistent for TrainConfig.task = "distill", unset otherwise (the
    teacher's files are read when the run starts: its layers, width and vocabulary are checked then)."""
    from maxlm.config import ConfigError

    src, d = cfg.source, cfg.distill
    _choice(src, "DistillConfig.feature_loss", d.feature_loss, ("mse", "cosine"))
    try:
        pairs = d.feature_pairs()
    except ValueError as err:
        raise ConfigError(f"{src}: DistillConfig.feature_layers = {d.feature_layers!r}: {err}") from None
    if _unread(cfg, "distill", ("teacher", "teacher_logits", "feature_layers")):
        return
    if not d.teacher.strip():
        raise ConfigError(f"{src}: TrainConfig.task = 'distill' needs DistillConfig.teacher (the run directory "
                          "of a trained teacher)")
    for field in ("teacher", "teacher_logits"):
        value = getattr(d, field)
        if value != value.strip() or not value:
            raise ConfigError(f"{src}: DistillConfig.{field} = {value!r} is empty or has leading or trailing spaces")
    for s, _ in pairs:
        if s > cfg.model.n_layers:
            raise ConfigError(f"{src}: DistillConfig.feature_layers = {d.feature_layers!r} names student layer {s}, "
                              f"but the student has ModelConfig.n_layers = {cfg.model.n_layers}")
    if pairs and not d.feature_weight:
        raise ConfigError(f"{src}: DistillConfig.feature_layers = {d.feature_layers!r} is set but "
                          "DistillConfig.feature_weight = 0 (give it a weight, or clear feature_layers)")
    if d.feature_weight and not pairs:
        raise ConfigError(f"{src}: DistillConfig.feature_weight = {d.feature_weight} needs "
                          "DistillConfig.feature_layers (e.g. '2:4,4:8': student layer:teacher layer)")
    if not d.logit_weight and not d.feature_weight:
        raise ConfigError(f"{src}: DistillConfig.logit_weight = 0 and DistillConfig.feature_weight = 0: "
                          "nothing to learn")
    if pairs and d.teacher_logits != "online":
        raise ConfigError(f"{src}: DistillConfig.feature_layers needs the teacher's hidden states, which are not "
                          f"cached: set DistillConfig.teacher_logits = 'online' (it is {d.teacher_logits!r})")
    if pairs and cfg.mesh.pipeline > 1:
        raise ConfigError(f"{src}: DistillConfig.feature_layers needs the student's hidden states, which the "
                          f"pipeline does not collect: use MeshConfig.pipeline = 1 (it is {cfg.mesh.pipeline})")


def _check_dpo(cfg: Any) -> None:
    """DPOConfig complete and consistent for TrainConfig.task = "dpo", its data unset otherwise."""
    from maxlm.config import ConfigError

    src, d = cfg.source, cfg.dpo
    _choice(src, "DPOConfig.loss_type", d.loss_type, ("sigmoid", "ipo", "robust"))
    if _unread(cfg, "dpo", ("data", "eval_data")):
        return
    if not d.data.strip():
        raise ConfigError(f"{src}: TrainConfig.task = 'dpo' needs DPOConfig.data (JSONL files of prompt/chosen/"
                          "rejected, or synthetic:upper for a generated task)")
    if d.label_smoothing and d.loss_type == "ipo":
        raise ConfigError(f"{src}: DPOConfig.label_smoothing = {d.label_smoothing} has no meaning for "
                          "DPOConfig.loss_type = 'ipo' (use 'sigmoid' or 'robust')")
    if not d.eval_data and d.eval_fraction == 0 and d.eval_prompts:
        raise ConfigError(f"{src}: DPOConfig.eval_prompts = {d.eval_prompts} needs held-out pairs: set "
                          "DPOConfig.eval_data or DPOConfig.eval_fraction > 0 (or eval_prompts = 0)")
    if d.max_new_tokens >= cfg.model.max_seq_len:
        raise ConfigError(f"{src}: DPOConfig.max_new_tokens = {d.max_new_tokens} must be below "
                          f"ModelConfig.max_seq_len = {cfg.model.max_seq_len}")
    if d.precompute_ref and cfg.model.lora_rank:
        raise ConfigError(f"{src}: DPOConfig.precompute_ref with ModelConfig.lora_rank = {cfg.model.lora_rank}: the "
                          "reference is the base without adapters, computed in the step at no extra memory; set "
                          "precompute_ref = False")


def _check_reward(cfg: Any) -> None:
    """RewardConfig complete for TrainConfig.task = "reward", its data unset otherwise."""
    from maxlm.config import ConfigError

    src, r = cfg.source, cfg.reward
    _choice(src, "RewardConfig.pooling", r.pooling, ("last", "mean"))
    if _unread(cfg, "reward", ("data", "eval_data")):
        return
    if not r.data.strip():
        raise ConfigError(f"{src}: TrainConfig.task = 'reward' needs RewardConfig.data (JSONL files of prompt/chosen/"
                          "rejected, or synthetic:upper for a generated task)")
    if not r.eval_data and r.eval_fraction == 0:
        raise ConfigError(f"{src}: a reward model is judged on held-out pairs: set RewardConfig.eval_data or "
                          "RewardConfig.eval_fraction > 0")
    if cfg.mesh.pipeline > 1:
        raise ConfigError(f"{src}: TrainConfig.task = 'reward' reads the final hidden states, which the pipeline "
                          f"does not collect: use MeshConfig.pipeline = 1 (it is {cfg.mesh.pipeline})")


def _check_grpo(cfg: Any) -> None:
    """GRPOConfig complete and consistent for TrainConfig.task = "grpo", its prompts unset otherwise."""
    from maxlm.config import ConfigError

    src, g = cfg.source, cfg.grpo
    if not (g.reward in ("exact", "contains", "similarity") or g.reward.startswith(("python:", "model:"))):
        raise ConfigError(f"{src}: GRPOConfig.reward = {g.reward!r} is not exact, contains, similarity, "
                          "python:MODULE:FUNCTION or model:RUN_DIR")
    if _unread(cfg, "grpo", ("prompts",)):
        return
    if not g.prompts.strip():
        raise ConfigError(f"{src}: TrainConfig.task = 'grpo' needs GRPOConfig.prompts (JSONL files of prompt/answer, "
                          "or synthetic:upper for a generated task)")
    if cfg.train.global_batch % g.group_size:
        raise ConfigError(f"{src}: TrainConfig.global_batch = {cfg.train.global_batch} counts completions and must "
                          f"divide by GRPOConfig.group_size = {g.group_size}")
    if g.max_new_tokens >= cfg.train.seq_len:
        raise ConfigError(f"{src}: GRPOConfig.max_new_tokens = {g.max_new_tokens} must be below TrainConfig.seq_len = "
                          f"{cfg.train.seq_len} (a prompt and its completion share a row)")
    if g.temperature == 0:
        raise ConfigError(f"{src}: GRPOConfig.temperature = 0 samples every completion of a group alike (greedy): "
                          "nothing to compare; use a positive temperature (1.0)")


def check_posttrain(cfg: Any) -> None:
    """Every post-training section complete for its task and its data unset for the others."""
    _check_sft(cfg)
    _check_distill(cfg)
    _check_dpo(cfg)
    _check_reward(cfg)
    _check_grpo(cfg)
