"""Task files and names: what ``--task`` and ``TrainConfig.eval_tasks`` accept, parsed and checked.

A task is one of:

    perplexity                 held-out documents of the run's own DataConfig.source
    perplexity:SOURCE          held-out documents of any raw data source (stdlib, files:GLOB,
                               jsonl:GLOB[:FIELD], parquet:GLOB[:COLUMN]; maxlm/data/spec.py)
    FILE.jsonl                 one JSON object per line; the fields of the lines decide the kind:
        {"question", "choices", "answer"}   multiple choice; answer an index (0-based) or a letter
        {"question", "answer"}              generation (GSM8K style: the answer ends "#### 42")
        {"text"}                            perplexity of each line's text
        {"prompt"}                          prompts only (for --human-sheet)
    FILE (any other suffix)    perplexity of the file's whole text

Every problem is a one-line ``TaskError`` naming ``file:line`` and the field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# The syntax of one entry is checked by config validation too, so it lives in maxlm.config.
from maxlm.config import eval_task_list as split_list  # noqa: F401  (re-exported)
from maxlm.config import eval_task_name as task_name
from maxlm.config import eval_task_problem as check_spec

KINDS = ("multiple_choice", "generation", "perplexity", "prompts")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class TaskError(ValueError):
    """A task that cannot be used; str(err) is the one line to print."""


@dataclasses.dataclass(frozen=True)
class MCDoc:
    question: str
    choices: tuple[str, ...]
    answer: int  # index into choices


@dataclasses.dataclass(frozen=True)
class GenDoc:
    question: str
    answer: str  # the reference solution; its final answer is extracted for exact match


@dataclasses.dataclass(frozen=True)
class Task:
    name: str  # short, unique within a run: metric keys are eval/<name>/<metric>
    kind: str  # one of KINDS
    docs: tuple = ()  # MCDoc | GenDoc | str (texts or prompts)
    source: str = ""  # perplexity over a data source: the spec ("" = the run's own source)
    path: str = ""  # the file it came from, if any


def _field(obj: dict, key: str, where: str, kind: type | tuple) -> Any:
    if key not in obj:
        raise TaskError(f"{where}: missing field '{key}'")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        want = getattr(kind, "__name__", None) or " or ".join(k.__name__ for k in kind)
        raise TaskError(f"{where}: field '{key}' should be a {want}, got {type(value).__name__} {value!r:.60}")
    return value


def _text(obj: dict, key: str, where: str) -> str:
    value = _field(obj, key, where, str)
    if not value.strip():
        raise TaskError(f"{where}: field '{key}' is empty")
    return value


def _answer_index(value: Any, n: int, where: str) -> int:
    if isinstance(value, str) and len(value.strip()) == 1 and value.strip().upper() in LETTERS:
        index = LETTERS.index(value.strip().upper())
    elif isinstance(value, int) and not isinstance(value, bool):
        index = value
    elif isinstance(value, str) and value.strip().isdigit():
        index = int(value)
    else:
        raise TaskError(f"{where}: field 'answer' = {value!r:.40} is neither a choice index nor a letter")
    if not 0 <= index < n:
        letters = f"A..{LETTERS[n - 1]}" if n <= len(LETTERS) else f"A..Z for the first {len(LETTERS)}"
        raise TaskError(f"{where}: field 'answer' = {value!r} is out of range for {n} choices "
                        f"(0..{n - 1} or {letters})")
    return index


def _kind_of(obj: dict) -> str:
    if "choices" in obj:
        return "multiple_choice"
    if "question" in obj:
        return "generation"
    if "text" in obj:
        return "perplexity"
    if "prompt" in obj:
        return "prompts"
    return ""


def _parse_doc(obj: dict, kind: str, where: str) -> Any:
    if kind == "multiple_choice":
        question = _text(obj, "question", where)
        choices = _field(obj, "choices", where, list)
        if len(choices) < 2:
            raise TaskError(f"{where}: field 'choices' needs at least 2 entries, got {len(choices)}")
        for i, choice in enumerate(choices):
            if not isinstance(choice, str) or not choice.strip():
                raise TaskError(f"{where}: field 'choices' entry {i} should be a non-empty string, got {choice!r:.40}")
        if "answer" not in obj:
            raise TaskError(f"{where}: missing field 'answer'")
        return MCDoc(question, tuple(choices), _answer_index(obj["answer"], len(choices), where))
    if kind == "generation":
        answer = obj.get("answer")
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        obj = {**obj, "answer": answer} if "answer" in obj else obj
        return GenDoc(_text(obj, "question", where), _text(obj, "answer", where))
    return _text(obj, "text" if kind == "perplexity" else "prompt", where)


def read_jsonl(path: Path, name: str) -> Task:
    """A JSONL task file; its first record's fields decide the kind, and every line must agree."""
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise TaskError(f"{path}: not UTF-8 ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise TaskError(f"{path}: cannot read it ({err.strerror})") from None
    kind, docs = "", []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise TaskError(f"{where}: malformed JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(obj, dict):
            raise TaskError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if not kind:
            kind = _kind_of(obj)
            if not kind:
                raise TaskError(f"{where}: no field 'question', 'text' or 'prompt' (a task line is "
                                "{question, choices, answer}, {question, answer}, {text} or {prompt})")
        elif kind == "multiple_choice" and "choices" not in obj:
            raise TaskError(f"{where}: missing field 'choices' (earlier lines are multiple choice)")
        docs.append(_parse_doc(obj, kind, where))
    if not docs:
        raise TaskError(f"{path}: holds no task lines (empty file)")
    return Task(name, kind, tuple(docs), path=str(path))


def load_task(spec: str) -> Task:
    """One task from its entry; a TaskError (one line) on any problem."""
    spec = spec.strip()
    problem = check_spec(spec)
    if problem:
        raise TaskError(problem)
    name = task_name(spec)
    if spec == "perplexity" or spec.startswith("perplexity:"):
        source = spec.removeprefix("perplexity").removeprefix(":").strip()
        if source:
            from maxlm.data.spec import (
                parse_mixture,  # imports the data pipeline: not in check_spec
            )

            try:
                parse_mixture(source)
            except ValueError as err:
                raise TaskError(f"{spec}: {err}") from None
        return Task(name, "perplexity", source=source)
    path = Path(spec).expanduser()
    if not path.exists():
        raise TaskError(f"{spec}: no such task file (and not one of: perplexity, perplexity:SOURCE)")
    if path.is_dir():
        raise TaskError(f"{spec}: is a directory, not a task file")
    if path.name.lower().endswith(JSONL_SUFFIXES):
        return read_jsonl(path, name)
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise TaskError(f"{path}: cannot read it as UTF-8 text ({err})") from None
    if not text.strip():
        raise TaskError(f"{path}: holds no text (empty file)")
    return Task(name, "perplexity", (text,), path=str(path))


def load_tasks(specs: list[str]) -> list[Task]:
    tasks = [load_task(s) for s in specs]
    names = [t.name for t in tasks]
    for t in tasks:
        if names.count(t.name) > 1:
            raise TaskError(f"two tasks are both named {t.name!r} (their files share a stem); rename one")
    return tasks
