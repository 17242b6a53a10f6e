"""``Evaluator``: runs tasks of every kind on one model, for the command line and the training loop."""

from __future__ import annotations

import time
from typing import Any

from maxlm.eval import generation, multiple_choice, perplexity
from maxlm.eval.loglikelihood import Scorer
from maxlm.eval.tasks import Task, TaskError, load_tasks, split_list

# What the training loop logs of each kind (the JSON results hold everything).
LOGGED = {"perplexity": ("perplexity", "bits_per_byte"), "multiple_choice": ("acc", "acc_norm"),
          "generation": ("exact_match",)}


class Evaluator:
    """Runs tasks on one model. ``forward`` and ``mesh`` as for ``Scorer``; ``batch_size`` rows per
    forward (and prompts per generate call)."""

    def __init__(self, cfg: Any, params: Any, tokenizer: Any, *, batch_size: int = 8, forward: Any = None,
                 mesh: Any = None, run_config: Any = None, shots: int = 0, limit: int | None = None,
                 new_tokens: int = generation.DEFAULT_NEW_TOKENS, max_chars: int | None = None):
        self.cfg, self.tokenizer, self.run_config, self.max_chars = cfg, tokenizer, run_config, max_chars
        self.batch_size, self.mesh, self.shots, self.limit, self.new_tokens = batch_size, mesh, shots, limit, new_tokens
        self.scorer = Scorer(cfg, params, batch_size=batch_size, forward=forward, mesh=mesh)

    @classmethod
    def for_training(cls, cfg: Any, mesh: Any, forward: Any) -> tuple[Evaluator, list[Task]]:
        """The evaluator and tasks of ``TrainConfig.eval_tasks`` (task files are read here, at start)."""
        from maxlm.data import get_tokenizer

        tasks = load_tasks(split_list(cfg.train.eval_tasks))
        for task in tasks:
            if task.kind == "prompts":
                raise TaskError(f"{task.path} holds prompts only ({{prompt}} lines), which have no score")
        # The batch must split over the mesh's batch axes (and pipeline microbatches) as a training
        # microbatch does.
        tc = cfg.train
        batch = tc.global_batch // cfg.optim.microbatches
        # Perplexity scores about as much text per eval as the eval loss does (the stdlib's held-out
        # split alone is megabytes).
        return cls(cfg.model, None, get_tokenizer(cfg.data.tokenizer), batch_size=batch, forward=forward,
                   mesh=mesh, run_config=cfg, max_chars=tc.eval_batches * tc.global_batch * tc.seq_len), tasks

    def run(self, task: Task, params: Any = None) -> dict[str, Any]:
        """{"task", "kind", "metrics", "samples", "seconds"} of one task."""
        if params is not None:
            self.scorer.with_params(params)
        start = time.perf_counter()
        try:
            if task.kind == "perplexity":
                out = perplexity.evaluate(task, self.scorer, self.tokenizer, run_config=self.run_config,
                                          limit=self.limit, max_chars=self.max_chars)
            elif task.kind == "multiple_choice":
                out = multiple_choice.evaluate(task, self.scorer, self.tokenizer, shots=self.shots, limit=self.limit)
            elif task.kind == "generation":
                out = generation.evaluate(task, self.cfg, self.scorer.params, self.tokenizer, shots=self.shots,
                                          limit=self.limit, batch_size=self.batch_size,
                                          new_tokens=self.new_tokens, mesh=self.mesh)
            else:
                raise TaskError(f"{task.path or task.name}: holds prompts only ({{prompt}} lines), which "
                                "have no score: use it with --human-sheet")
        except ValueError as err:
            if isinstance(err, TaskError):
                raise
            raise TaskError(f"{task.path or task.name}: {err}") from None
        return {"task": task.name, "kind": task.kind, **out, "seconds": time.perf_counter() - start}

    def logged(self, tasks: list[Task], params: Any) -> dict[str, float]:
        """``{"eval/<task>/<metric>": value}`` for the training loop's metrics."""
        out = {}
        for task in tasks:
            result = self.run(task, params)
            for key in LOGGED[task.kind]:
                out[f"eval/{task.name}/{key}"] = result["metrics"][key]
        return out
