"""The training loop, for any task: data, eval, checkpoints, preemption, rollback, metrics, progress.

``run(cfg, task, mesh)`` restores the latest good checkpoint (or ``resume_from``), else starts at
step 0 from ``TrainConfig.init_params``, from the parameters of the checkpoint
``TrainConfig.init_from`` names (a warm start: fresh optimizer state), or from random ones; then steps until ``TrainConfig.steps``: every ``log_every`` steps it logs the window's mean loss,
every ``eval_every`` it evaluates, and it saves as ``CheckpointConfig`` says, on preemption and at
the end. Everything inside jit is in ``maxlm.train.step``; this file holds the side effects.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from maxlm import model, storage
from maxlm.config import Config, ConfigError, operative_gin
from maxlm.model import lora
from maxlm.train import checkpoint, doctor, metrics, optim, step
from maxlm.train.resilience import Goodput, Preemption, Rollback, TrainingError
from maxlm.train.rundir import RunDirectory, check_writable
from maxlm.train.tasks import Task


def say(msg: str) -> None:
    if jax.process_index() == 0:
        tqdm.write(msg)


def _test_nan_steps() -> set[int]:
    """Fault injection for tests: MAXLM_TEST_NAN_STEPS=5,9 poisons the batches of those steps."""
    return {int(s) for s in os.environ.get("MAXLM_TEST_NAN_STEPS", "").split(",") if s.strip()}


def _resume_source(cfg: Config, ckpt, resume_from: str) -> tuple[Any, int | None]:
    """(checkpointer, step) named by --resume_from: STEP, RUN_DIR or RUN_DIR/checkpoints/STEP
    (step None: that run's latest good one)."""
    if resume_from.isdigit():
        return ckpt, int(resume_from)
    path = storage.absolute(resume_from)
    if (path / "checkpoints").is_dir():
        return checkpoint.Checkpointer(path, cfg.checkpoint, log=say), None
    if not (path.name.isdigit() and path.is_dir()):
        raise TrainingError(f"--resume_from={resume_from}: expected STEP, RUN_DIR or RUN_DIR/checkpoints/STEP")
    return checkpoint.Checkpointer(path.parent.parent, cfg.checkpoint, log=say), int(path.name)


def _restore(cfg, ckpt, resume_from, abstract, shardings):
    """(step, state, data_state, source) from --resume_from or the latest good checkpoint; None if none."""
    if resume_from is None:
        found = ckpt.restore_latest_good(abstract, shardings) if ckpt else None
        return None if found is None else (*found[:3], ckpt.directory / str(found[0]))
    source, step_n = _resume_source(cfg, ckpt, resume_from)
    if step_n is None:
        found = source.restore_latest_good(abstract, shardings)
        if found is None:
            raise TrainingError(f"--resume_from={resume_from}: no usable checkpoint in {source.directory}")
        return (*found[:3], source.directory / str(found[0]))
    if source is None or step_n not in source.steps():
        raise TrainingError(f"--resume_from={resume_from}: no checkpoint of step {step_n}")
    problem = source.problem(step_n)
    if problem:
        raise TrainingError(f"--resume_from={resume_from}: checkpoint {source.directory / str(step_n)} is {problem}")
    state, data_state, _ = source.restore(step_n, abstract, shardings)
    if ckpt is not None:
        ckpt.supersede_after(step_n if source is ckpt else -1)
    return step_n, state, data_state, source.directory / str(step_n)


def _has_checkpoints(run_dir: Path) -> bool:
    ckpts = run_dir / "checkpoints"
    return ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())


def warm_start_dir(cfg: Config) -> Path:
    """The checkpoint folder TrainConfig.init_from names (a run directory: its newest good
    checkpoint; or RUN_DIR/checkpoints/STEP), checked; a ConfigError (one line) if unusable."""
    where = f"{cfg.source}: TrainConfig.init_from = {cfg.train.init_from!r}"
    path = storage.absolute(cfg.train.init_from)
    if not path.exists():
        raise ConfigError(f"{where} does not exist (expected a run directory or RUN_DIR/checkpoints/STEP)")
    if (path / "checkpoints").is_dir():
        steps = sorted((int(p.name) for p in (path / "checkpoints").iterdir() if p.name.isdigit()), reverse=True)
        problems = []
        for s in steps:
            problem = checkpoint.checkpoint_problem(path / "checkpoints" / str(s))
            if problem is None:
                return path / "checkpoints" / str(s)
            problems.append(f"{s}: {problem}")
        raise ConfigError(f"{where}: no usable checkpoint in {path / 'checkpoints'}"
                          + (f" ({'; '.join(problems[:3])})" if problems else ""))
    if path.name.isdigit() and (path / "state").is_dir():
        problem = checkpoint.checkpoint_problem(path)
        if problem:
            raise ConfigError(f"{where}: checkpoint {path} is {problem}")
        return path
    raise ConfigError(f"{where} is neither a run directory (with checkpoints/) nor a checkpoint "
                      "(RUN_DIR/checkpoints/STEP)")


def check_warm_start(cfg: Config, step_dir: Path, abstract_params: Any) -> bool:
    """One line naming the first parameter whose shape in ``step_dir`` differs from the model's.
    Returns whether the checkpoint is a base without this model's LoRA adapters (they start fresh)."""
    import orbax.checkpoint as ocp

    where = f"{cfg.source}: TrainConfig.init_from = {cfg.train.init_from!r}"
    try:
        saved = ocp.PyTreeCheckpointHandler().metadata(step_dir / "state")
        saved = checkpoint._shapes(getattr(saved, "tree", saved)["params"])
        saved = {k: v for k, v in saved.items() if k.split("/")[0] != step.TASK_PARAMS}  # never carried over
    except Exception as err:  # noqa: BLE001 - Orbax/tensorstore raise many types for damaged files
        raise ConfigError(f"{where}: cannot read the parameters of {step_dir} ({type(err).__name__}: "
                          f"{' '.join(str(err).split())[:200]})") from None
    base_only = bool(cfg.model.lora_rank) and not any(k.split("/")[-1] in lora.ADAPTER_LEAVES for k in saved)
    wanted = checkpoint._shapes(lora.without_adapters(abstract_params) if base_only else abstract_params)
    diffs = [f"parameter {k} is {saved[k]} there but {v} in this config's model" if k in saved
             else f"parameter {k} of this config's model is missing there" for k, v in wanted.items()
             if saved.get(k) != v]
    diffs += [f"parameter {k} there is not in this config's model" for k in saved if k not in wanted]
    if diffs:
        more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
        raise ConfigError(f"{where}: {step_dir} does not fit ModelConfig: {diffs[0]}{more}")
    return base_only


def _window_metrics(fetched: list[dict]) -> dict[str, float]:
    """What one logging window reports: the mean loss over its applied steps (the trend, not the
    last step's noise), the last grad norm, learning rate and loss scale, and the skips."""
    kept = [float(m["loss"]) for m in fetched if not int(m["skipped"])]
    loss = float(np.mean(kept)) if kept else float("nan")
    last = fetched[-1]
    out = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)) if kept else float("nan"),
           "grad_norm": float(last["grad_norm"]), "lr": float(last["lr"]),
           "skipped": int(sum(int(m["skipped"]) for m in fetched)), "loss_scale": float(last["loss_scale"])}
    extra = [k for k in last if k not in ("loss", "grad_norm", "lr", "skipped", "spike", "bad_streak",
                                          "loss_scale", "tokens")]
    out.update({k: float(np.mean([float(m[k]) for m in fetched])) for k in extra})
    return out


class Loop:
    """One run of a task. ``run()`` returns the summary; see the module docstring."""

    def __init__(self, cfg: Config, task: Task, mesh: Mesh):
        self.cfg, self.task, self.mesh, tc = cfg, task, mesh, cfg.train
        self.goodput = Goodput()
        self.run_dir = storage.path(tc.run_dir)
        self.tokens_per_step = tc.global_batch * tc.seq_len
        self.optimizer = optim.make_optimizer(cfg.optim, tc.steps)
        self.shardings = step.state_shardings(cfg, mesh, self.optimizer, task.trainable, task.params)
        self.eval_losses: list[tuple[int, float]] = []
        self.eval_metrics: list[tuple[int, dict[str, float]]] = []  # what each evaluation logged beside the loss
        self.steps_run = self.redone = 0

    def start_state(self, resume_from: str | None) -> tuple[int, Any, bool]:
        """(first step, state, restored?) from a checkpoint, TrainConfig.init_params, or random."""
        cfg, tc = self.cfg, self.cfg.train
        self.abstract = jax.eval_shape(lambda: step.init_state(cfg, self.optimizer, self.shardings,
                                                               trainable=self.task.trainable,
                                                               task_params=self.task.params))
        restored = _restore(cfg, self.ckpt, resume_from, self.abstract, self.shardings)
        if restored is not None:
            first, state, data_state, source = restored
            try:
                self.batches.set_state(data_state)
            except ValueError as err:  # the pipeline refuses a state saved under another data config
                raise TrainingError(f"cannot resume the data pipeline from {source}: {err}") from None
            say(f"resuming from {source} (step {first})")
            self.recorder.event(first, "resume", source=str(source), redo_steps=max(self.previous - first, 0))
            return first, state, True
        params = None
        # Only the model's parameters are read: a task's own (step.TaskParams) start fresh.
        abstract, shards = step.model_part(self.abstract.params), step.model_part(self.shardings.params)
        # A LoRA run starts from a base without adapters (imported, or a plain run): they start fresh.
        base = lambda tree: lora.without_adapters(tree) if cfg.model.lora_rank else tree
        if tc.init_params:
            params = checkpoint.restore_params(tc.init_params, base(abstract), base(shards))
            say(f"initialised parameters from {tc.init_params}")
        elif tc.init_from:  # parameters only: the optimizer starts fresh, at step 0
            step_dir = getattr(self, "warm_dir", None)  # found and checked by run() before the run dir is touched
            if step_dir is None:
                step_dir = warm_start_dir(cfg)
                self.warm_base_only = check_warm_start(cfg, step_dir, abstract)
            only = base if self.warm_base_only else (lambda tree: tree)
            params = checkpoint.restore_state_params(step_dir, only(abstract), only(shards))
            say(f"warm start: parameters from {step_dir}" + (" (LoRA adapters start fresh)" if self.warm_base_only else ""))
        return 0, step.init_state(cfg, self.optimizer, self.shardings, params, self.task.trainable,
                                  self.task.params), False

    def device_params(self) -> Any:
        """The parameters in device memory, for what computes with them outside the train and eval
        steps (sampling, evaluation tasks, rollouts): a copy when OptimConfig.offload_params keeps
        them in host memory, else the state's own."""
        return step.device_params(self.state.params, self.shardings)

    def describe(self, first: int) -> None:
        cfg, tc, mesh = self.cfg, self.cfg.train, self.mesh
        from maxlm.parallel import pipeline_parallel

        n_params = sum(x.size for x in jax.tree.leaves(self.state.params))
        mask = step.trainable_mask(self.state.params, self.task.trainable)
        n_train = sum(x.size for x, m in zip(jax.tree.leaves(self.state.params), jax.tree.leaves(mask)) if m)
        self.flops_per_token = model.flops_per_token(cfg.model, tc.seq_len)
        self.peak = tc.peak_flops or metrics.measure_peak_flops(cfg.model.dtype)
        bubble = pipeline_parallel.bubble_fraction(mesh.shape["pipeline"], cfg.mesh.pipeline_microbatches,
                                                   cfg.mesh.pipeline_repeats)
        self.recorder.record_run({"config": cfg.source, "task": self.task.name, "params": n_params,
                                  "trainable_params": n_train,
                                  "devices": jax.device_count(), "mesh": dict(mesh.shape),
                                  "peak_flops_per_device": self.peak, "flops_per_token": self.flops_per_token,
                                  "pipeline_bubble": bubble})
        if first >= tc.steps:
            say(f"{self.run_dir} is already at step {first} of {tc.steps}: nothing to train "
                "(raise TrainConfig.steps to continue, or pick a new --run_dir)")
        if cfg.model.lora_rank:
            say(f"LoRA rank {cfg.model.lora_rank} on {', '.join(cfg.model.lora_paths())}: {n_train:,} trainable "
                f"of {n_params:,} parameters ({n_train / n_params:.2%}); frozen base "
                f"{lora.base_bytes(self.state.params) / 2**20:.2f} MiB as stored")
        say(f"maxlm: {self.task.name}, {n_params / 1e6:.2f}M parameters, mesh {dict(mesh.shape)}, "
            f"{tc.global_batch}x{tc.seq_len} tokens/step, steps {first}->{tc.steps}, run_dir {self.run_dir}"
            + (f", pipeline bubble {bubble:.1%}" if mesh.shape["pipeline"] > 1 else ""))
        if cfg.model.attention_impl == "pallas" and jax.default_backend() != "gpu":
            say(f"note: ModelConfig.attention_impl = 'pallas' on {jax.default_backend()}: the flash attention "
                "kernel runs in Pallas interpret mode (exact, and many times slower than 'xla'); it compiles on GPUs")

    def evaluate(self, at_step: int) -> float:
        """Evaluate and log; returns the seconds it took (not training throughput)."""
        jax.block_until_ready(self.state)  # finish pending steps first: their time is training's
        start = time.perf_counter()
        with self.goodput.timed("eval"):
            total = weight = 0.0
            for batch in self.eval_data:
                loss_sum, w = jax.device_get(self.eval_step(self.state.params, batch))
                total, weight = total + float(loss_sum), weight + float(w)
            loss = total / max(weight, 1.0)
            tasks = self.task_metrics(at_step)
            if self.task.eval_metrics is not None:
                tasks.update({f"eval/{k}": v for k, v in self.task.eval_metrics(self.device_params()).items()})
        logged = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))} if self.eval_data else {}
        if self.eval_data:
            self.eval_losses.append((at_step, loss))
        self.eval_metrics.append((at_step, tasks))
        self.recorder.log(at_step, {**logged, **tasks})
        self.diagnose({"step": at_step, **logged, **tasks})
        shown = [f"eval loss {loss:.4f}"] if self.eval_data else []
        shown += [f"{k.removeprefix('eval/')} {v:.4g}" for k, v in tasks.items()]
        say(f"step {at_step}: " + ", ".join(shown))
        return time.perf_counter() - start

    def open_eval_tasks(self) -> list:
        """TrainConfig.eval_tasks, read now so that a bad task file stops the run before step 1."""
        if not self.cfg.train.eval_tasks:
            return []
        from maxlm.eval import TaskError
        from maxlm.eval.evaluator import Evaluator

        try:
            self.evaluator, tasks = Evaluator.for_training(self.cfg, self.mesh, step.model_forward(self.cfg, self.mesh))
        except TaskError as err:
            raise TrainingError(f"TrainConfig.eval_tasks: {err}") from None
        return tasks

    def task_metrics(self, at_step: int) -> dict[str, float]:
        """The eval tasks' logged metrics. A task that fails here (a prompt or continuation that does
        not fit the context, say) does not stop training: one line, and it is skipped from then on."""
        from maxlm.eval import TaskError

        out: dict[str, float] = {}
        for task in list(self.eval_tasks):
            try:
                out.update(self.evaluator.logged([task], self.device_params()))
            except TaskError as err:  # Evaluator.run turns PromptError and other ValueErrors into one
                self.eval_tasks.remove(task)
                reason = " ".join(str(err).split())
                say(f"step {at_step}: eval task {task.name} failed and is skipped from now on: {reason}")
                self.recorder.event(at_step, "eval_task_skipped", task=task.name, reason=reason)
        return out

    def save(self, at_step: int) -> float:
        """Start a checkpoint; returns the seconds the loop was blocked."""
        jax.block_until_ready(self.state)
        start = time.perf_counter()
        with self.goodput.timed("checkpoint"):
            self.ckpt.save(at_step, self.state, self.batches.get_state(), self.cfg.to_dict(),
                           {"tokens_seen": at_step * self.tokens_per_step})
        return time.perf_counter() - start

    def log_window(self, done: int, window: list, timed: int, t_window: float) -> None:
        fetched = jax.device_get(window)  # waits for the window's steps to finish
        elapsed = max(time.perf_counter() - t_window, 1e-9)  # so measured only now
        logged = _window_metrics(fetched)
        self.last_loss = logged["loss"]
        # What the run doctor reads beyond the loss: the window's share of time waiting for batches,
        # the device memory left at peak (backends that report it), and the cost so far.
        waited, self.data_seen = self.goodput.seconds["data"] - self.data_seen, self.goodput.seconds["data"]
        logged["data_wait_share"] = min(waited / elapsed, 1.0)
        headroom = doctor.device_memory_headroom(jax.local_devices())
        if headroom is not None:
            logged["memory_headroom"] = headroom
        cost = self.cost.usd(time.perf_counter() - self.goodput.start)
        if cost is not None:
            logged["cost_usd"] = cost
        if timed:
            tokens_per_s = timed * self.tokens_per_step / elapsed
            logged.update(tokens_per_s=tokens_per_s, step_time_s=elapsed / timed,
                          mfu=tokens_per_s * self.flops_per_token / (self.peak * jax.device_count()))
            self.progress.set_postfix(loss=f"{logged['loss']:.3f}", tok_s=f"{tokens_per_s:,.0f}",
                                      mfu=f"{logged['mfu']:.1%}", **({} if cost is None else {"cost": f"${cost:,.2f}"}))
        self.recorder.log(done, logged)
        self.diagnose({"step": done, **logged})
        for offset, m in enumerate(fetched):
            if int(m["skipped"]):
                at = done - len(fetched) + offset + 1
                reason = "spike" if int(m["spike"]) else "non-finite"
                self.recorder.event(at, "skipped_step", reason=reason, step_loss=float(m["loss"]),
                                    step_grad_norm=float(m["grad_norm"]))
                self.diagnose({"step": at, "event": "skipped_step", "reason": reason})
                say(f"step {at}: skipped the update ({reason} loss {float(m['loss']):.4g}, "
                    f"grad norm {float(m['grad_norm']):.4g})")
        self.window_fetched = fetched

    def start_doctor(self, history: list[dict]) -> None:
        """The run doctor (maxlm/train/doctor.py), told what metrics.jsonl already holds
        (``history``) so that a resumed run judges its whole history and repeats no finding; and
        the cost meter, at TrainConfig.price_per_device_hour or the planner's price for this device kind."""
        self.doctor = doctor.Doctor(self.cfg.doctor, self.task.name)
        self.doctor.replay(history)
        price = doctor.device_price(jax.devices()[0].device_kind, self.cfg.train.price_per_device_hour)
        self.cost = doctor.CostMeter(jax.device_count(), price, doctor.last_cost(history))
        self.data_seen = 0.0

    def diagnose(self, row: dict) -> None:
        """Show the doctor a row just logged; a rule that fires says so once: a line, a ``doctor``
        event in metrics.jsonl and a TensorBoard text."""
        for finding in self.doctor.observe(row):
            say(finding.line())
            self.recorder.event(finding.step, "doctor", **finding.as_event())
            self.recorder.text(f"doctor/{finding.rule}", finding.line(), finding.step)

    def restore_before(self, before: int) -> tuple[int, Any] | None:
        """(step, state) of the newest good checkpoint before a step, for rollbacks."""
        with self.goodput.timed("checkpoint"):
            self.ckpt.wait()
            found = self.ckpt.restore_latest_good(self.abstract, self.shardings, before=before)
        return None if found is None else found[:2]

    def roll_back(self, done: int) -> int:
        # The model goes back; the data stream does not (as in PaLM): the batches that led into
        # the divergence are skipped rather than replayed.
        back, self.state = self.rollback(done, str(self.run_dir / "metrics.jsonl"))
        lr_scale = float(self.state.guard.lr_scale)
        self.recorder.event(done, "rollback", to_step=back, lr_scale=lr_scale)
        say(f"step {done}: {self.cfg.train.rollback_after} bad steps in a row; rolled back to step {back} "
            f"with the learning rate scaled by {lr_scale:.3g}; skipping the {done - back} batches since")
        self.progress.n = back
        self.progress.refresh()
        return back

    def train(self, first: int, redo_until: int) -> tuple[int, str | None]:
        """Step from ``first`` to TrainConfig.steps; returns (last step, preemption signal or None)."""
        tc, nan_steps = self.cfg.train, _test_nan_steps()
        window, timed, done, preempted = [], 0, first, None
        t_window = time.perf_counter()
        while done < tc.steps:
            with self.goodput.timed("data"):
                batch = next(self.batches)
            if self.task.rollout is not None:  # RL: the batch is sampled from the current policy
                with self.goodput.timed("rollout"):
                    batch = self.task.rollout(self.device_params(), batch, done)
            if done + 1 in nan_steps:  # each injected fault fires once
                nan_steps.discard(done + 1)
                key = self.task.weight_key
                batch = {**batch, key: batch[key] * np.float32("nan")}
            self.state, step_metrics = self.train_step(
                self.state, step.device_batch(batch, self.mesh, self.task.batch_spec))
            window.append(step_metrics)
            done += 1
            self.steps_run += 1
            timed += self.steps_run > 1  # the first step's time is compilation, not throughput
            self.redone += done <= redo_until
            self.progress.update(1)
            if self.steps_run == 1:
                jax.block_until_ready(self.state)
                self.goodput.add("startup", time.perf_counter() - self.goodput.start - sum(self.goodput.seconds.values()))
                t_window, self.data_seen = time.perf_counter(), self.goodput.seconds["data"]
            if done % tc.log_every == 0 or done == tc.steps:
                self.log_window(done, window, timed, t_window)
                window, timed, t_window = [], 0, time.perf_counter()
                if self.rollback.due(self.window_fetched):
                    redo_until, done = max(redo_until, done), self.roll_back(done)
                    continue
            if done % tc.eval_every == 0 or done == tc.steps:
                t_window += self.evaluate(done)  # evaluation time is not training throughput
            if self.preemption.requested(done):
                preempted = self.preemption.signal_name or "preemption notice"
            if self.ckpt and (self.ckpt.due(done) or done == tc.steps or preempted):
                t_window += self.save(done)
            if preempted:
                break
        return done, preempted

    def run(self, resume_from: str | None = None, fresh: bool = False) -> dict[str, Any]:
        """Train, holding the run directory's lock throughout."""
        self.warm_dir, self.warm_base_only = None, False
        if self.cfg.train.init_from and resume_from is None and (fresh or not _has_checkpoints(self.run_dir)):
            # Checked before the run directory is touched; a resumed run never reads it.
            self.warm_dir = warm_start_dir(self.cfg)
            self.warm_base_only = check_warm_start(self.cfg, self.warm_dir, model.abstract_params(self.cfg.model))
        with RunDirectory(self.run_dir, writer=jax.process_index() == 0, log=say) as run_dir, run_dir.library_log():
            if fresh:
                run_dir.set_aside_checkpoints()
            self.previous = run_dir.previous_progress()
            self.ckpt = None
            if self.cfg.checkpoint.enabled:
                if run_dir.writer:
                    check_writable(self.run_dir / "checkpoints")  # fail now, not at the first save
                self.ckpt = checkpoint.Checkpointer(self.run_dir, self.cfg.checkpoint, log=say)
            try:
                return self._run(run_dir, resume_from)
            except BaseException:
                if hasattr(self, "progress"):
                    self.progress.close()
                if hasattr(self, "recorder"):  # what was logged reaches metrics.jsonl (and a bucket)
                    with contextlib.suppress(Exception):
                        self.recorder.close()
                if self.ckpt is not None:  # stop Orbax's threads before the error leaves the loop
                    self.ckpt.abandon()
                raise

    def _run(self, run_dir: RunDirectory, resume_from: str | None) -> dict[str, Any]:
        cfg, tc, mesh = self.cfg, self.cfg.train, self.mesh
        self.start_doctor(run_dir.history())  # what was logged before this session appends to it
        self.recorder = metrics.RunRecorder(run_dir.local, on_write=run_dir.sync)
        self.batches = self.task.train_batches()
        self.rollback = Rollback(tc, self.restore_before)
        self.last_loss = float("nan")
        with jax.set_mesh(mesh), Preemption() as self.preemption:
            self.eval_tasks = self.open_eval_tasks()  # a bad task file fails before any restore or compile
            first, self.state, restored = self.start_state(resume_from)
            run_dir.write_config(operative_gin(cfg))  # only once the restore was accepted
            redo_until = max(self.previous, first) if restored else 0
            self.train_step, self.eval_step = step.compile_steps(
                cfg, mesh, self.optimizer, self.shardings, self.task.loss_fn, self.task.batch_spec,
                self.task.trainable, self.task.weight_key)
            self.eval_data = [step.device_batch(b, mesh, self.task.batch_spec) for b in self.task.eval_batches()]
            self.describe(first)
            if first == 0 and first < tc.steps:
                self.evaluate(0)  # the baseline the run is judged against
            self.progress = tqdm(total=tc.steps, initial=first, desc=self.task.name,
                                 disable=jax.process_index() != 0, dynamic_ncols=True)
            done, preempted = self.train(first, redo_until)
            self.progress.close()
            self.batches.close()
            if self.ckpt:
                with self.goodput.timed("checkpoint"):
                    self.ckpt.close()  # waits for the last save: never exit with a checkpoint in flight
            text = self.finish(done, preempted)
        return self.summary(first, done, preempted, text)

    def finish(self, done: int, preempted: str | None) -> str:
        """Report a preemption, or print the task's closing sample."""
        if preempted:
            self.recorder.event(done, "preempted", signal=preempted)
            where = f"saved step {done} in {self.ckpt.directory}" if self.ckpt else "checkpoints are disabled: nothing saved"
            say(f"stopped by {preempted} after step {done}: {where}; rerun the same command to resume")
            return ""
        if self.task.sample is None:
            return ""
        text = self.task.sample(self.device_params())
        say("sample:\n" + text)
        return text

    def summary(self, first: int, done: int, preempted: str | None, text: str) -> dict[str, Any]:
        account = self.goodput.summary(self.steps_run, self.redone)
        self.recorder.log(done, {f"goodput/{k}": v for k, v in account.items()})
        plot = self.recorder.plot()
        self.recorder.close()
        breakdown = ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in account.items() if k.endswith("_s") and k != "wall_s")
        say(f"done: steps {first}->{done} in {account['wall_s']:.1f}s, goodput {account['goodput']:.1%} ({breakdown})")
        return {"run_dir": str(self.run_dir), "first_step": first, "last_step": done, "loss": self.last_loss,
                "eval_losses": self.eval_losses, "eval_metrics": self.eval_metrics, "skipped_steps": int(self.state.guard.skipped),
                "rollbacks": self.rollback.count, "preempted": preempted, "sample": text, "goodput": account,
                "loss_png": str(self.run_dir / plot.name) if plot else None}


def run(cfg: Config, task: Task, mesh: Mesh, resume_from: str | None = None, fresh: bool = False) -> dict[str, Any]:
    """Train ``task`` as ``cfg`` says on ``mesh`` (resuming if the run directory has checkpoints)."""
    return Loop(cfg, task, mesh).run(resume_from, fresh)
