"""Surviving a long run: preemption signals and goodput accounting.

The training loop asks ``Preemption.requested(step)`` once per step. On a single process a
SIGTERM/SIGINT handler sets a flag; with ``jax.distributed`` initialised, JAX's preemption sync
point makes every process agree on the same step to stop at, so all of them save the same step.
"""

from __future__ import annotations

import signal
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import jax


class Preemption:
    """Turns SIGTERM/SIGINT into a request to stop after the current step (and save)."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}
        self._multi = jax.process_count() > 1

    def __enter__(self) -> "Preemption":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means: stop now, without the save
        self.signal_name = signal.Signals(signum).name

    def requested(self, step: int) -> bool:
        if self._multi:
            from jax.experimental import multihost_utils

            return self.signal_name is not None or multihost_utils.reached_preemption_sync_point(step)
        return self.signal_name is not None

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Goodput:
    """Wall time split into productive training and each kind of loss.

    Categories: startup (build, restore, first compile), data (waiting for batches), checkpoint
    (blocking part of saves and restores), eval, lost (steps recomputed after a restart or rollback),
    and train (productive steps)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def timed(self, category: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[category] += time.perf_counter() - t

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds

    def summary(self) -> dict[str, float]:
        wall = time.perf_counter() - self.start
        productive = self.seconds.get("train", 0.0)
        out = {"goodput": productive / wall if wall > 0 else 0.0, "wall_s": wall}
        out.update({f"{k}_s": v for k, v in sorted(self.seconds.items())})
        return out
