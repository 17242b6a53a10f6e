"""Run directories in buckets: S3 (moto's server) and GCS (gcp-storage-emulator), both real servers
started on loopback by these tests, never a mocked client.

A run in ``s3://`` or ``gs://`` killed with SIGKILL and restarted continues bitwise as the same run
on local disk does; two processes save one sharded checkpoint to the bucket and it restores onto a
different mesh; the run directory's lease lock keeps a second writer out and lets a dead holder's
lease lapse."""

import json
import os
import random
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("gcsfs")

import test_resilience as resilience  # noqa: E402 - the same run, the same reference

STEPS = resilience.STEPS
LEASE_S = 2  # the run directory's lease in these tests (60 s by default)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], port: int, log) -> subprocess.Popen:
    """A server process whose log goes to a file (a pipe nobody reads fills up and stalls it)."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    wait_listening(port, proc)
    return proc


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"no server on port {port} after {timeout}s")


@pytest.fixture(scope="module")
def s3_env(tmp_path_factory):
    """moto's S3 server on loopback; the environment a client needs to reach it."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("s3") / "moto.log", "w")
    proc = start_server([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port, log)
    try:
        env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        import boto3

        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                     aws_access_key_id="test", aws_secret_access_key="test").create_bucket(Bucket="maxlm-runs")
        yield env
    finally:
        proc.kill()
        proc.wait()
        log.close()


@pytest.fixture(scope="module")
def gs_env(tmp_path_factory):
    """gcp-storage-emulator on loopback, in memory, with the bucket made."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("gcs") / "emulator.log", "w")
    emulator = os.path.join(os.path.dirname(__file__), "gcs_emulator.py")  # one thread per connection
    proc = start_server([sys.executable, emulator, str(port), "maxlm-runs"], port, log)
    try:
        url = f"http://127.0.0.1:{port}"
        yield {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_CLOUD_PROJECT": "test"}
    finally:
        proc.kill()
        proc.wait()
        log.close()


def bucket_text(url: str, env: dict) -> str | None:
    """An object's text read by a client of our own (fsspec), or None when it is absent."""
    scheme, rest = url.split("://", 1)
    code = ("import fsspec, sys\nfs = fsspec.filesystem(sys.argv[1])\n"
            "print(fs.cat_file(sys.argv[2]).decode() if fs.exists(sys.argv[2]) else '\\0', end='')")
    out = subprocess.run([sys.executable, "-c", code, scheme, rest], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return None if out.stdout == "\0" else out.stdout


def losses_of(text: str) -> dict[int, float]:
    seen: dict[int, float] = {}
    for line in text.splitlines():
        row = json.loads(line)
        if "loss" in row and "event" not in row:
            assert seen.setdefault(row["step"], row["loss"]) == row["loss"], f"step {row['step']} differs on redo"
    return seen


@pytest.fixture(params=["s3", "gs"])
def bucket(request) -> tuple[str, dict]:
    """(scheme, client environment) of each object store, so every test below runs against both."""
    return request.param, request.getfixturevalue(f"{request.param}_env")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The same run, uninterrupted, on local disk."""
    run_dir = tmp_path_factory.mktemp("local")
    resilience.finish(run_dir)
    return resilience.losses(run_dir)


@pytest.mark.slow
def test_kill_9_then_restart_in_a_bucket_is_bitwise_identical_to_local(reference, bucket):
    scheme, bucket_env = bucket
    env = {**resilience.ENV, **bucket_env, "MAXLM_REMOTE_SYNC_S": "0", "MAXLM_LEASE_S": str(LEASE_S)}
    run_dir = f"{scheme}://maxlm-runs/kill9-{os.getpid()}"
    kill_at = random.Random(os.getpid()).randint(5, STEPS - 2)
    proc = subprocess.Popen(resilience.command(run_dir), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    def far_enough() -> bool:
        text = bucket_text(f"{run_dir}/metrics.jsonl", env)
        return max(losses_of(text or ""), default=0) >= kill_at and \
            bucket_text(f"{run_dir}/checkpoints/4/manifest.json", env) is not None

    resilience.wait_for(far_enough, proc)
    proc.kill()  # SIGKILL: no chance to save, sync or release the lease
    proc.wait()
    time.sleep(LEASE_S + 0.5)  # the killed holder's lease lapses: nothing renews it any more
    done = subprocess.run(resilience.command(run_dir), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming from" in done.stdout + done.stderr
    assert losses_of(bucket_text(f"{run_dir}/metrics.jsonl", env)) == reference
    assert bucket_text(f"{run_dir}/.lock", env) is None  # released at the end


@pytest.mark.slow
def test_a_save_killed_in_a_bucket_before_its_manifest_is_never_resumed_from(reference, bucket):
    """In a bucket a step is written in place (no rename): one killed before its commit file and
    manifest must not look complete. The restart resumes from the step before it, saves the step
    again, and logs the uninterrupted run's losses."""
    scheme, bucket_env = bucket
    env = {**resilience.ENV, **bucket_env, "MAXLM_REMOTE_SYNC_S": "0", "MAXLM_LEASE_S": str(LEASE_S)}
    run_dir = f"{scheme}://maxlm-runs/killsave-{os.getpid()}"
    held = {"MAXLM_TEST_MANIFEST_DELAY_S": "60", "MAXLM_TEST_MANIFEST_DELAY_STEP": "8"}  # step 8's manifest waits
    proc = subprocess.Popen(resilience.command(run_dir), env={**env, **held},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    resilience.wait_for(lambda: bucket_text(f"{run_dir}/checkpoints/8/_CHECKPOINT_METADATA", env) is not None, proc)
    assert bucket_text(f"{run_dir}/checkpoints/8/manifest.json", env) is None
    proc.kill()
    proc.wait()
    time.sleep(LEASE_S + 0.5)
    done = subprocess.run(resilience.command(run_dir), env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"resuming from {run_dir}/checkpoints/4 (step 4)" in output
    assert json.loads(bucket_text(f"{run_dir}/checkpoints/8/manifest.json", env))["step"] == 8  # saved again
    assert losses_of(bucket_text(f"{run_dir}/metrics.jsonl", env)) == reference


@pytest.mark.slow
def test_a_run_in_gcs_saves_and_opens_like_the_same_run_on_local_disk(gs_env, tmp_path):
    """gs:// is Orbax's own path (tensorstore's gcs kvstore); the records, the lock and the loader
    are ours. The emulator honours generation preconditions (tests/gcs_emulator.py), which OCDBT's
    manifest writes rely on, so the run saves several checkpoints as it would on real GCS."""
    env = {**resilience.ENV, **gs_env, "MAXLM_REMOTE_SYNC_S": "0"}
    bindings = ["TrainConfig.steps = 8", "CheckpointConfig.every_steps = 2"]
    run_dir = f"gs://maxlm-runs/run-{os.getpid()}"

    def train(where: str) -> None:
        out = subprocess.run(resilience.command(where) + [f"--gin_bindings={b}" for b in bindings], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr

    train(run_dir)
    train(str(tmp_path))
    assert losses_of(bucket_text(f"{run_dir}/metrics.jsonl", env)) == resilience.losses(tmp_path)
    assert bucket_text(f"{run_dir}/config.gin", env) == (tmp_path / "config.gin").read_text().replace(str(tmp_path), run_dir)
    code = f"""
import numpy as np, jax
from maxlm.hf.load import load_model
remote, local = load_model({run_dir!r}), load_model({str(tmp_path)!r})
assert remote.step == local.step == 8
for a, b in zip(jax.tree.leaves(remote.params), jax.tree.leaves(local.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
print("equal")
"""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "equal" in out.stdout, out.stdout + out.stderr


def test_lease_lock_keeps_a_second_writer_out_and_lapses_when_its_holder_dies(bucket, monkeypatch):
    scheme, bucket_env = bucket
    for key, value in bucket_env.items():
        monkeypatch.setenv(key, value)
    from maxlm import storage

    lock_path = storage.path(f"{scheme}://maxlm-runs/lock-{os.getpid()}/.lock")
    first = storage.LeaseLock(lock_path, lease_s=3)
    first.acquire()
    with pytest.raises(storage.LockHeld, match=f"pid {os.getpid()}"):
        storage.LeaseLock(lock_path, lease_s=3).acquire()
    time.sleep(2)  # the holder renews (every lease/3 s): still held after the first lease's span
    with pytest.raises(storage.LockHeld):
        storage.LeaseLock(lock_path, lease_s=3).acquire()
    first._stop.set()  # the holder dies: no more renewals, no release
    first._thread.join()
    time.sleep(3.5)
    second = storage.LeaseLock(lock_path, lease_s=3)
    second.acquire()  # the lapsed lease is taken over
    assert json.loads(storage.filesystem(lock_path).cat_file(str(lock_path)))["pid"] == os.getpid()
    second.release()
    assert not lock_path.exists()


@pytest.mark.slow
def test_two_processes_save_one_checkpoint_to_the_bucket_that_restores_on_another_mesh(s3_env, tmp_path):
    import test_multihost as multihost

    env = {**os.environ, **s3_env, "MAXLM_REMOTE_SYNC_S": "0", "PYTHONUNBUFFERED": "1"}
    run_dir = f"s3://maxlm-runs/two-{os.getpid()}"
    port = multihost.free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "maxlm.train", "--config=tiny.gin", f"--run_dir={run_dir}",
         *[f"--gin_bindings={b}" for b in multihost.BINDINGS], f"--coordinator_address=localhost:{port}",
         "--num_processes=2", f"--process_id={i}"],
        env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    data = sorted(json.loads(bucket_text(f"{run_dir}/checkpoints/6/manifest.json", env))["files"])
    assert {"data/process_0-of-2.json", "data/process_1-of-2.json"} <= set(data)
    # Restore on another mesh in a fresh process: 8 devices, the parameters split over tensor=2
    # (the training mesh was data=8 over 2 processes), equal to the same checkpoint read onto one
    # device; and close to the same training run by one process on local disk.
    local = tmp_path / "one"
    single = multihost.run(local, 8)
    out = single.communicate(timeout=600)[0]
    assert single.returncode == 0, out
    code = f"""
import numpy as np, jax
from maxlm.hf.load import load_model
split = load_model({run_dir!r}, tensor=2)
whole = load_model({run_dir!r}, tensor=1)
local = load_model({str(local)!r}, tensor=1)
assert split.step == 6 and split.mesh.shape["tensor"] == 2
leaves = jax.tree.leaves(split.params)
assert any(len(l.sharding.device_set) == 2 and not l.sharding.is_fully_replicated for l in leaves)
for a, b, c in zip(leaves, jax.tree.leaves(whole.params), jax.tree.leaves(local.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-4, atol=1e-5)
print("restored", len(leaves), "arrays")
"""
    out = subprocess.run([sys.executable, "-c", code], env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "restored" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
def test_data_training_doctor_and_export_all_in_s3(s3_env, tmp_path):
    """Every path in a bucket: a JSONL corpus is prepared into packed shards there, a run trains on
    them with its run directory there, the doctor reads it, and the export lands there, loadable;
    the same prepare on local disk writes the same shards."""
    env = {**os.environ, **s3_env, "XLA_FLAGS": "", "MAXLM_REMOTE_SYNC_S": "0",
           "MAXLM_BUCKET_CACHE": str(tmp_path / "cache")}
    root = f"s3://maxlm-runs/all-{os.getpid()}"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 20}) + "\n"
                              for i in range(64)))
    import fsspec

    fs = fsspec.filesystem("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"], key="test", secret="test")
    fs.put_file(str(corpus), f"{root}/raw/corpus.jsonl")

    def run(*args: str, ok: bool = True) -> str:
        out = subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=600)
        assert (out.returncode == 0) == ok, out.stdout + out.stderr
        return out.stdout + out.stderr

    for source, out in ((f"jsonl:{root}/raw/*.jsonl", f"{root}/packed"), (f"jsonl:{corpus}", str(tmp_path / "packed"))):
        run("maxlm.data", "prepare", source, "--out", out, "--seq-len", "64", "--quiet")
    local_index = json.loads((tmp_path / "packed" / "index.json").read_text())
    remote_index = json.loads(bucket_text(f"{root}/packed/index.json", env))
    assert remote_index["splits"] == local_index["splits"]  # the same rows, shard by shard (sha256)
    # A bucket directory is never replaced.
    assert "never replaced" in run("maxlm.data", "prepare", f"jsonl:{corpus}", "--out", f"{root}/packed",
                                   "--seq-len", "64", ok=False)

    run_dir = f"{root}/run"
    run("maxlm.train", "--config=tiny.gin", f"--run_dir={run_dir}",
        *[f"--gin_bindings={b}" for b in resilience.BINDINGS if "steps" not in b.split("=")[0]],
        "--gin_bindings=TrainConfig.steps = 4", f"--gin_bindings=DataConfig.source = 'packed:{root}/packed'")
    assert max(losses_of(bucket_text(f"{run_dir}/metrics.jsonl", env))) == 4
    assert "plot: " + run_dir + "/doctor.png" in run("maxlm.doctor", run_dir)
    assert fs.exists(f"{run_dir}/doctor.png")
    run("maxlm.hf", "export", run_dir, "--out", f"{root}/hf")
    assert {p.rsplit("/", 1)[1] for p in fs.ls(f"{root}/hf")} >= {"config.json", "model.safetensors"}
    assert "never overwrites" in run("maxlm.hf", "export", run_dir, "--out", f"{root}/hf", ok=False)
    code = f"""
import numpy as np, jax
from maxlm.hf.load import load_model
from maxlm import model
hf, trained = load_model({root + '/hf'!r}), load_model({run_dir!r})
tokens = (jax.numpy.arange(32)[None] * 7) % 256
segments = jax.numpy.ones_like(tokens)
a, b = (model.forward(m.cfg, m.params, tokens, segments)[0][..., :256] for m in (hf, trained))
np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)  # the exported model is the run's
print("equal", hf.source)
"""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert f"equal {root}/hf" in out.stdout, out.stdout + out.stderr
    # ...and back: import the bucket's export into a bucket run directory, and train from its
    # config.gin, read from the bucket too (init_params in the bucket).
    run("maxlm.hf", "import", f"{root}/hf", "--out", f"{root}/imported")
    tuned = f"{root}/tuned"
    run("maxlm.train", f"--config={root}/imported/config.gin", f"--run_dir={tuned}",
        "--gin_bindings=TrainConfig.steps = 2", "--gin_bindings=TrainConfig.seq_len = 64",
        "--gin_bindings=TrainConfig.sample_tokens = 0", "--gin_bindings=TrainConfig.peak_flops = 1e12",
        f"--gin_bindings=DataConfig.source = 'packed:{root}/packed'")
    first = json.loads(bucket_text(f"{tuned}/metrics.jsonl", env).splitlines()[0])
    trained_last = [json.loads(line) for line in bucket_text(f"{run_dir}/metrics.jsonl", env).splitlines()
                    if "eval_loss" in line][-1]
    assert first["step"] == 0 and first["eval_loss"] == pytest.approx(trained_last["eval_loss"], rel=1e-4)
