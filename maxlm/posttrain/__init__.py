"""Post-training: tasks the shared loop (``maxlm.train.loop``) runs on a base model. SFT is
``sft``, distillation ``distill``, DPO ``dpo``, reward models ``reward`` and GRPO ``grpo``. ``build_task(cfg, forward)`` picks the
task ``TrainConfig.task`` names; ``python -m maxlm.train`` and ``python -m maxlm.sft`` call it.
Imports every level below (data, infer, train), never hf, plan or serve beside it.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["build_task"]


def build_task(cfg: Any, forward: Callable):
    """The post-training Task ``cfg.train.task`` names (pre-training is maxlm.train.tasks')."""
    if cfg.train.task == "sft":
        from maxlm.posttrain import sft
        return sft.sft_task(cfg, forward)
    if cfg.train.task == "distill":
        from maxlm.posttrain import distill
        return distill.distill_task(cfg, forward)
    if cfg.train.task == "dpo":
        from maxlm.posttrain import dpo
        return dpo.dpo_task(cfg, forward)
    if cfg.train.task == "reward":
        from maxlm.posttrain import reward
        return reward.reward_task(cfg, forward)
    if cfg.train.task == "grpo":
        from maxlm.posttrain import grpo
        return grpo.grpo_task(cfg, forward)
    raise ValueError(f"TrainConfig.task = {cfg.train.task!r} is not a post-training task")
