"""Two processes x 4 CPU devices, started as the README says, train like one process x 8 devices."""

import json
import os
import socket
import subprocess
import sys

import pytest

BINDINGS = ["ModelConfig.d_model = 64", "ModelConfig.n_layers = 2", "ModelConfig.n_heads = 4",
            "ModelConfig.n_kv_heads = 2", "ModelConfig.d_ff = 128", "ModelConfig.max_seq_len = 64",
            "TrainConfig.seq_len = 64", "TrainConfig.steps = 6", "TrainConfig.log_every = 1",
            "TrainConfig.eval_every = 3", "TrainConfig.sample_tokens = 0", "TrainConfig.peak_flops = 1e12",
            "OptimConfig.warmup_steps = 2", "CheckpointConfig.every_steps = 3",
            "DataConfig.shards = 2"]  # the same global batch for 1 or 2 processes


def run(run_dir, devices, extra=(), process_id=None):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "maxlm.train", "--config=tiny.gin", f"--run_dir={run_dir}",
           *[f"--gin_bindings={b}" for b in BINDINGS], *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {(k, r["step"]): r[k] for r in rows for k in ("loss", "eval_loss") if k in r and "event" not in r}


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    single = run(tmp_path / "one", 8)
    out, _ = single.communicate(timeout=600)
    assert single.returncode == 0, out
    port = free_port()
    procs = [run(tmp_path / "two", 4, [f"--coordinator_address=localhost:{port}", "--num_processes=2",
                                       f"--process_id={i}"]) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(two) == sorted(one) and len(one) == 6 + 3  # 6 train losses, evals at 0, 3, 6
    for key in one:
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-5), key
    # Only process 0 logs; both write their data-iterator state into each checkpoint.
    assert "done: steps 0->6" in outs[0] and "done:" not in outs[1]
    files = sorted(p.name for p in (tmp_path / "two" / "checkpoints" / "6" / "data").glob("process_*.json"))
    assert files == ["process_0-of-2.json", "process_1-of-2.json"]


def test_incomplete_distributed_flags_are_one_line():
    proc = subprocess.run([sys.executable, "-m", "maxlm.train", "--num_processes=2"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "need --coordinator_address, --num_processes and --process_id together" in proc.stderr
