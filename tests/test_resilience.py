"""Killed, preempted and restarted runs continue exactly as if nothing had happened.

Each test runs `python -m maxlm.train` as a real process on one CPU device with a very small model,
kills or signals it, restarts the same command, and compares every step's loss (metrics.jsonl,
logged each step) with an uninterrupted run: bitwise, since state, RNG and data iterator are all
restored."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

STEPS = 16
BINDINGS = ["ModelConfig.d_model = 64", "ModelConfig.n_layers = 2", "ModelConfig.n_heads = 4",
            "ModelConfig.n_kv_heads = 2", "ModelConfig.d_ff = 128", "ModelConfig.max_seq_len = 64",
            "TrainConfig.seq_len = 64", f"TrainConfig.steps = {STEPS}", "TrainConfig.log_every = 1",
            "TrainConfig.eval_every = 1000", "TrainConfig.sample_tokens = 0", "TrainConfig.peak_flops = 1e12",
            "OptimConfig.warmup_steps = 2", "CheckpointConfig.every_steps = 4", "CheckpointConfig.max_to_keep = 10"]
ENV = {**os.environ, "XLA_FLAGS": "", "PYTHONUNBUFFERED": "1"}  # one device: fast start-up


def command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "maxlm.train", "--config=tiny.gin", f"--run_dir={run_dir}",
            *[f"--gin_bindings={b}" for b in BINDINGS]]


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss; a step logged twice (redone after a restart) must have logged the same loss."""
    seen: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row and "event" not in row:
            assert seen.setdefault(row["step"], row["loss"]) == row["loss"], f"step {row['step']} differs on redo"
    return seen


def logged_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max((r["step"] for r in rows if "loss" in r), default=0)


def start(run_dir: Path, env=None) -> subprocess.Popen:
    return subprocess.Popen(command(run_dir), env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended early:\n{proc.stdout.read()}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def finish(run_dir: Path) -> str:
    proc = subprocess.run(command(run_dir), env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    finish(run_dir)
    result = losses(run_dir)
    assert sorted(result) == list(range(1, STEPS + 1))
    return result


@pytest.mark.slow
def test_kill_9_then_restart_is_bitwise_identical(tmp_path, reference):
    kill_at = random.Random(os.getpid()).randint(5, STEPS - 2)
    proc = start(tmp_path)
    # Past kill_at, and with the first checkpoint complete (its async save can lag under load).
    wait_for(lambda: logged_step(tmp_path) >= kill_at and (tmp_path / "checkpoints/4/manifest.json").exists(), proc)
    proc.kill()  # SIGKILL: no chance to save anything
    proc.wait()
    output = finish(tmp_path)
    assert "resuming from" in output
    assert losses(tmp_path) == reference


@pytest.mark.slow
def test_kill_during_async_save_falls_back_and_is_identical(tmp_path, reference):
    # Step 8's manifest, written last, is held back for a while: kill inside that window.
    proc = start(tmp_path, env={**ENV, "MAXLM_TEST_MANIFEST_DELAY_S": "30", "MAXLM_TEST_MANIFEST_DELAY_STEP": "8"})
    step_dir = tmp_path / "checkpoints" / "8"
    wait_for(lambda: step_dir.is_dir(), proc)
    assert not (step_dir / "manifest.json").exists()
    proc.kill()
    proc.wait()
    output = finish(tmp_path)
    assert "checkpoints/8 is unusable: incomplete" in output and "resuming from" in output
    assert list((tmp_path / "checkpoints_rejected").glob("8-incomplete-*"))
    assert losses(tmp_path) == reference


@pytest.mark.slow
def test_sigterm_saves_exits_0_and_continues_from_the_next_step(tmp_path, reference):
    proc = start(tmp_path)
    wait_for(lambda: logged_step(tmp_path) >= 6, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    stopped = [line for line in out.splitlines() if line.startswith("stopped by SIGTERM")]
    assert len(stopped) == 1 and "rerun the same command to resume" in stopped[0]
    saved = int(stopped[0].split("after step ")[1].split(":")[0])
    assert (tmp_path / "checkpoints" / str(saved) / "manifest.json").exists()
    output = finish(tmp_path)
    assert f"(step {saved})" in output  # resumed from the step it stopped at
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r.get("event") == "resume" and r.get("redo_steps")], "nothing redone"
    assert losses(tmp_path) == reference


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous(tmp_path, reference, damage):
    finish(tmp_path)
    latest = tmp_path / "checkpoints" / str(STEPS)
    victim = max((p for p in (latest / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    blob = bytearray(victim.read_bytes())
    if damage == "truncate":
        blob = blob[: len(blob) // 2]
    else:
        blob[len(blob) // 2] ^= 0xFF
    victim.write_bytes(bytes(blob))
    out = finish(tmp_path)  # the same command again: the last checkpoint no longer counts
    assert f"checkpoints/{STEPS} is unusable: file state/" in out and "fails its sha256" in out
    assert f"(step {STEPS - 4})" in out  # the previous good checkpoint
    assert list((tmp_path / "checkpoints_rejected").glob(f"{STEPS}-file-*"))
    assert losses(tmp_path) == reference  # and the redone steps match too
