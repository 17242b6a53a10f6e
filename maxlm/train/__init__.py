"""Training: the pure step for any task (``step``), the reusable loop (``loop``), tasks (``tasks``:
pre-training's cross-entropy; SFT, DPO and distillation add theirs), optimizers (``optim``),
checkpoints (``checkpoint``), the bad-step guard, rollback, preemption and goodput
(``resilience``), and run records (``metrics``). ``python -m maxlm.train`` pre-trains
(``pretrain``). Imports the model, parallel, data and infer packages, never the ones above it.
"""


__all__ = ["TrainingError", "main", "train"]


def __getattr__(name: str):
    # Lazy, so that `python -m maxlm.train` can re-execute itself (maxlm.train.allocator) before
    # anything imports jax.
    if name in ("main", "train"):
        from maxlm.train import pretrain
        return getattr(pretrain, name)
    if name == "TrainingError":
        from maxlm.train.resilience import TrainingError
        return TrainingError
    raise AttributeError(f"module 'maxlm.train' has no attribute {name!r}")
