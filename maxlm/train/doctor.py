"""The run doctor: rules over the metrics a run already logs, each saying once what looks wrong.

The rules are pure functions of the run's history (``History``: the logged windows, the
evaluations and the skipped-step events, in the order ``metrics.jsonl`` holds them) and its
``DoctorConfig`` bounds; each returns a ``Finding`` or None. ``Doctor`` feeds rows to the history
and asks every rule not yet fired, so the loop (live, after each logged window and evaluation)
and ``python -m maxlm.doctor RUN_DIR`` (replaying metrics.jsonl) reach the same verdicts at the
same steps. A finding is one line: the metric, the evidence, and the usual remedies from the
troubleshooting tables of the training guides.

Also here: the live cost line's price (the planner's table, by device kind) and the device memory
headroom the backend reports (``device.memory_stats()``; the CPU backend reports none, and the
memory rule stays silent there).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Callable, Iterable

import numpy as np

from maxlm.config import DoctorConfig

# rule -> (what it names, the metric it reads, the usual remedies). The README's table is this one.
RULES: dict[str, tuple[str, str, str]] = {
    "loss_flat": ("train loss flat", "loss",
                  "raise OptimConfig.learning_rate (often 3-10x), check that the data and labels are "
                  "right (loss mask, tokenizer, shuffling), shorten a long warmup, check the initialisation"),
    "loss_oscillating": ("train loss oscillating", "loss",
                         "lower OptimConfig.learning_rate, raise TrainConfig.global_batch (or "
                         "OptimConfig.microbatches), lengthen the warmup, lower OptimConfig.b2 (0.95)"),
    "loss_rising": ("train loss diverging", "loss",
                    "lower OptimConfig.learning_rate, keep OptimConfig.grad_clip at 1.0, lengthen the "
                    "warmup, turn on TrainConfig.spike_sigmas and rollback_after, check the data for bad batches"),
    "overfitting": ("eval loss rising while train loss falls", "eval_loss",
                    "more (or more varied) data, fewer steps or early stopping at the best eval, raise "
                    "OptimConfig.weight_decay, add dropout (ModelConfig.lora_dropout for LoRA), a smaller model"),
    "grad_norm_high": ("gradient norm high", "grad_norm",
                       "lower OptimConfig.learning_rate, keep OptimConfig.grad_clip at 1.0, lengthen the "
                       "warmup, check for bad batches; bfloat16 params may need a float32 master copy"),
    "grad_norm_low": ("gradient norm low", "grad_norm",
                      "raise OptimConfig.learning_rate, check that the loss reaches the parameters (a frozen "
                      "or masked-out model, LoRA paths), check the initialisation (ModelConfig.init_std)"),
    "nonfinite": ("non-finite steps", "loss",
                  "lower OptimConfig.learning_rate, use bfloat16 rather than float16 (or raise "
                  "OptimConfig.loss_scale), keep OptimConfig.grad_clip, find the batch (skipped_step events)"),
    "step_time_drift": ("step time drifting up", "step_time_s",
                        "find the straggler or throttled device (nvidia-smi: clocks, temperature, ECC), "
                        "check for other jobs on the hosts, checkpoints or evals blocking, host memory swapping"),
    "memory_headroom": ("device memory headroom low", "memory_headroom",
                        "lower TrainConfig.global_batch per device (raise OptimConfig.microbatches), "
                        "ModelConfig.remat, shard more (MeshConfig.fsdp), check `python -m maxlm.plan`"),
    "data_wait": ("input pipeline stalls", "data_wait_share",
                  "raise DataConfig.worker_count and DataConfig.prefetch, pre-tokenise (`python -m "
                  "maxlm.data prepare`, source packed:DIR), more DataConfig.read_threads, faster storage"),
}
WINDOW_KEYS = ("loss", "grad_norm")  # a row with both is a logged training window


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one rule saw: fired at ``step`` over the steps ``window`` = (first, last) it judged."""

    rule: str
    step: int
    window: tuple[int, int]
    evidence: str
    values: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def metric(self) -> str:
        return RULES[self.rule][1]

    def line(self) -> str:
        title, metric, remedies = RULES[self.rule]
        return f"doctor: step {self.step}: {title} ({metric}): {self.evidence}; usual remedies: {remedies}"

    def as_event(self) -> dict[str, Any]:
        """The fields of its ``doctor`` event in metrics.jsonl. The numbers go under "values": as
        top-level keys ("loss", "grad_norm") they would read as metrics to whatever scans the file."""
        return {"rule": self.rule, "metric": self.metric, "window": list(self.window), "evidence": self.evidence,
                "message": self.line(), "values": {k: _plain(v) for k, v in self.values.items()}}


def _median(values: Any) -> float:
    """The median of a short sequence: ``statistics.median`` sorts a 20-value window in
    microseconds, where numpy's call overhead alone is 50x that (it runs after every window)."""
    return float(statistics.median(values.tolist() if isinstance(values, np.ndarray) else values))


def _plain(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None  # JSON has no NaN in strict readers


def _number(row: dict, key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclasses.dataclass
class History:
    """The run so far, as the rules read it. ``windows``: (step, row) of each logged training
    window; ``evals``: (step, eval loss); ``nonfinite``: steps of skipped non-finite updates.

    A 30-day run logs hundreds of thousands of windows, and the rules are asked after each: the
    finite values of every metric are kept as columns (``series`` slices their tail), their running
    peaks in ``peak``, and a rule that needs the whole run keeps its running summary in ``memo``,
    so that one window costs O(window), not O(run)."""

    windows: list[tuple[int, dict]] = dataclasses.field(default_factory=list)
    evals: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    nonfinite: list[int] = dataclasses.field(default_factory=list)
    columns: dict[str, tuple[list[int], list[float]]] = dataclasses.field(default_factory=dict)
    peak: dict[str, float] = dataclasses.field(default_factory=dict)
    memo: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def add(self, row: dict) -> str | None:
        """Take one metrics.jsonl row; returns what it was ("window", "eval", "nonfinite") or None."""
        step = _number(row, "step")
        if step is None:
            return None
        step = int(step)
        if row.get("event") == "skipped_step" and row.get("reason") == "non-finite":
            self.nonfinite.append(step)
            return "nonfinite"
        if "event" in row:
            return None
        if all(_number(row, k) is not None for k in WINDOW_KEYS):
            self.windows.append((step, row))
            for key in row:
                value = _number(row, key)
                if key != "step" and value is not None and math.isfinite(value):
                    steps, values = self.columns.setdefault(key, ([], []))
                    steps.append(step)
                    values.append(value)
                    self.peak[key] = max(self.peak.get(key, value), value)
            return "window"
        if _number(row, "eval_loss") is not None:
            self.evals.append((step, float(row["eval_loss"])))
            return "eval"
        return None

    def series(self, key: str, last: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of ``key`` over the last ``last`` windows that logged it finite."""
        steps, values = self.columns.get(key, ([], []))
        if last:
            steps, values = steps[-last:], values[-last:]
        return np.array(steps, dtype=np.int64), np.array(values, dtype=np.float64)


# --- the rules: (history, bounds) -> Finding | None; each reads only what the run logged ---------

def _recent(h: History, key: str, cfg: DoctorConfig) -> tuple[np.ndarray, np.ndarray] | None:
    """The last ``cfg.window`` finite values of ``key``, or None until there are that many. A
    window whose updates were all skipped logs a NaN loss and is left out, not judged."""
    steps, values = h.series(key, cfg.window)
    return (steps, values) if len(values) >= cfg.window else None


def loss_flat(h: History, cfg: DoctorConfig) -> Finding | None:
    """The train loss fell by less than ``flat_drop`` of its level over the window (a least-squares
    line through it, so one noisy window does not decide). Not judged while the learning rate is
    below ``flat_lr_fraction`` of its peak: at the end of a decay schedule, flattening is the plan."""
    got = _recent(h, "loss", cfg)
    if got is None:
        return None
    steps, loss = got
    _, lrs = h.series("lr", 1)
    if len(lrs) and lrs[-1] < cfg.flat_lr_fraction * h.peak["lr"]:
        return None
    x = steps - steps.mean()
    slope = float(x @ (loss - loss.mean()) / max(x @ x, 1e-12))  # the least-squares line's
    drop = -slope * (steps[-1] - steps[0]) / max(abs(loss.mean()), 1e-12)
    if drop >= cfg.flat_drop:
        return None
    return Finding("loss_flat", int(steps[-1]), (int(steps[0]), int(steps[-1])),
                   f"{loss[0]:.4g} -> {loss[-1]:.4g} over steps {steps[0]}-{steps[-1]}, a fitted fall of "
                   f"{drop:.2%} < {cfg.flat_drop:.2%} (lr {lrs[-1]:.3g})",
                   {"drop": float(drop), "loss": float(loss[-1])})


def _noise_variance(values: np.ndarray) -> float:
    """The window-to-window variance of a series with its smooth trend taken out: second differences
    cancel a locally straight trend (a falling loss), and white noise of variance v gives them
    variance 6v. The median of their squares (/0.455, the median of chi-square with 1 degree) keeps
    a steep warmup stretch or one spike from deciding it."""
    d2 = np.diff(values, 2)
    return _median(d2**2) / (6 * 0.455) if len(d2) else 0.0


def loss_oscillating(h: History, cfg: DoctorConfig) -> Finding | None:
    """The window-to-window variance of the train loss (trend removed) over its mean above ``oscillation``."""
    got = _recent(h, "loss", cfg)
    if got is None:
        return None
    steps, loss = got
    ratio = _noise_variance(loss) / max(abs(loss.mean()), 1e-12)
    if ratio <= cfg.oscillation:
        return None
    return Finding("loss_oscillating", int(steps[-1]), (int(steps[0]), int(steps[-1])),
                   f"variance/mean {ratio:.3g} > {cfg.oscillation:g} over steps {steps[0]}-{steps[-1]} "
                   f"(loss between {loss.min():.4g} and {loss.max():.4g})", {"variance_over_mean": ratio})


def loss_rising(h: History, cfg: DoctorConfig) -> Finding | None:
    """The train loss of the last few windows above the run's best by more than ``rise``: medians
    of ``max(2, window // 5)`` consecutive windows on both sides, so that neither one noisy window
    now nor one lucky window earlier decides it."""
    steps, loss = h.columns.get("loss", ([], []))
    k = max(2, cfg.window // 5)
    if len(loss) < 2 * k:
        return None
    # The best median of k consecutive windows that end before the last k begin, kept up to date
    # in the memo: (next start to look at, best median, its first window's index).
    start, best, best_at = h.memo.get(("loss_rising", k), (0, math.inf, 0))
    for j in range(start, len(loss) - 2 * k + 1):
        median = _median(loss[j:j + k])
        if median < best:
            best, best_at = median, j
    h.memo[("loss_rising", k)] = (max(start, len(loss) - 2 * k + 1), best, best_at)
    now = _median(loss[-k:])
    if now <= best * (1 + cfg.rise):
        return None
    return Finding("loss_rising", int(steps[-1]), (int(steps[best_at]), int(steps[-1])),
                   f"{now:.4g} over the last {k} windows, {now / best - 1:.0%} above the best {best:.4g} "
                   f"(steps {steps[best_at]}-{steps[best_at + k - 1]}) > {cfg.rise:.0%}", {"loss": now, "best": best})


def _train_near(h: History, step: int, n: int = 3) -> float | None:
    """The mean train loss of the ``n`` windows logged at or before ``step`` (the first ones if none)."""
    steps, loss = h.series("loss")
    if not len(loss):
        return None
    before = loss[steps <= step]
    return float((before[-n:] if len(before) else loss[:n]).mean())


def overfitting(h: History, cfg: DoctorConfig) -> Finding | None:
    """The latest eval loss above the best earlier one by more than ``overfit_rise`` while the
    train loss (the windows logged up to each evaluation) fell by more than that fraction over the
    same steps: a plateaued train loss with a noisy eval is not evidence of memorising."""
    evals = [(s, v) for s, v in h.evals if math.isfinite(v)]
    if len(evals) < 2:
        return None
    (best_step, best), (step, now) = min(evals[:-1], key=lambda e: e[1]), evals[-1]
    if now <= best * (1 + cfg.overfit_rise):
        return None
    train_then, train_now = _train_near(h, best_step), _train_near(h, step)
    if train_then is None or not train_now < train_then * (1 - cfg.overfit_rise):
        return None  # both rising is divergence, not overfitting (loss_rising says it)
    return Finding("overfitting", step, (best_step, step),
                   f"eval {best:.4g} (step {best_step}) -> {now:.4g} (step {step}), +{now / best - 1:.1%} > "
                   f"{cfg.overfit_rise:.0%}, while train fell {train_then:.4g} -> {train_now:.4g}",
                   {"eval_loss": now, "best_eval_loss": best, "train_loss": train_now})


def _grad_norm(h: History, cfg: DoctorConfig, high: bool) -> Finding | None:
    """The median gradient norm (the last step of each window, before clipping) over the window
    beyond ``grad_norm_high`` / ``grad_norm_low``: a median, so one spike or dip does not decide."""
    got = _recent(h, "grad_norm", cfg)
    if got is None:
        return None
    steps, norms = got
    median = _median(norms)
    bound = cfg.grad_norm_high if high else cfg.grad_norm_low
    if (median <= bound) if high else (median >= bound):
        return None
    rule = "grad_norm_high" if high else "grad_norm_low"
    return Finding(rule, int(steps[-1]), (int(steps[0]), int(steps[-1])),
                   f"median {median:.3g} {'>' if high else '<'} {bound:g} over steps {steps[0]}-{steps[-1]} "
                   f"(range {norms.min():.3g}-{norms.max():.3g})", {"grad_norm": median})


def grad_norm_high(h: History, cfg: DoctorConfig) -> Finding | None:
    return _grad_norm(h, cfg, high=True)


def grad_norm_low(h: History, cfg: DoctorConfig) -> Finding | None:
    return _grad_norm(h, cfg, high=False)


def nonfinite(h: History, cfg: DoctorConfig) -> Finding | None:
    """At least ``nonfinite_steps`` steps whose loss or gradient was NaN/inf (the guard skipped
    their updates: skipped_step events), or an evaluation whose loss was not finite."""
    bad_evals = [s for s, v in h.evals if not math.isfinite(v)]
    if len(h.nonfinite) < cfg.nonfinite_steps and not bad_evals:
        return None
    steps = sorted(h.nonfinite[:cfg.nonfinite_steps]) or bad_evals[:1]
    what = (f"{len(h.nonfinite)} skipped update(s) with a non-finite loss or gradient (first at step "
            f"{h.nonfinite[0]})" if h.nonfinite else "") or f"eval loss not finite at step {bad_evals[0]}"
    return Finding("nonfinite", steps[-1], (steps[0], steps[-1]), what, {"count": float(len(h.nonfinite))})


def step_time_drift(h: History, cfg: DoctorConfig) -> Finding | None:
    """The median step time of the last ``window`` windows above that of the run's first ``window``
    (after the first, which warms caches) by more than ``step_time_drift``, and by more than three
    robust standard deviations (1.4826 x the median absolute deviation) of those early times: where
    steps already varied that much (a host shared with other jobs), a shift of that size is the
    machine's noise, not a straggler or a throttled device. On accelerators the spread is a few
    percent, so the fraction decides."""
    steps, times = h.columns.get("step_time_s", ([], []))
    if len(times) < 2 * cfg.window + 1:
        return None
    base = np.array(times[1:cfg.window + 1])
    early, late = _median(base), _median(times[-cfg.window:])
    spread = 1.4826 * _median(np.abs(base - early))
    if late <= early * (1 + cfg.step_time_drift) or late - early <= 3 * spread:
        return None
    return Finding("step_time_drift", int(steps[-1]), (int(steps[-cfg.window]), int(steps[-1])),
                   f"median {late * 1e3:.4g} ms/step over steps {steps[-cfg.window]}-{steps[-1]}, "
                   f"+{late / early - 1:.0%} on the {early * 1e3:.4g} ms of steps {steps[1]}-{steps[cfg.window]} "
                   f"(> {cfg.step_time_drift:.0%}, and > 3 x its spread {spread * 1e3:.3g} ms)",
                   {"step_time_s": late, "baseline_s": early})


def memory_headroom(h: History, cfg: DoctorConfig) -> Finding | None:
    """A window whose free device memory (the fullest device, at its peak) fell below ``memory_headroom``."""
    steps, free = h.series("memory_headroom", 1)
    if not len(free) or free[-1] >= cfg.memory_headroom:
        return None
    return Finding("memory_headroom", int(steps[-1]), (int(steps[-1]), int(steps[-1])),
                   f"{free[-1]:.1%} of device memory free at peak < {cfg.memory_headroom:.0%}",
                   {"memory_headroom": float(free[-1])})


def data_wait(h: History, cfg: DoctorConfig) -> Finding | None:
    """The median share of wall time spent waiting for the next batch over the window above ``data_wait``."""
    got = _recent(h, "data_wait_share", cfg)
    if got is None:
        return None
    steps, share = got
    median = _median(share)
    if median <= cfg.data_wait:
        return None
    return Finding("data_wait", int(steps[-1]), (int(steps[0]), int(steps[-1])),
                   f"median {median:.1%} of the time waiting for batches > {cfg.data_wait:.0%} over steps "
                   f"{steps[0]}-{steps[-1]}", {"data_wait_share": median})


CHECKS: dict[str, Callable[[History, DoctorConfig], Finding | None]] = {
    "loss_flat": loss_flat, "loss_oscillating": loss_oscillating, "loss_rising": loss_rising,
    "overfitting": overfitting, "grad_norm_high": grad_norm_high, "grad_norm_low": grad_norm_low,
    "nonfinite": nonfinite, "step_time_drift": step_time_drift, "memory_headroom": memory_headroom,
    "data_wait": data_wait,
}
# Which rows can change a rule's verdict: a rule is asked only after one of them arrives.
_TRIGGERS = {"overfitting": ("eval",), "nonfinite": ("nonfinite", "eval")}
# Tasks whose loss is a surrogate centred near zero (GRPO's policy-gradient objective), not a level
# that falls as the model learns: its flatness, spread over its mean and rises say nothing; the
# reward is its measure of progress. The other rules still apply.
SURROGATE_LOSS_TASKS = ("grpo",)
LOSS_LEVEL_RULES = ("loss_flat", "loss_oscillating", "loss_rising", "overfitting")


class Doctor:
    """Feeds rows to the ``History`` and asks each rule that has not fired yet; ``observe`` returns
    the new findings (each rule fires at most once per run)."""

    def __init__(self, cfg: DoctorConfig | None = None, task: str = "pretraining"):
        self.cfg = cfg or DoctorConfig()
        self.history = History()
        self.findings: list[Finding] = []
        self.skipped = set(LOSS_LEVEL_RULES) if task in SURROGATE_LOSS_TASKS else set()
        self.fired: set[str] = set(self.skipped)  # a skipped rule is never asked

    def observe(self, row: dict) -> list[Finding]:
        kind = self.history.add(row)
        if kind is None or not self.cfg.enabled:
            return []
        new = []
        for name, check in CHECKS.items():
            if name in self.fired or kind not in _TRIGGERS.get(name, ("window",)):
                continue
            finding = check(self.history, self.cfg)
            if finding is not None:
                self.fired.add(name)
                new.append(finding)
        self.findings += new
        return new

    @property
    def judged(self) -> list[str]:
        """The rules this run is judged by (all but those its task's loss makes meaningless)."""
        return [r for r in RULES if r not in self.skipped]

    def replay(self, rows: Iterable[dict]) -> list[Finding]:
        """Observe rows in order (metrics.jsonl's); a ``doctor`` event among them (a finding the
        live run already reported) counts as fired, so a resumed run does not say it twice."""
        found = []
        for row in rows:
            if row.get("event") == "doctor" and row.get("rule") in RULES:
                self.fired.add(row["rule"])
            found += self.observe(row)
        return found


# --- what the loop measures for the rules and the cost line ---------------------------------------

def device_memory_headroom(devices: Iterable[Any]) -> float | None:
    """The smallest free fraction of device memory at its peak over these devices, from the
    backend's ``memory_stats()`` (bytes_limit and peak_bytes_in_use); None where it reports none
    (the CPU backend), so that the memory rule stays silent rather than guess."""
    free = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - backends without the call raise various errors
            stats = None
        if not stats or not stats.get("bytes_limit"):
            continue
        used = stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0))
        free.append(1.0 - used / stats["bytes_limit"])
    return min(free) if free else None


def device_price(device_kind: str, configured: float = 0.0) -> float | None:
    """US$ per device-hour: ``configured`` if set, else the planner's assumed price for the device
    kind ("NVIDIA H100 80GB HBM3" -> h100), else None (a CPU, an unlisted GPU: no cost is shown)."""
    if configured > 0:
        return configured
    from maxlm.hardware import GPUS

    words = device_kind.lower().replace("-", " ").split()
    for key, gpu in GPUS.items():
        if any(word.startswith(key) for word in words):
            return gpu["price"]
    return None


class CostMeter:
    """The live cost line: devices x price per device-hour x elapsed seconds / 3600, plus what a
    resumed run's earlier sessions cost (their last logged cost_usd)."""

    def __init__(self, devices: int, price: float | None, earlier_usd: float = 0.0):
        self.devices, self.price, self.earlier = devices, price, earlier_usd

    def usd(self, elapsed_s: float) -> float | None:
        if self.price is None:
            return None
        return self.earlier + self.devices * self.price * elapsed_s / 3600.0


def last_cost(rows: Iterable[dict]) -> float:
    """The last cost_usd a run logged (0 if none): what its earlier sessions cost."""
    cost = 0.0
    for row in rows:
        value = _number(row, "cost_usd")
        if value is not None and math.isfinite(value) and "event" not in row:
            cost = value
    return cost


# --- the plot of the windows it judged ----------------------------------------------------------

_PANELS = (("loss", "loss (nats/token)", False), ("grad_norm", "gradient norm", True),
           ("step_time_s", "step time (s)", False), ("data_wait_share", "data wait / memory free", False))
_PANEL_OF = {"loss": 0, "eval_loss": 0, "grad_norm": 1, "step_time_s": 2, "data_wait_share": 3,
             "memory_headroom": 3}


def plot(history: History, findings: list[Finding], path: Any, title: str = "") -> Any:
    """A figure of the metrics the rules read, each finding's window shaded on its metric's panel
    and named, non-finite steps marked; saved to ``path``. No pyplot (a notebook's backend stays)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 9))
    axes = fig.subplots(len(_PANELS), 1, sharex=True)
    for ax, (key, label, log) in zip(axes, _PANELS):
        steps, values = history.series(key)
        if len(values):
            ax.plot(steps, values, "-", lw=1, label=key.replace("_", " "))
        if key == "loss" and history.evals:
            ax.plot(*zip(*history.evals), "o-", label="eval loss")
        if key == "data_wait_share":
            mem_steps, mem = history.series("memory_headroom")
            if len(mem):
                ax.plot(mem_steps, mem, "-", lw=1, label="memory headroom")
        if log and len(values) and (values > 0).all():
            ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    colors = iter(["tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan",
                   "tab:gray", "tab:green", "tab:blue"])
    for finding in findings:
        ax, color = axes[_PANEL_OF.get(finding.metric, 0)], next(colors)
        lo, hi = finding.window
        if hi > lo:
            ax.axvspan(lo, hi, color=color, alpha=0.15)
        ax.axvline(finding.step, color=color, ls="--", lw=1, label=f"{finding.rule} (step {finding.step})")
    for s in history.nonfinite:
        axes[0].axvline(s, color="black", ls=":", lw=0.8)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("step")
    verdict = ", ".join(f.rule for f in findings) or "no findings"
    fig.suptitle(f"{title}: {verdict}" if title else verdict, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path
