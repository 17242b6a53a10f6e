"""Training: the pure step for any task (``step``), the reusable loop (``loop``), tasks (``tasks``:
pre-training's cross-entropy; SFT, DPO and distillation add theirs), optimizers (``optim``),
checkpoints (``checkpoint``), the bad-step guard, rollback, preemption and goodput
(``resilience``), and run records (``metrics``). ``python -m maxlm.train`` pre-trains
(``pretrain``). Imports the model, parallel, data and infer packages, never the ones above it.
"""

from maxlm.train.pretrain import main, train
from maxlm.train.resilience import TrainingError

__all__ = ["TrainingError", "main", "train"]
