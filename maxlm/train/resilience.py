"""Surviving a long run: the bad-step guard, rollback, preemption signals and goodput accounting.

The guard runs inside the jitted step: a step whose loss or gradient is non-finite, or (with
``TrainConfig.spike_sigmas``) whose loss or grad norm spikes above its rolling mean, is skipped, never
applied. After ``TrainConfig.rollback_after`` bad steps in a row the loop calls ``Rollback`` to
restore the last good checkpoint with a lower learning rate and skip the batches that led there
(PaLM). The training loop asks ``Preemption.requested(step)`` once per step: on a single process a
SIGTERM/SIGINT handler sets a flag; with ``jax.distributed`` initialised, JAX's preemption sync
point makes every process agree on the same step to stop at, so all of them save the same step.
"""

from __future__ import annotations

import signal
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import flax.struct
import jax
import jax.numpy as jnp

from maxlm.config import TrainConfig

MAX_ROLLBACKS = 5  # a run that keeps diverging after this many rollbacks needs a person


class TrainingError(RuntimeError):
    """A failure the user must act on; the message is one line."""


# ---- the bad-step guard (inside jit)


@flax.struct.dataclass
class Guard:
    skipped: jax.Array  # updates skipped: non-finite loss or gradient, or a spike
    bad_streak: jax.Array  # consecutive skipped steps (the loop rolls back when it grows too long)
    lr_scale: jax.Array  # multiplies every update; a rollback lowers it
    stats: jax.Array  # rolling [mean, variance] of the loss and of the grad norm, shape [2, 2]

    @classmethod
    def create(cls) -> "Guard":
        return cls(skipped=jnp.zeros((), jnp.int32), bad_streak=jnp.zeros((), jnp.int32),
                   lr_scale=jnp.ones((), jnp.float32), stats=jnp.zeros((2, 2), jnp.float32))


def rolling_stats(cfg: TrainConfig, observed: jax.Array, stats: jax.Array, applied: jax.Array) -> jax.Array:
    """Exponential moving [mean, variance] of each observed value over ~spike_window steps."""
    beta = 1.0 - 1.0 / cfg.spike_window
    mean, var = stats[:, 0], stats[:, 1]
    delta = observed - mean
    new = jnp.stack([mean + (1 - beta) * delta, beta * (var + (1 - beta) * delta**2)], axis=1)
    first = jnp.stack([observed, jnp.zeros_like(observed)], axis=1)
    return jnp.where(applied == 0, first, new)


def spike_detected(cfg: TrainConfig, observed: jax.Array, stats: jax.Array, applied: jax.Array) -> jax.Array:
    """Loss or grad norm above its rolling mean by more than spike_sigmas standard deviations."""
    k = cfg.spike_sigmas
    if not k:
        return jnp.zeros((), bool)
    above = observed > stats[:, 0] + k * jnp.sqrt(stats[:, 1])
    return (applied >= cfg.spike_warmup) & jnp.any(above)


def judge(cfg: TrainConfig, guard: Guard, step: jax.Array, loss: jax.Array,
          grad_norm: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, Guard]:
    """(apply this update?, finite?, spike?, the guard after this step)."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    applied = step - guard.skipped
    observed = jnp.stack([loss, grad_norm])
    spike = spike_detected(cfg, observed, guard.stats, applied)
    ok = finite & ~spike
    bad = (~ok).astype(jnp.int32)
    new = guard.replace(skipped=guard.skipped + bad, bad_streak=(guard.bad_streak + 1) * bad,
                        stats=jnp.where(ok, rolling_stats(cfg, observed, guard.stats, applied), guard.stats))
    return ok, finite, spike, new


# ---- rollback (outside jit)


class Rollback:
    """Restores the last good checkpoint when the guard reports too many bad steps in a row."""

    def __init__(self, cfg: TrainConfig, restore: Callable[[int], tuple[int, Any] | None]):
        self.cfg, self.restore, self.count = cfg, restore, 0

    def due(self, window: list[dict]) -> bool:
        after = self.cfg.rollback_after
        return bool(after) and max(int(m["bad_streak"]) for m in window) >= after

    def __call__(self, done: int, where: str) -> tuple[int, Any]:
        """(step rolled back to, its state with a lower learning rate and a cleared streak)."""
        self.count += 1
        after = self.cfg.rollback_after
        if self.count > MAX_ROLLBACKS:
            raise TrainingError(f"step {done}: still {after}+ bad steps in a row after "
                                f"{MAX_ROLLBACKS} rollbacks; see {where}")
        found = self.restore(done)
        if found is None:
            raise TrainingError(f"step {done}: {after} bad steps in a row and no checkpoint to roll back to")
        back, state = found
        guard = state.guard.replace(lr_scale=state.guard.lr_scale * self.cfg.rollback_lr_factor,
                                    bad_streak=state.guard.bad_streak * 0)
        return back, state.replace(guard=guard)


# ---- preemption and goodput


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

    def summary(self, steps_run: int, redone: int) -> dict[str, float]:
        """Seconds per category, with what is left of the wall time split into train and lost."""
        wall = time.perf_counter() - self.start
        out = {"wall_s": wall, **{f"{k}_s": v for k, v in sorted(self.seconds.items())}}
        productive = max(wall - sum(self.seconds.values()), 0.0)  # what is left is stepping
        per_step = productive / max(steps_run, 1)
        out.update(lost_s=redone * per_step, train_s=productive - redone * per_step, redone_steps=redone)
        out["goodput"] = out["train_s"] / wall if wall > 0 else 0.0
        return out
