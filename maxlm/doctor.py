"""``python -m maxlm.doctor RUN_DIR``: the run doctor's diagnosis of a finished or running run.

Replays RUN_DIR/metrics.jsonl through the same rules the training loop applies live
(``maxlm.train.doctor``), prints each finding as one line (metric, evidence, usual remedies), and
draws RUN_DIR/doctor.png: the metrics the rules read, with the windows where each rule fired shaded.
It reads only the run's records, so it runs anywhere the run directory can be read, a bucket
(``gs://``, ``s3://``) included; there the plot is drawn locally and uploaded beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path

from maxlm import storage
from maxlm.cli_args import OneLineParser, UserError, run_command

PROG = "maxlm.doctor"
EPILOG = """examples:
  python -m maxlm.doctor runs/tiny                       # diagnosis, and runs/tiny/doctor.png
  python -m maxlm.doctor runs/tiny --plot /tmp/tiny.png --json
  python -m maxlm.doctor runs/tiny --gin_bindings "DoctorConfig.grad_norm_high=5"

The bounds are the run's own (DoctorConfig in RUN_DIR/config.gin), with --gin_bindings on top;
the rules and their remedies are in README.md ("Run doctor"). A run still training can be read at
any time: the diagnosis covers what it has logged so far.
exit status: 0 no findings, 1 findings, 2 a mistake in the arguments or an unreadable RUN_DIR."""


def parse_args(argv):
    p = OneLineParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0], epilog=EPILOG,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (TrainConfig.run_dir) holding metrics.jsonl")
    p.add_argument("--plot", metavar="PATH", help="where to draw the plot (default RUN_DIR/doctor.png)")
    p.add_argument("--no_plot", action="store_true", help="draw no plot")
    p.add_argument("--json", action="store_true", help="print the diagnosis as one JSON object instead")
    p.add_argument("--gin_bindings", metavar="BINDING", action="append", default=[],
                   help="override a bound, e.g. 'DoctorConfig.window=10' (repeatable)")
    return p.parse_args(argv)


def bounds(run_dir: Path, bindings: list[str]):
    """(DoctorConfig, note): the run's own bounds from its config.gin with the bindings on top;
    the defaults (and a note saying why) where config.gin is missing or no longer loads."""
    from maxlm import config

    gin_path = run_dir / "config.gin"
    note = ""
    if gin_path.is_file():
        try:
            return config.load(str(gin_path), bindings).doctor, note  # a bucket's through the cache
        except config.ConfigError as err:
            note = f"note: {gin_path} does not load ({' '.join(str(err).split())[:160]}); default bounds used"
    try:
        return config.load(None, bindings).doctor, note
    except config.ConfigError as err:
        raise UserError(f"--gin_bindings: {str(err).removeprefix('<bindings>: ')}") from None


def read_rows(run_dir: Path) -> tuple[list[dict], list[int]]:
    from maxlm.train.rundir import read_jsonl

    if not run_dir.exists():
        raise UserError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a directory (expected a run directory holding metrics.jsonl)")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path}: not found; is {run_dir} a run directory (TrainConfig.run_dir) that has "
                        "logged its first window?")
    try:
        return read_jsonl(path)
    except OSError as err:
        raise UserError(f"{path}: cannot read ({err.strerror or type(err).__name__})") from None


def task_of(run_dir: Path) -> str:
    """The run's task from RUN_DIR/run.json (GRPO's surrogate loss is not judged as a level);
    pre-training where it is missing or unreadable."""
    try:
        info = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return "pretraining"
    return info.get("task", "pretraining") if isinstance(info, dict) else "pretraining"


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def diagnose(args) -> int:
    from maxlm.train import doctor

    if not args.run_dir.strip():
        raise UserError("RUN_DIR: an empty path is not allowed")
    run_dir = storage.path(args.run_dir)
    rows, bad = read_rows(run_dir)
    cfg, note = bounds(run_dir, args.gin_bindings)
    plot_path = None if args.no_plot else Path(args.plot).expanduser() if args.plot else run_dir / "doctor.png"
    upload_to = None
    if plot_path is not None and storage.is_remote(plot_path):  # drawn here, then put in the bucket
        upload_to, plot_path = plot_path, Path(tempfile.mkdtemp(prefix="maxlm-doctor-")) / "doctor.png"
    if plot_path is not None and not plot_path.parent.is_dir():
        raise UserError(f"--plot {args.plot}: the directory {plot_path.parent} does not exist")
    dr = doctor.Doctor(cfg, task_of(run_dir))
    for row in rows:  # the live run's own ``doctor`` events are not input: the rules are rerun
        dr.observe(row)
    h = dr.history
    steps, losses = h.series("loss")
    cost = doctor.last_cost(rows)
    summary = {"run_dir": str(run_dir), "windows": len(h.windows), "evals": len(h.evals),
               "last_step": int(h.windows[-1][0]) if h.windows else None,
               "loss": float(losses[-1]) if len(losses) else None,  # finite: series() keeps only those
               "eval_loss": doctor._plain(h.evals[-1][1]) if h.evals else None, "nonfinite_steps": len(h.nonfinite),
               "cost_usd": cost or None, "malformed_lines": bad, "bounds": dataclasses.asdict(cfg),
               "findings": [{"step": f.step, **f.as_event()} for f in dr.findings], "note": note or None}
    if plot_path is not None and h.windows:
        try:
            doctor.plot(h, dr.findings, plot_path, title=run_dir.name if storage.is_remote(run_dir) else run_dir.resolve().name)
            if upload_to is not None:
                upload_to.write_bytes(plot_path.read_bytes())
                shutil.rmtree(plot_path.parent, ignore_errors=True)
                plot_path = upload_to
        except OSError as err:
            raise UserError(f"--plot {plot_path}: cannot write ({err.strerror or type(err).__name__})") from None
        except ValueError as err:  # matplotlib: an extension it has no writer for
            raise UserError(f"--plot {plot_path}: {' '.join(str(err).split())}") from None
        summary["plot"] = str(plot_path)
    if args.json:
        print(json.dumps(summary, default=str))
        return 1 if dr.findings else 0
    if note:
        print(note)
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
        print(f"note: {run_dir / 'metrics.jsonl'}: {len(bad)} malformed line(s) skipped (line {shown})")
    if not h.windows:
        print(f"{run_dir}: no training window logged yet; nothing to judge")
        return 0
    facts = [f"steps {steps[0]}-{steps[-1]}" if len(steps) else "", f"{len(h.windows)} windows",
             f"{len(h.evals)} evals", f"last loss {_fmt(summary['loss'])}" if summary["loss"] is not None else "",
             f"eval loss {h.evals[-1][1]:.4g} (step {h.evals[-1][0]})" if h.evals else "",
             f"cost ${cost:,.2f}" if cost else ""]
    print(f"{run_dir}: " + ", ".join(f for f in facts if f))
    for finding in dr.findings:
        print(finding.line())
    if dr.skipped:
        print(f"note: {', '.join(sorted(dr.skipped))} not judged: this task's loss is a surrogate, not a level")
    if dr.findings:
        print(f"{len(dr.findings)} finding(s) from {len(dr.judged)} rules")
    else:
        print(f"no findings: all {len(dr.judged)} rules silent ({', '.join(dr.judged)})")
    if "plot" in summary:
        print(f"plot: {summary['plot']}")
    return 1 if dr.findings else 0


def main(argv=None) -> int:
    return run_command(PROG, diagnose, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
