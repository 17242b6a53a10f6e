"""Host offload (OptimConfig.offload_state / offload_params): the state lives in pinned host memory
between steps, the numbers are the same, the planner counts it, and checkpoints resume it."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from helpers import random_batch, small_config

from maxlm import config, hardware, train
from maxlm.parallel import sharding
from maxlm.plan import memory as plan_memory
from maxlm.plan import planner
from maxlm.train import checkpoint, optim, step, tasks

# fsdp and tensor sharding, gradient accumulation, fp32 (small_config's compute dtype)
MESH, OPTIM = dict(data=2, fsdp=2, tensor=2), dict(microbatches=2)


def _kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _on_device0(tree):
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == jax.devices()[0])


def _run(offload_state=False, offload_params=False, steps=20):
    """20 steps on one fixed batch (as ``helpers.train_losses``), keeping what a resume needs."""
    cfg = small_config(mesh=MESH, optim=dict(OPTIM, offload_state=offload_state, offload_params=offload_params),
                       train=dict(steps=steps), checkpoint=dict(async_save=False))
    mesh = sharding.make_mesh(cfg.mesh.shape(8))
    optimizer = optim.make_optimizer(cfg.optim, cfg.train.steps)
    shardings = step.state_shardings(cfg, mesh, optimizer)
    with jax.set_mesh(mesh):
        batch = step.device_batch(random_batch(np.random.default_rng(0)), mesh, tasks.LM_BATCH)
        state = step.init_state(cfg, optimizer, shardings)
        train_step, eval_step = tasks.lm_steps(cfg, mesh, optimizer, shardings)
        losses = []
        for _ in range(steps):
            state, metrics = train_step(state, batch)
            losses.append(float(metrics["loss"]))
    return SimpleNamespace(cfg=cfg, mesh=mesh, optimizer=optimizer, shardings=shardings, batch=batch,
                           state=state, train_step=train_step, eval_step=eval_step, losses=np.array(losses))


@pytest.fixture(scope="module")
def baseline():
    return _run()


@pytest.fixture(scope="module")
def offloaded():
    return {"state": _run(offload_state=True), "state+params": _run(offload_state=True, offload_params=True)}


@pytest.mark.parametrize("which", ["state", "state+params"])
def test_offloaded_run_gives_the_same_losses_and_keeps_the_state_on_the_host(baseline, offloaded, which):
    run, params = offloaded[which], which == "state+params"
    cfg, losses, state = run.cfg, run.losses, run.state
    want, want_state = baseline.losses, baseline.state
    np.testing.assert_array_equal(losses, want)  # bitwise: the same computation, only stored elsewhere
    assert losses[-1] < losses[0] - 1.0  # and it learns
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _kinds(state.opt_state) == {"pinned_host"}
    assert _kinds(state.params) == {"pinned_host" if params else "device"}
    assert _kinds((state.step, state.loss_scale, state.guard)) == {"device"}
    # The planner reads the same shardings: its host bytes are the real state's on one device.
    est = plan_memory.state_bytes(cfg, cfg.mesh.shape(8))
    assert est["optimizer_host"] == _on_device0(state.opt_state) > 0
    assert est["params_host"] == (_on_device0(state.params) if params else 0)


def test_the_step_copies_the_state_to_the_device_and_back():
    """The copies are inside the jitted step (its in/out shardings are the host ones), where XLA
    schedules them: the lowered step annotates the moves to the device and back to the host."""
    cfg = small_config(mesh=MESH, optim=dict(offload_state=True))
    mesh = sharding.make_mesh(cfg.mesh.shape(8))
    optimizer = optim.make_optimizer(cfg.optim, cfg.train.steps)
    shardings = step.state_shardings(cfg, mesh, optimizer)
    assert {s.memory_kind for s in jax.tree.leaves(shardings.opt_state)} == {"pinned_host"}
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(lambda: step.init_state(cfg, optimizer, shardings))
        args = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
        batch = {k: jax.ShapeDtypeStruct((8, 32), np.float32 if k == "weights" else np.int32, sharding=s)
                 for k, s in step.batch_shardings(tasks.LM_BATCH, mesh).items()}
        train_step, _ = tasks.lm_steps(cfg, mesh, optimizer, shardings)
        text = train_step.lower(args, batch).as_text()
    assert 'mhlo.memory_kind = "pinned_host"' in text  # arguments and results in host memory
    assert "annotate_device_placement" in text  # the moves inside the step


@pytest.mark.parametrize("name", ["llama3_8b.gin", "gpt175b.gin"])
def test_planner_device_bytes_fall_by_the_optimizer_state(name):
    cfg = config.load(name)
    degrees = cfg.mesh.shape(planner.default_gpus(cfg.mesh))
    cfg = cfg.replace(mesh=degrees)
    on = plan_memory.memory(cfg, degrees)
    off = plan_memory.memory(cfg.replace(optim={"offload_state": True}), degrees)
    assert on["host"] == 0 and on["optimizer"] > 0
    assert off["total"] == on["total"] - on["optimizer"]  # the update's copy fits where activations were
    assert off["host"] == on["optimizer"] and off["optimizer"] == 0
    assert off["detail"]["offload_transient"] == 0
    both = plan_memory.memory(cfg.replace(optim={"offload_state": True, "offload_params": True}), degrees)
    # Parameters come back whole for the forward and backward: they stay on the device's peak too.
    assert both["total"] == off["total"] and both["host"] == on["optimizer"] + on["params"]
    text = planner.format_text(planner.plan(cfg.replace(optim={"offload_state": True}), degrees))
    assert "in host memory" in text and "host " in text


def test_planner_counts_the_update_copy_when_it_outgrows_the_activations():
    # Unsharded AdamW moments (data parallel) of a wide model, and one 8-token row per device.
    cfg = small_config(mesh=dict(data=8), model=dict(d_model=256, d_ff=1024), train=dict(global_batch=8, seq_len=8))
    degrees = cfg.mesh.shape(8)
    on = plan_memory.memory(cfg, degrees)
    off = plan_memory.memory(cfg.replace(optim={"offload_state": True}), degrees)
    transient = on["optimizer"] - on["activations"] - on["workspace"]
    assert transient > 0 and off["detail"]["offload_transient"] == transient
    assert off["total"] == on["total"] - on["optimizer"] + transient


def test_planner_suggests_offload_when_the_optimizer_state_is_what_does_not_fit():
    cfg = config.load("llama3_8b.gin")
    degrees = cfg.mesh.shape(64)
    cfg = cfg.replace(mesh=degrees)
    total = plan_memory.memory(cfg, degrees)["total"]
    found = planner.suggestions(cfg, degrees, total - 1)  # a GPU one byte too small
    offload = [s for s in found if s["bindings"] == ["OptimConfig.offload_state=True"]]
    assert offload and offload[0]["total_bytes"] < total


def test_offloaded_state_checkpoints_and_resumes(offloaded, tmp_path):
    """Saved from host memory, restored straight into it (Orbax places each shard by the target
    shardings, memory kind included): the restored run takes the same next steps, bitwise."""
    run = offloaded["state+params"]
    with jax.set_mesh(run.mesh):
        ckpt = checkpoint.Checkpointer(tmp_path, run.cfg.checkpoint, log=lambda _: None)
        ckpt.save(20, run.state, {}, run.cfg.to_dict(), {"tokens_seen": 0})
        ckpt.close()
        saved_eval = float(run.eval_step(run.state.params, run.batch)[0])
        straight, state = [], run.state  # (the fixture's last use of it: the step donates it)
        for _ in range(2):
            state, metrics = run.train_step(state, run.batch)
            straight.append(float(metrics["loss"]))
        ckpt = checkpoint.Checkpointer(tmp_path, run.cfg.checkpoint, log=lambda _: None)
        abstract = jax.eval_shape(lambda: step.init_state(run.cfg, run.optimizer, run.shardings))
        found = ckpt.restore_latest_good(abstract, run.shardings)
        ckpt.close()
        assert found is not None and found[0] == 20
        restored = found[1]
        assert _kinds(restored.opt_state) == _kinds(restored.params) == {"pinned_host"}
        assert float(run.eval_step(restored.params, run.batch)[0]) == saved_eval  # eval reads host params
        resumed = []
        for _ in range(2):
            restored, metrics = run.train_step(restored, run.batch)
            resumed.append(float(metrics["loss"]))
    assert resumed == straight
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_offloaded_run_checkpoints_and_resumes(tmp_path):
    """The loop with offloaded state and parameters: evaluation, checkpoints; a run resumed from
    its step-2 checkpoint (restored straight into host memory) repeats steps 3-4 exactly."""
    cfg = small_config(mesh=dict(data=4, fsdp=2), optim=dict(offload_state=True, offload_params=True),
                       train=dict(steps=4, eval_every=2, eval_batches=1, log_every=1, run_dir=str(tmp_path / "run"),
                                  sample_tokens=8),  # sampling reads the parameters outside the step
                       checkpoint=dict(every_steps=2, async_save=False))
    first = train.train(cfg)
    assert first["last_step"] == 4 and len(first["eval_losses"]) == 3 and first["sample"]
    again = train.train(cfg, resume_from="2")
    assert again["first_step"] == 2 and again["last_step"] == 4
    assert again["loss"] == first["loss"] and again["eval_losses"][-1] == first["eval_losses"][-1]


def test_a_backend_without_host_memory_is_refused_in_one_line(monkeypatch):
    class Memory:
        kind = "device"

    class Device:
        platform = "fake"

        def addressable_memories(self):
            return [Memory()]

    assert hardware.host_memory_problem() is None  # the CPU backend has pinned_host
    assert hardware.host_memory_problem([Device()]) == "the fake backend has no 'pinned_host' memory (it has device)"
    monkeypatch.setattr(hardware, "host_memory_problem", lambda: "the fake backend has no 'pinned_host' memory")
    small_config(optim=dict(offload_state=True), num_devices=None)  # checked only against devices
    with pytest.raises(config.ConfigError) as err:
        small_config(optim=dict(offload_state=True))
    assert str(err.value) == ("<bindings>: OptimConfig.offload_state = True needs host memory, but the fake "
                              "backend has no 'pinned_host' memory; set it to False")
