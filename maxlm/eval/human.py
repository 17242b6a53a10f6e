"""Human rating: a CSV sheet of prompts and model outputs for people to score, and the agreement
between the people who scored it.

``write_sheet`` writes one row per sampled prompt with empty 1-5 columns for each of ``DIMENSIONS``
(5 is best; harmlessness 5 = entirely harmless). Each rater fills a copy and writes their name in
``rater`` (the file name stands in when it is empty). ``agreement`` reads the filled copies, checks
that every rating is an integer 1-5 and that all sheets rate the same ids, and reports per
dimension each rater's mean, the mean over raters, the share of items on which all raters agree,
and chance-corrected agreement: Cohen's kappa for two raters (plus the quadratic-weighted kappa,
which credits near misses on the ordinal scale), Fleiss' kappa for three or more.
"""

from __future__ import annotations

import csv
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from maxlm.eval.tasks import TaskError

DIMENSIONS = ("accuracy", "coherence", "instruction_following", "harmlessness")
CATEGORIES = (1, 2, 3, 4, 5)
COLUMNS = ("id", "task", "prompt", "output", "reference", "rater", *DIMENSIONS, "comment")


def cohen_kappa(a: Sequence[int], b: Sequence[int], categories: Sequence[int] = CATEGORIES,
                weights: str | None = None) -> float:
    """Cohen's kappa of two raters' labels; ``weights='quadratic'`` for the weighted form.
    NaN when chance agreement is already perfect (both raters used one and the same label)."""
    index = {c: i for i, c in enumerate(categories)}
    k = len(categories)
    table = np.zeros((k, k))
    for x, y in zip(a, b, strict=True):
        table[index[x], index[y]] += 1
    table /= table.sum()
    expected = np.outer(table.sum(1), table.sum(0))
    if weights is None:
        disagree = 1.0 - np.eye(k)
    elif weights == "quadratic":
        i, j = np.indices((k, k))
        disagree = (i - j) ** 2 / (k - 1) ** 2
    else:
        raise ValueError(f"weights = {weights!r} is not None or 'quadratic'")
    chance = float((disagree * expected).sum())
    if chance == 0.0:
        return float("nan")
    return 1.0 - float((disagree * table).sum()) / chance


def fleiss_kappa(counts: np.ndarray) -> float:
    """Fleiss' kappa from an [items, categories] table of how many raters chose each category
    (the same number of raters for every item)."""
    counts = np.asarray(counts, float)
    raters = counts.sum(1)
    if not np.all(raters == raters[0]) or raters[0] < 2:
        raise ValueError("Fleiss' kappa needs the same number (>= 2) of ratings for every item")
    n, items = raters[0], counts.shape[0]
    p_item = ((counts ** 2).sum(1) - n) / (n * (n - 1))
    p_cat = counts.sum(0) / (items * n)
    observed, chance = p_item.mean(), float((p_cat ** 2).sum())
    if chance == 1.0:
        return float("nan")
    return float((observed - chance) / (1.0 - chance))


def sample_prompts(task: Any, count: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, reference) pairs: ``count`` documents of the task drawn without replacement."""
    from maxlm.eval import generation

    docs = list(task.docs)
    if not docs:
        raise TaskError(f"task {task.name!r} has no prompts to rate (use a task file)")
    picked = sorted(random.Random(seed).sample(range(len(docs)), min(count, len(docs))))
    out = []
    for i in picked:
        doc = docs[i]
        if task.kind == "generation":
            out.append((generation.prompt(doc, []), doc.answer))
        elif task.kind == "multiple_choice":
            out.append((doc.question, doc.choices[doc.answer]))
        else:
            out.append((doc, ""))
    return out


def write_sheet(path: str | Path, task_name: str, rows: list[tuple[str, str, str]]) -> None:
    """rows: (prompt, output, reference). The rating columns are left empty."""
    with open(path, "x", newline="", encoding="utf-8") as f:  # never over a rater's sheet
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for i, (prompt, output, reference) in enumerate(rows):
            writer.writerow([f"{task_name}-{i}", task_name, prompt, output, reference, "", *[""] * len(DIMENSIONS), ""])


def read_sheet(path: str | Path) -> tuple[str, dict[str, dict[str, int]]]:
    """(rater, {id: {dimension: rating}}); a TaskError naming file:line and column on bad input."""
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # Excel starts a UTF-8 CSV with a BOM
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            missing = [c for c in ("id", *DIMENSIONS) if c not in header]
            if missing:
                raise TaskError(f"{path}:1: missing column '{missing[0]}' (a sheet from --human-sheet has "
                                f"{', '.join(COLUMNS)})")
            ratings, raters = {}, set()
            for row in reader:
                where = f"{path}:{reader.line_num}"
                item = (row.get("id") or "").strip()
                if not item:
                    raise TaskError(f"{where}: column 'id' is empty")
                if item in ratings:
                    raise TaskError(f"{where}: column 'id' = {item!r} appears twice")
                values = {}
                for dim in DIMENSIONS:
                    text = (row.get(dim) or "").strip()
                    if text not in {str(c) for c in CATEGORIES}:
                        shown = repr(text) if text else "empty"
                        raise TaskError(f"{where}: column '{dim}' is {shown}; rate it 1-5")
                    values[dim] = int(text)
                ratings[item] = values
                if (row.get("rater") or "").strip():
                    raters.add(row["rater"].strip())
    except OSError as err:
        raise TaskError(f"{path}: cannot read it ({err.strerror})") from None
    except (csv.Error, UnicodeDecodeError) as err:
        raise TaskError(f"{path}: not a readable CSV sheet ({err})") from None
    if not ratings:
        raise TaskError(f"{path}: holds no rated rows (empty sheet)")
    if len(raters) > 1:
        raise TaskError(f"{path}: column 'rater' names several raters ({', '.join(sorted(raters))}); "
                        "give each rater their own sheet")
    return (raters.pop() if raters else path.stem), ratings


def rater_labels(names: Sequence[str], paths: Sequence[str | Path]) -> list[str]:
    """One distinct label per sheet: the rater's name; a name that several sheets share gets the
    sheet's path as given (files of one name in different folders stay apart), then its position."""
    labels = [name if names.count(name) == 1 else f"{name} ({p})" for name, p in zip(names, paths)]
    return [label if labels.count(label) == 1 else f"{label} #{i + 1}" for i, label in enumerate(labels)]


def agreement(paths: Sequence[str | Path]) -> dict[str, Any]:
    if len(paths) < 2:
        raise TaskError("--agreement needs at least two filled sheets (one per rater)")
    sheets = [read_sheet(p) for p in paths]
    names = rater_labels([name for name, _ in sheets], paths)
    items = sorted(sheets[0][1])
    for (_, ratings), path in zip(sheets[1:], paths[1:]):
        extra, lacking = set(ratings) - set(items), set(items) - set(ratings)
        if extra or lacking:
            which = f"lacks id {sorted(lacking)[0]!r}" if lacking else f"has id {sorted(extra)[0]!r} that {paths[0]} lacks"
            raise TaskError(f"{path}: rates other items than {paths[0]}: it {which}")
    result: dict[str, Any] = {"raters": names, "items": len(items), "dimensions": {}}
    for dim in DIMENSIONS:
        table = np.array([[ratings[i][dim] for i in items] for _, ratings in sheets])  # [raters, items]
        entry: dict[str, Any] = {"mean": float(table.mean()),
                                 "rater_means": {n: float(r.mean()) for n, r in zip(names, table)},
                                 "all_agree": float(np.mean(np.all(table == table[0], axis=0)))}
        if len(sheets) == 2:
            entry["kappa"] = cohen_kappa(table[0], table[1])
            entry["kappa_quadratic"] = cohen_kappa(table[0], table[1], weights="quadratic")
            entry["kappa_kind"] = "cohen"
        else:
            counts = np.array([[Counter(col)[c] for c in CATEGORIES] for col in table.T])
            entry["kappa"] = fleiss_kappa(counts)
            entry["kappa_kind"] = "fleiss"
        result["dimensions"][dim] = entry
    return result


def agreement_table(result: dict[str, Any]) -> str:
    kind = next(iter(result["dimensions"].values()))["kappa_kind"]
    head = f"{'dimension':<22} {'mean':>6} " + " ".join(f"{n[:12]:>12}" for n in result["raters"]) + \
        f" {'all agree':>9} {kind + ' kappa':>13}"
    lines = [f"{len(result['raters'])} raters, {result['items']} items", head]
    for dim, e in result["dimensions"].items():
        lines.append(f"{dim:<22} {e['mean']:>6.2f} " + " ".join(f"{v:>12.2f}" for v in e["rater_means"].values())
                     + f" {e['all_agree']:>9.0%} {e['kappa']:>13.3f}")
    return "\n".join(lines)
