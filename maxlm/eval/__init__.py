"""Evaluation: held-out perplexity, multiple choice, generation, human rating. ``python -m maxlm.eval``.

``tasks`` parses task files and names, ``loglikelihood`` scores (context, continuation) pairs in
padded batches as lm-evaluation-harness does, ``perplexity``, ``multiple_choice`` and ``generation``
compute each kind's metrics, ``human`` writes rating sheets and measures inter-rater agreement,
``cli`` is the command line. ``Evaluator`` runs tasks on one model; the training loop builds one
with ``Evaluator.for_training`` for ``TrainConfig.eval_tasks``. Imports ``maxlm.model``,
``maxlm.data`` and ``maxlm.infer``.
"""

from __future__ import annotations

import importlib
from typing import Any

# Task parsing is light; everything that imports jax loads on first use.
from maxlm.eval.tasks import Task, TaskError, check_spec, load_task, load_tasks, split_list

_LAZY = {"Evaluator": "evaluator", "LOGGED": "evaluator", "Scorer": "loglikelihood", "encode_pair": "loglikelihood",
         "agreement": "human", "cohen_kappa": "human", "fleiss_kappa": "human"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"maxlm.eval.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'maxlm.eval' has no attribute {name!r}")


__all__ = ["LOGGED", "Evaluator", "Scorer", "Task", "TaskError", "agreement", "check_spec", "cohen_kappa",
           "encode_pair", "fleiss_kappa", "load_task", "load_tasks", "split_list"]
