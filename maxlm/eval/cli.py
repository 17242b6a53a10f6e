"""``python -m maxlm.eval``: evaluate a checkpoint on tasks, write a rating sheet, or measure the
raters' agreement. ``--help`` lists everything; maxlm/eval/tasks.py describes the task files.

Every user mistake (arguments, a task file's line, a missing checkpoint, a sheet's cell) is one
line on stderr naming the file, line and field, and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

EPILOG = """\
tasks (--task, repeatable or comma-separated):
  perplexity               held-out documents of the run's own DataConfig.source
  perplexity:SOURCE        held-out documents of a data source: stdlib, files:GLOB, jsonl:GLOB[:FIELD], ...
  FILE.jsonl               {"question","choices","answer"} lines: multiple choice (answer: index or letter)
                           {"question","answer"} lines: generation, exact match of the final answer
                           ("#### 42", else the last number)
                           {"text"} lines: perplexity of each text;  {"prompt"} lines: --human-sheet only
  FILE                     any other file: perplexity of its text

tokenisation (as lm-evaluation-harness's hf model with add_bos_token=True): <|bos|> + context;
trailing whitespace of the context moves to the continuation; the continuation's tokens are
encode(ctx + cont)[len(encode(ctx)):]. Multiple-choice prompts are "question" with " choice"
continuations; k shots are the first k other questions of the file, joined by blank lines.

examples:
  python -m maxlm.eval --checkpoint runs/tiny --task perplexity:stdlib --limit 20
  python -m maxlm.eval --checkpoint export/tiny --task mmlu.jsonl --shots 5 --out results.json
  python -m maxlm.eval --checkpoint runs/tiny --task prompts.jsonl --human-sheet sheet.csv --limit 30
  python -m maxlm.eval --agreement alice.csv bob.csv carol.csv
"""


class _Parser(argparse.ArgumentParser):
    """A mistake in the arguments is one line on stderr (not the usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"maxlm.eval: error: {' '.join(message.split())} (see --help)\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m maxlm.eval", description="Evaluate a maxlm run or a Hugging Face directory: "
                "perplexity, multiple choice, generation; or prepare and score human ratings.",
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", metavar="RUN_DIR|CKPT|HF_DIR",
                   help="a maxlm run directory (newest good checkpoint), RUN_DIR/checkpoints/STEP, or a "
                        "Hugging Face directory (e.g. from `python -m maxlm.hf export`)")
    p.add_argument("--task", action="append", default=[], metavar="FILE|NAME",
                   help="a task file or name (see below); repeat or separate with commas")
    p.add_argument("--shots", type=_non_negative, default=0, metavar="K",
                   help="few-shot examples before each question (default 0)")
    p.add_argument("--limit", type=_positive, metavar="N",
                   help="only the first N questions/documents (--human-sheet: N sampled prompts, default 20)")
    p.add_argument("--out", metavar="FILE.json", help="write the results, with every question's scores, here")
    p.add_argument("--batch-size", type=_positive, default=8, metavar="B",
                   help="sequences per forward pass and prompts per generate call (default 8)")
    p.add_argument("--max-new-tokens", type=_positive, default=256, metavar="N",
                   help="generation tasks and --human-sheet: tokens generated per prompt (default 256)")
    p.add_argument("--step", type=_non_negative, help="the checkpoint step of a run directory (default: newest good)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default: the checkpoint's; float32 for Hugging Face directories)")
    p.add_argument("--tensor", type=_positive, default=1, help="devices to split the model over (tensor axis)")
    p.add_argument("--human-sheet", metavar="FILE.csv",
                   help="instead of scoring: write a CSV of sampled prompts and the model's outputs, with "
                        "empty 1-5 columns (accuracy, coherence, instruction_following, harmlessness) to rate")
    p.add_argument("--seed", type=_non_negative, default=0, help="--human-sheet: which prompts are sampled")
    p.add_argument("--agreement", nargs="+", metavar="SHEET",
                   help="filled sheets, one per rater: per-dimension means and inter-rater agreement "
                        "(Cohen's kappa for two raters, Fleiss' for more); needs no checkpoint")
    return p


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4f}"
    return str(value)


def table(results: list[dict[str, Any]]) -> str:
    rows = [("task", "kind", "metric", "value", "± stderr")]
    for r in results:
        m = r["metrics"]
        for key, value in m.items():
            if key.endswith("_stderr"):
                continue
            err = m.get(f"{key}_stderr")
            rows.append((r["task"], r["kind"], key, _fmt(value), "" if err is None else _fmt(err)))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _write_json(path: str, payload: dict) -> None:
    """Written whole (a temporary renamed over it), or not at all: a failure leaves no temporary."""
    from maxlm.data.atomic import write_file

    try:
        write_file(path, json.dumps(payload, indent=1, allow_nan=True) + "\n", "maxlm.eval")
    except OSError as err:
        raise UserError(f"--out {path}: cannot write it ({err.strerror or err})") from None
    except ValueError as err:
        raise UserError(f"--out {path}: {err}") from None


def _check_new_sheet(path: str) -> None:
    """Refuse, before anything is generated, a --human-sheet that exists or cannot be created."""
    target = Path(path).expanduser()
    if target.exists() or target.is_symlink():
        raise UserError(f"--human-sheet {path} already exists; remove it or choose a new path "
                        "(a sheet may hold a rater's work, so it is never overwritten)")
    parent = target.parent
    if not parent.is_dir():
        raise UserError(f"--human-sheet {path}: folder {parent} does not exist")


class UserError(ValueError):
    pass


def _run(args: argparse.Namespace) -> int:
    from maxlm.eval import human
    from maxlm.eval.evaluator import Evaluator
    from maxlm.eval.tasks import load_tasks, split_list

    if args.agreement:
        if args.checkpoint or args.task or args.human_sheet:
            raise UserError("--agreement takes only the filled sheets (no --checkpoint, --task or --human-sheet)")
        result = human.agreement(args.agreement)
        print(human.agreement_table(result))
        if args.out:
            _write_json(args.out, result)
        return 0
    if not args.checkpoint:
        raise UserError("--checkpoint is required (a run directory, a checkpoint or a Hugging Face directory)")
    specs = [s for entry in args.task for s in split_list(entry)]
    if not specs:
        raise UserError("--task is required (a task file, perplexity or perplexity:SOURCE)")
    tasks = load_tasks(specs)  # before the model: a bad task file fails in a second, not after loading
    if args.human_sheet and len(tasks) != 1:
        raise UserError("--human-sheet takes exactly one --task (whose prompts are sampled)")
    if args.human_sheet and not tasks[0].docs:
        raise UserError(f"--human-sheet: task {specs[0]!r} has no prompts (use a task file)")

    if args.human_sheet:
        _check_new_sheet(args.human_sheet)

    from maxlm.hf.load import LoadError, load_model

    try:
        loaded = load_model(args.checkpoint, step=args.step, dtype=args.dtype, tensor=args.tensor)
    except LoadError as err:
        raise UserError(str(err)) from None
    if loaded.tokenizer is None:
        raise UserError(f"{args.checkpoint}: has no tokenizer (tokenizer.json) to turn tasks into tokens")
    batch = args.batch_size
    evaluator = Evaluator(loaded.cfg, loaded.params, loaded.tokenizer, batch_size=batch,
                          mesh=loaded.mesh, run_config=loaded.run_config, shots=args.shots, limit=args.limit,
                          new_tokens=args.max_new_tokens)
    if args.human_sheet:
        from maxlm.eval import generation

        picked = human.sample_prompts(tasks[0], args.limit or 20, args.seed)
        try:  # eos only, no GSM stop strings: an answer of several paragraphs is rated whole
            outputs = generation.complete(loaded.cfg, loaded.params, loaded.tokenizer, [p for p, _ in picked],
                                          new_tokens=args.max_new_tokens, batch_size=batch, mesh=loaded.mesh,
                                          stop_strings=())
        except ValueError as err:  # PromptError included
            raise UserError(f"--human-sheet: {err}") from None
        try:
            human.write_sheet(args.human_sheet, tasks[0].name,
                              [(p, o, ref) for (p, ref), o in zip(picked, outputs)])
        except FileExistsError:
            raise UserError(f"--human-sheet {args.human_sheet} appeared while generating; "
                            "it is left as it is (choose a new path)") from None
        except OSError as err:
            raise UserError(f"--human-sheet {args.human_sheet}: cannot write it ({err.strerror})") from None
        print(f"wrote {len(picked)} prompts and outputs to {args.human_sheet}: each rater fills a copy "
              f"(1-5 per column), then: python -m maxlm.eval --agreement SHEET SHEET ...")
        return 0
    results = []
    for task in tasks:
        result = evaluator.run(task)
        results.append(result)
        print(f"{task.name}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in result["metrics"].items()
                                            if not k.endswith("_stderr")) + f" ({result['seconds']:.1f}s)",
              file=sys.stderr)
    print(table(results))
    if args.out:
        _write_json(args.out, {
            "checkpoint": str(args.checkpoint), "source": loaded.source, "step": loaded.step,
            "shots": args.shots, "limit": args.limit, "batch_size": batch,
            "tokenization": {"bos": True, "trailing_whitespace": "moved to the continuation",
                             "continuation": "encode(ctx + cont)[len(encode(ctx)):]"},
            "results": results})
        print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from maxlm.eval.tasks import TaskError

    args = parser().parse_args(argv)
    try:
        return _run(args)
    except (UserError, TaskError) as err:
        print(f"maxlm.eval: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
