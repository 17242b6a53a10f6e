"""Checkpoint behaviour in-process: resharding restore, mismatches, bad steps, failed saves."""

import json
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import random_batch, small_config

from maxlm import config, train
from maxlm.parallel import sharding
from maxlm.train import checkpoint, optim, resilience, step, tasks

MESHES = {"8x1x1x1": dict(data=8), "1x2x4x1": dict(data=1, fsdp=2, tensor=4), "single": dict(data=1)}


def _setup(degrees, devices, **model):
    cfg = small_config(num_devices=len(devices), mesh=degrees, model=model)
    mesh = sharding.make_mesh(cfg.mesh.shape(len(devices)), devices)
    opt = optim.make_optimizer(cfg.optim, cfg.train.steps)
    return cfg, mesh, opt, step.state_shardings(cfg, mesh, opt)


def _next_loss(ckpt_dir, degrees, devices):
    """Restore step 3 onto a mesh and take one more step: its loss."""
    cfg, mesh, opt, shardings = _setup(degrees, devices)
    ckpt = checkpoint.Checkpointer(ckpt_dir, cfg.checkpoint)
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(lambda: step.init_state(cfg, opt, shardings))
        found = ckpt.restore_latest_good(abstract, shardings)
        assert found is not None and found[0] == 3
        state = found[1]
        assert state.params["embed"].sharding == shardings.params["embed"]  # placed directly
        train_step, _ = tasks.lm_steps(cfg, mesh, opt, shardings)
        batch = random_batch(np.random.default_rng(7))
        _, m = train_step(state, step.device_batch(batch, mesh, tasks.LM_BATCH))
    ckpt.close()
    return float(m["loss"])


@pytest.fixture(scope="module")
def saved_on_data_parallel(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("saved")
    cfg, mesh, opt, shardings = _setup(MESHES["8x1x1x1"], jax.devices())
    ckpt = checkpoint.Checkpointer(run_dir, cfg.checkpoint)
    with jax.set_mesh(mesh):
        state = step.init_state(cfg, opt, shardings)
        train_step, _ = tasks.lm_steps(cfg, mesh, opt, shardings)
        for i in range(3):
            state, _ = train_step(state, step.device_batch(random_batch(np.random.default_rng(i)), mesh, tasks.LM_BATCH))
        ckpt.save(3, state, {"note": "data"}, cfg.to_dict(), {"tokens_seen": 3 * 8 * 32})
    ckpt.close()
    return run_dir


@pytest.mark.slow
def test_restore_onto_another_mesh_gives_the_same_next_step(saved_on_data_parallel):
    original = _next_loss(saved_on_data_parallel, MESHES["8x1x1x1"], jax.devices())
    resharded = _next_loss(saved_on_data_parallel, MESHES["1x2x4x1"], jax.devices())
    single = _next_loss(saved_on_data_parallel, MESHES["single"], jax.devices()[:1])
    assert resharded == pytest.approx(original, abs=1e-5) and single == pytest.approx(original, abs=1e-5)


def test_manifest_records_step_tokens_config_and_hashes(saved_on_data_parallel):
    manifest = json.loads((saved_on_data_parallel / "checkpoints" / "3" / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["tokens_seen"] == 768 and len(manifest["config_hash"]) == 16
    assert any(name.startswith("state/") for name in manifest["files"])
    assert all(len(h) == 64 for h in manifest["files"].values())


def test_restore_into_a_different_model_is_one_line(saved_on_data_parallel):
    cfg, mesh, opt, shardings = _setup(MESHES["8x1x1x1"], jax.devices(), d_model=96, n_layers=3)
    ckpt = checkpoint.Checkpointer(saved_on_data_parallel, cfg.checkpoint)
    with jax.set_mesh(mesh), pytest.raises(checkpoint.CheckpointError) as err:
        abstract = jax.eval_shape(lambda: step.init_state(cfg, opt, shardings))
        ckpt.restore_latest_good(abstract, shardings)
    message = str(err.value)
    assert "\n" not in message and "does not match the model" in message
    assert "params/layers/attn/q_proj/kernel: checkpoint (2, 64, 4, 16) vs model (3, 96, 4, 24)" in message
    assert (saved_on_data_parallel / "checkpoints" / "3").is_dir()  # a mismatch is not damage: kept


def test_cli_refuses_a_mismatched_checkpoint_in_one_line(tmp_path):
    args = [sys.executable, "-m", "maxlm.train", "--config=tiny.gin", f"--run_dir={tmp_path}",
            "--gin_bindings=TrainConfig.steps=2", "--gin_bindings=TrainConfig.sample_tokens=0",
            "--gin_bindings=ModelConfig.n_layers=1", "--gin_bindings=TrainConfig.peak_flops=1e12"]
    env = {"XLA_FLAGS": "", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    assert subprocess.run(args, capture_output=True, text=True, timeout=300, env=env).returncode == 0
    proc = subprocess.run(args[:-2] + ["--gin_bindings=ModelConfig.n_layers=2", args[-1]],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("maxlm.train: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert "does not match the model" in errors[0] and "checkpoint (1, 192, 4, 48) vs model (2, 192, 4, 48)" in errors[0]


def _short(run_dir, steps=12, **extra):
    bindings = [f"TrainConfig.run_dir = '{run_dir}'", f"TrainConfig.steps = {steps}", "TrainConfig.log_every = 1",
                "TrainConfig.eval_every = 1000", "TrainConfig.sample_tokens = 0", "OptimConfig.warmup_steps = 2",
                "CheckpointConfig.every_steps = 4", "TrainConfig.peak_flops = 1e12",
                "ModelConfig.d_model = 64", "ModelConfig.d_ff = 128", "ModelConfig.n_layers = 2",
                "ModelConfig.max_seq_len = 64", "TrainConfig.seq_len = 64"]
    bindings += [f"{k} = {v!r}" for k, v in extra.items()]
    return config.load("tiny.gin", bindings, num_devices=8)


@pytest.mark.slow
def test_injected_nan_is_skipped_and_training_continues(tmp_path, monkeypatch):
    clean = train.train(_short(tmp_path / "clean"))
    monkeypatch.setenv("MAXLM_TEST_NAN_STEPS", "5")
    poisoned = train.train(_short(tmp_path / "nan"))
    assert clean["skipped_steps"] == 0 and poisoned["skipped_steps"] == 1
    events = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    skipped = [e for e in events if e.get("event") == "skipped_step"]
    assert [(e["step"], e["reason"]) for e in skipped] == [(5, "non-finite")]
    assert poisoned["loss"] == pytest.approx(clean["loss"], abs=0.15)


@pytest.mark.slow
def test_consecutive_bad_steps_roll_back_with_a_lower_learning_rate(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXLM_TEST_NAN_STEPS", "6,7")
    summary = train.train(_short(tmp_path, **{"TrainConfig.rollback_after": 2}))
    assert summary["rollbacks"] == 1 and summary["last_step"] == 12
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rollback = [r for r in rows if r.get("event") == "rollback"]
    assert rollback[0]["to_step"] == 4 and rollback[0]["lr_scale"] == 0.5
    # Steps 5-7 are trained again on fresh batches, at half the learning rate.
    assert summary["goodput"]["redone_steps"] == 3 and summary["skipped_steps"] == 0
    lr_by_step = {}
    for r in rows:
        if "lr" in r:
            lr_by_step.setdefault(r["step"], []).append(r["lr"])
    assert lr_by_step[5][1] == pytest.approx(lr_by_step[5][0] / 2, rel=1e-5)


def test_spike_detection_skips_outliers():
    cfg = small_config(num_devices=1, mesh=dict(data=1), train=dict(spike_sigmas=3.0, spike_warmup=2, spike_window=10))
    stats = resilience.rolling_stats(cfg.train, jax.numpy.array([2.0, 1.0]), jax.numpy.zeros((2, 2)), 0)
    for value in (2.1, 1.9, 2.0, 2.05):
        stats = resilience.rolling_stats(cfg.train, jax.numpy.array([value, 1.0]), stats, 5)
    assert not resilience.spike_detected(cfg.train, jax.numpy.array([2.1, 1.0]), stats, 5)
    assert resilience.spike_detected(cfg.train, jax.numpy.array([9.0, 1.0]), stats, 5)
    assert not resilience.spike_detected(cfg.train, jax.numpy.array([9.0, 1.0]), stats, 1)  # still warming up


@pytest.mark.slow
def test_a_failed_save_stops_the_run_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    real_save = ocp.CheckpointManager.save

    def full_disk(self, step_n, *args, **kwargs):
        if step_n >= 8:
            raise OSError(28, "No space left on device")
        return real_save(self, step_n, *args, **kwargs)
    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointError) as err:
        train.train(_short(tmp_path))
    assert "No space left on device" in str(err.value) and "previous checkpoints are intact" in str(err.value)
    cfg = _short(tmp_path)
    assert checkpoint.Checkpointer(tmp_path, cfg.checkpoint).problem(4) is None


@pytest.mark.slow
def test_fresh_moves_checkpoints_aside_and_resume_from_picks_a_step(tmp_path):
    train.train(_short(tmp_path, steps=8))
    again = train.train(_short(tmp_path, steps=8), resume_from="4")
    assert again["first_step"] == 4 and again["last_step"] == 8
    fresh = train.train(_short(tmp_path, steps=8), fresh=True)
    assert fresh["first_step"] == 0
    assert list(tmp_path.glob("checkpoints_replaced_*/8/manifest.json"))
    with pytest.raises(train.TrainingError, match="no checkpoint of step 5"):
        train.train(_short(tmp_path, steps=8), resume_from="5")


def test_save_is_due_by_steps_or_minutes(tmp_path):
    cfg = config.CheckpointConfig(every_steps=10, every_minutes=0.0)
    ckpt = checkpoint.Checkpointer(tmp_path, cfg)
    assert ckpt.due(10) and not ckpt.due(11)
    timed = checkpoint.Checkpointer(tmp_path, config.CheckpointConfig(every_steps=0, every_minutes=1e-4))
    assert not timed.due(11)
    time.sleep(0.01)  # 6 ms is the interval
    assert timed.due(11)
