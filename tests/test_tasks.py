"""A new task trains through the shared loop without touching the step or the loop; frozen
parameters get no gradient, no optimizer state and no change."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from helpers import small_config
from maxlm import model
from maxlm.parallel import sharding
from maxlm.train import loop, optim, step, tasks


def label_smoothed_task(cfg, forward, smoothing=0.1):
    """Cross-entropy against (1 - s) one-hot + s uniform targets: a task in a few lines."""
    def loss_fn(params, batch, rng):
        logits, _ = forward(params, batch["inputs"], batch["segment_ids"], batch["positions"])
        nll, log_z = model.token_nll(logits, batch["targets"], cfg.model.vocab_size)
        uniform = log_z - jnp.mean(logits[..., :cfg.model.vocab_size].astype(jnp.float32), axis=-1)
        per_token = (1 - smoothing) * nll + smoothing * uniform
        return jnp.sum(per_token * batch["weights"]), jnp.sum(batch["weights"]), {"nll": jnp.sum(nll * batch["weights"])}
    train_batches, eval_batches = tasks.open_lm_data(cfg)
    return tasks.Task("label_smoothing", loss_fn, tasks.LM_BATCH, train_batches, eval_batches)


def _config(run_dir, steps):
    return small_config(
        num_devices=8, train=dict(steps=steps, run_dir=str(run_dir), eval_every=4, log_every=2, eval_batches=1,
                                  sample_tokens=0, global_batch=8, seq_len=32),
        checkpoint=dict(every_steps=4, async_save=False),
        optim=dict(schedule="constant", warmup_steps=0))  # the learning rate does not depend on steps


def _run(cfg, make_task):
    mesh = sharding.make_mesh(cfg.mesh.shape(8))
    return loop.run(cfg, make_task(cfg, step.model_forward(cfg, mesh)), mesh)


def test_a_new_task_trains_resumes_and_evaluates_through_the_shared_loop(tmp_path):
    whole = _run(_config(tmp_path / "whole", 8), label_smoothed_task)
    first = _run(_config(tmp_path / "split", 4), label_smoothed_task)
    resumed = _run(_config(tmp_path / "split", 8), label_smoothed_task)
    assert first["last_step"] == 4 and resumed["first_step"] == 4 and resumed["last_step"] == 8
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir()) == ["4", "8"]
    rows = lambda d: [json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
    losses = lambda d: {r["step"]: r["loss"] for r in rows(d) if "loss" in r}
    assert losses("split") == losses("whole")  # resumed exactly, step for step
    assert all("nll" in r for r in rows("whole") if "loss" in r)  # the task's own metric is logged
    assert whole["eval_losses"][-1][1] < whole["eval_losses"][0][1]
    assert resumed["eval_losses"] == [e for e in whole["eval_losses"] if e[0] > 4]


def _frozen_embedding(cfg, forward):
    task = tasks.pretraining(cfg, forward)
    return tasks.Task(task.name, task.loss_fn, task.batch_spec, task.train_batches, task.eval_batches,
                      trainable=lambda params: {k: jax.tree.map(lambda _: k != "embed", v) for k, v in params.items()})


def test_a_frozen_subtree_gets_no_gradient_no_optimizer_state_and_no_change(tmp_path):
    cfg = _config(tmp_path, 4)
    mesh = sharding.make_mesh(cfg.mesh.shape(8))
    task = _frozen_embedding(cfg, step.model_forward(cfg, mesh))
    optimizer = optim.make_optimizer(cfg.optim, cfg.train.steps)
    shardings = step.state_shardings(cfg, mesh, optimizer, task.trainable)
    with jax.set_mesh(mesh):
        state = step.init_state(cfg, optimizer, shardings, trainable=task.trainable)
        before = jax.tree.map(np.asarray, state.params)
        n_params = sum(x.size for x in jax.tree.leaves(state.params))
        n_embed = state.params["embed"].size
        # AdamW keeps two moments per trainable parameter, and nothing for the frozen table.
        assert sum(x.size for x in jax.tree.leaves(state.opt_state)) - 2 == 2 * (n_params - n_embed)
        train_step, _ = step.compile_steps(cfg, mesh, optimizer, shardings, task.loss_fn, task.batch_spec,
                                           task.trainable)
        batch = step.device_batch(next(iter(task.train_batches())), mesh, task.batch_spec)
        hlo = train_step.lower(state, batch).as_text()
        for _ in range(3):
            state, metrics = train_step(state, batch)
    assert int(metrics["skipped"]) == 0
    np.testing.assert_array_equal(np.asarray(state.params["embed"]), before["embed"])
    assert not np.array_equal(np.asarray(state.params["lm_head"]["kernel"]), before["lm_head"]["kernel"])
    # The embedding lookup's gradient is a scatter-add into the table: the frozen step has one fewer.
    full = step.compile_steps(cfg, mesh, optimizer, step.state_shardings(cfg, mesh, optimizer),
                              task.loss_fn, task.batch_spec)[0]
    with jax.set_mesh(mesh):
        full_state = step.init_state(cfg, optimizer, step.state_shardings(cfg, mesh, optimizer))
        full_hlo = full.lower(full_state, batch).as_text()
    assert hlo.count("\"stablehlo.scatter\"") == full_hlo.count("\"stablehlo.scatter\"") - 1
