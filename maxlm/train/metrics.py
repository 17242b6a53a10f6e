"""The run's records (metrics.jsonl, TensorBoard events, loss.png, run.json) and the measured
matmul peak MFU is taken against. FLOP accounting is ``maxlm.model.flops``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp


def measure_peak_flops(dtype: str = "float32", size: int = 1024, repeats: int = 5) -> float:
    """A quick matmul peak of one device in the given dtype: the best of a few timed runs."""
    a = jnp.ones((size, size), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class RunRecorder:
    """Writes metrics to RUN_DIR/metrics.jsonl and TensorBoard, and draws RUN_DIR/loss.png.

    Only process 0 writes; appending keeps the history of resumed runs in one file. ``on_write``
    is called after each write (``force=True`` at close): a run directory in a bucket uploads its
    local mirror there (``maxlm.train.rundir``)."""

    def __init__(self, run_dir: str | Path, enabled: bool = True, on_write: Callable[..., None] = lambda force=False: None):
        self.run_dir = Path(run_dir)
        self.on_write = on_write
        self.enabled = enabled and jax.process_index() == 0
        self.writer = None
        if self.enabled:
            from tensorboardX import SummaryWriter

            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))
            self.jsonl = open(self.run_dir / "metrics.jsonl", "a")

    def record_run(self, info: dict[str, Any]) -> None:
        if self.enabled:
            info = {"git_revision": git_revision(), "argv": sys.argv, "started": time.time(), **info}
            (self.run_dir / "run.json").write_text(json.dumps(info, indent=2, default=str))

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()
        self.on_write()

    def event(self, step: int, kind: str, **info: Any) -> None:
        """A notable event (skipped step, rollback, resume, preemption) in metrics.jsonl."""
        if self.enabled:
            self.jsonl.write(json.dumps({"step": step, "event": kind, **info}) + "\n")
            self.jsonl.flush()

    def text(self, tag: str, text: str, step: int) -> None:
        """A line of text in TensorBoard's Text tab (the run doctor's findings)."""
        if self.enabled:
            self.writer.add_text(tag, text, step)
            self.writer.flush()

    def plot(self) -> Path | None:
        """loss.png: train and eval loss against step, from everything in metrics.jsonl."""
        if not self.enabled:
            return None
        from matplotlib.figure import Figure  # no pyplot: leaves a notebook's backend alone

        from maxlm.train.rundir import read_jsonl

        rows = [r for r in read_jsonl(self.run_dir / "metrics.jsonl")[0]
                if "event" not in r and isinstance(r.get("step"), (int, float))]
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        for key, style in (("loss", "-"), ("eval_loss", "o-")):
            points = sorted((r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)))
            if points:
                ax.plot(*zip(*points), style, label=key.replace("_", " "))
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(self.run_dir.name)
        ax.grid(alpha=0.3)
        ax.legend()
        path = self.run_dir / "loss.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        return path

    def close(self) -> None:
        if self.enabled:
            self.writer.close()
            self.jsonl.close()
            self.on_write(force=True)
