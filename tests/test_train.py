"""End to end: `python -m maxlm.train` on tiny.gin learns, records itself and resumes."""

import json
import subprocess
import sys

import pytest

from maxlm import config, train

SHORT = ["TrainConfig.steps = 24", "TrainConfig.eval_every = 12", "TrainConfig.log_every = 6",
         "CheckpointConfig.every_steps = 12", "OptimConfig.warmup_steps = 4", "TrainConfig.sample_tokens = 24"]


@pytest.mark.slow
def test_tiny_learns_records_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    cfg = config.load("tiny.gin", SHORT + [f"TrainConfig.run_dir = '{run_dir}'"], num_devices=8)
    first = train.train(cfg)
    (step0, loss0), *_, (step_n, loss_n) = first["eval_losses"]
    assert (step0, step_n) == (0, 24)
    assert loss_n < loss0 - 1.0, first["eval_losses"]  # from ~5.6 nats (uniform bytes) well down
    assert first["skipped_steps"] == 0 and first["sample"].startswith("def ")

    # The run directory records everything.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["12", "24"]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "loss.png").stat().st_size > 10_000
    assert config.load(str(run_dir / "config.gin")).to_dict() == cfg.to_dict()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [6, 12, 18, 24]
    for key in ("perplexity", "grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu"):
        assert all(r[key] > 0 for r in train_rows), key
    # Step times are measured once the window's steps have finished, not when they were dispatched:
    # they account for the run's stepping time (goodput's train + lost), within a factor of two.
    timed_steps = sum(6 - (r["step"] == 6) for r in train_rows)  # the first step is compilation
    measured = sum(r["step_time_s"] * (6 - (r["step"] == 6)) for r in train_rows)
    stepping = first["goodput"]["train_s"] + first["goodput"]["lost_s"]
    assert 0.5 * stepping * timed_steps / 24 < measured < 2 * stepping, (measured, stepping)
    # The logged loss is the window's mean: it equals no single step's loss in general, and the
    # window means of a run that learns fall.
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    assert json.loads((run_dir / "run.json").read_text())["params"] == 1_725_120

    # Rerunning with more steps resumes from the latest checkpoint instead of starting over.
    more = config.load(str(run_dir / "config.gin"), ["TrainConfig.steps = 30"], num_devices=8)
    second = train.train(more)
    assert second["first_step"] == 24 and second["last_step"] == 30
    assert second["eval_losses"][-1][1] < loss0 - 1.0

    # A finished run has nothing left to do.
    third = train.train(more)
    assert third["first_step"] == 30 and third["eval_losses"] == []


def test_cli_help():
    proc = subprocess.run([sys.executable, "-m", "maxlm.train", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert "--config" in proc.stdout and "--gin_bindings" in proc.stdout and "resumes" in proc.stdout
