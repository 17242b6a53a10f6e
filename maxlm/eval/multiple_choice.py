"""Multiple-choice tasks (MMLU / C-Eval / ARC style), scored as lm-evaluation-harness scores them.

Each choice is a continuation of the prompt, and the prediction is the choice of highest summed
log-likelihood; nothing is generated (string-matching one generated letter is a different and
noisier measure). The prompt is lm-eval's default layout for a task with ``doc_to_text: question``,
``doc_to_choice: choices``, ``target_delimiter: " "`` and ``fewshot_delimiter: "\\n\\n"``:

    context      = shot_1.question + " " + shot_1.choices[answer] + "\\n\\n" + ... + question
    continuation = " " + choice

so write a question as the model should see it (e.g. ending "Answer:"). The k shots are the
first k questions of the same file other than the one asked (lm-eval's ``first_n`` sampler with
the few-shot split equal to the test split); ``--limit`` shortens the questions asked, not the pool.

Metrics: ``acc`` (argmax of the log-likelihoods), ``acc_norm`` (argmax of log-likelihood divided
by the choice's length in characters, which is lm-eval 0.4's definition; the target delimiter is
not counted) and ``acc_bytes`` (divided by its UTF-8 length), each with its standard error.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from maxlm.eval.loglikelihood import Scorer
from maxlm.eval.tasks import MCDoc, Task

TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"


def shots_for(doc: MCDoc, pool: tuple[MCDoc, ...], k: int) -> list[MCDoc]:
    if k <= 0:
        return []
    others = [d for d in pool if d != doc]
    if len(others) < k:
        raise ValueError(f"--shots {k} needs {k} other questions in the task file, which has {len(others)}")
    return others[:k]


def context(doc: MCDoc, shots: list[MCDoc]) -> str:
    prefix = "".join(s.question + TARGET_DELIMITER + s.choices[s.answer] + FEWSHOT_DELIMITER for s in shots)
    return prefix + doc.question


def stderr(values: list[float]) -> float:
    """Standard error of a mean (sample standard deviation / sqrt(n)), as lm-eval reports it."""
    if len(values) < 2:
        return float("nan")
    return float(np.std(values, ddof=1) / math.sqrt(len(values)))


def evaluate(task: Task, scorer: Scorer, tokenizer: Any, *, shots: int = 0,
             limit: int | None = None) -> dict[str, Any]:
    asked = task.docs[:limit] if limit else task.docs
    requests, contexts = [], []
    for i, doc in enumerate(asked):
        ctx = context(doc, shots_for(doc, task.docs, shots))
        contexts.append(ctx)
        for choice in doc.choices:
            requests.append((ctx, TARGET_DELIMITER + choice))
    scored = scorer.pairs(tokenizer, requests)
    samples, at = [], 0
    for i, (doc, ctx) in enumerate(zip(asked, contexts)):
        lls = np.array([ll for ll, _ in scored[at:at + len(doc.choices)]])
        greedy = [g for _, g in scored[at:at + len(doc.choices)]]
        at += len(doc.choices)
        chars = np.array([len(c) for c in doc.choices], float)
        n_bytes = np.array([len(c.encode("utf-8")) for c in doc.choices], float)
        pred, pred_norm, pred_bytes = (int(np.argmax(x)) for x in (lls, lls / chars, lls / n_bytes))
        samples.append({"index": i, "context": ctx, "choices": list(doc.choices), "gold": doc.answer,
                        "loglikelihoods": lls.tolist(), "is_greedy": greedy, "pred": pred,
                        "pred_norm": pred_norm, "acc": float(pred == doc.answer),
                        "acc_norm": float(pred_norm == doc.answer), "acc_bytes": float(pred_bytes == doc.answer)})
    metrics: dict[str, float] = {}
    for key in ("acc", "acc_norm", "acc_bytes"):
        values = [s[key] for s in samples]
        metrics[key], metrics[f"{key}_stderr"] = float(np.mean(values)), stderr(values)
    metrics["questions"] = len(samples)
    return {"metrics": metrics, "samples": samples}
