"""maxlm.hf import loses nothing and says what is wrong in one line: a bad --out, NaN/Inf or
integer/boolean tensors are refused before anything is written; the outputs appear whole or not at
all, also when the import is killed midway; nothing it did not create is touched.

The checkpoints are written with safetensors from maxlm's own export (no torch needed)."""

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from maxlm import config as config_lib
from maxlm import hf, model

LLAMA = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=200, max_position_embeddings=64,
             rms_norm_eps=1e-5, tie_word_embeddings=False)
K_PROJ = "model.layers.1.self_attn.k_proj.weight"


def hf_tensors(hf_config: dict = LLAMA) -> dict:
    """Random weights named and shaped as save_pretrained writes them (via maxlm's export)."""
    model_cfg = hf.config_from_hf(hf_config, dtype="float32")
    rng = np.random.default_rng(0)
    tree = jax.tree.map(lambda x: (0.02 * rng.standard_normal(x.shape)).astype(np.float32),
                        model.abstract_params(model_cfg))
    return hf.export_params(tree, model_cfg, hf_config)


def write_checkpoint(path, tensors: dict, hf_config: dict = LLAMA):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def snapshot(root) -> dict:
    """Every path under ``root`` (hidden ones too) -> sha256 of a file, None for a directory."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def run_main(argv, capsys) -> tuple[int, list[str]]:
    """maxlm.hf's main in-process: (exit status, stderr lines); argparse's exit is caught."""
    try:
        code = hf.main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def tensors():
    return hf_tensors()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tensors):
    return write_checkpoint(tmp_path_factory.mktemp("hf") / "llama", tensors)


def _refused(argv, capsys, root, *fragments) -> str:
    before = snapshot(root)
    code, err = run_main(argv, capsys)
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], (code, err)
    for fragment in fragments:
        assert str(fragment) in err[0], (fragment, err[0])
    assert snapshot(root) == before, "a refused import changed or left files"
    return err[0]


def test_import_writes_config_and_params(ckpt, tmp_path, capsys):
    out = tmp_path / "a" / "b" / "run"
    code, err = run_main(["import", ckpt, "--out", out], capsys)
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.rglob("*") if p.name.startswith(".")) == []  # no stage left
    assert sorted(os.listdir(out)) == ["config.gin", "params"]
    cfg = config_lib.load(str(out / "config.gin"))
    assert cfg.train.init_params == str(out / "params") and cfg.model.n_kv_heads == 2


def test_out_is_an_existing_file(ckpt, tmp_path, capsys):
    target = tmp_path / "notes.txt"
    target.write_text("keep me\n")
    line = _refused(["import", ckpt, "--out", target], capsys, tmp_path, target, "not a directory")
    assert target.read_text() == "keep me\n", line
    _refused(["import", ckpt, "--out", target / "run"], capsys, tmp_path, target, "not a directory")


@pytest.mark.parametrize("where", ["is", "lies inside", "contains"])
def test_out_overlapping_hf_dir_is_refused(ckpt, capsys, where):
    out = {"is": ckpt, "lies inside": ckpt / "run", "contains": ckpt.parent}[where]
    _refused(["import", ckpt, "--out", out], capsys, ckpt.parent, f"{where} HF_DIR")


@pytest.mark.parametrize("existing", ["params", "config.gin"])
def test_existing_outputs_are_never_overwritten(ckpt, tmp_path, capsys, existing):
    run = tmp_path / "run"
    run.mkdir()
    if existing == "params":
        (run / "params").mkdir()
    else:
        (run / "config.gin").write_text("# mine\n")
    _refused(["import", ckpt, "--out", run], capsys, tmp_path, run / existing, "already exists")


BROKEN = {  # what is done to one tensor -> what the one line says
    "nan": (lambda x: np.where(np.arange(x.size).reshape(x.shape) == 5, np.nan, x).astype(x.dtype),
            "1 of 512 values are NaN or Inf"),
    "inf": (lambda x: np.full_like(x, -np.inf), "512 of 512 values are NaN or Inf"),
    "float64 overflow": (lambda x: x.astype(np.float64) * 1e300, "values overflow float32"),
    "int32": (lambda x: (100 * x).astype(np.int32), "has dtype int32, expected a floating-point weight"),
    "int64": (lambda x: (100 * x).astype(np.int64), "has dtype int64"),
    "uint8": (lambda x: np.zeros(x.shape, np.uint8), "has dtype uint8"),
    "bool": (lambda x: x > 0, "has dtype bool"),
}


@pytest.mark.parametrize("kind", BROKEN)
def test_broken_tensor_is_refused_and_nothing_written(tensors, tmp_path, capsys, kind):
    change, message = BROKEN[kind]
    ckpt = write_checkpoint(tmp_path / "hf", {**tensors, K_PROJ: change(tensors[K_PROJ])})
    _refused(["import", ckpt, "--out", tmp_path / "out" / "run"], capsys, tmp_path,
             ckpt / "model.safetensors", f"tensor '{K_PROJ}'", message)
    with pytest.raises(hf.HFImportError, match=message.split(",")[0]):  # the in-memory API too
        hf.import_params({**tensors, K_PROJ: change(tensors[K_PROJ])},
                         hf.config_from_hf(LLAMA, dtype="float32"), LLAMA)


def test_a_failed_write_leaves_nothing(ckpt, tmp_path, capsys, monkeypatch):
    from maxlm.train import checkpoint

    def half_then_disk_full(path, params):
        path.mkdir()
        (path / "half").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(checkpoint, "save_params", half_then_disk_full)
    (tmp_path / "keep").write_text("x")
    _refused(["import", ckpt, "--out", tmp_path / "new" / "deeper" / "run"], capsys, tmp_path,
             "No space left on device", "nothing was imported")
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "tokenizer.json").write_text("{}")
    _refused(["import", ckpt, "--out", tmp_path / "existing"], capsys, tmp_path, "No space left on device")


# A kill -9 right after the parameters are written, before the import is published.
KILL_AFTER_PARAMS = """
import os, signal, sys
from maxlm.train import checkpoint
save = checkpoint.save_params
def save_then_die(path, params):
    save(path, params)
    os.kill(os.getpid(), signal.SIGKILL)
checkpoint.save_params = save_then_die
from maxlm.hf import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("existing", [False, True], ids=["new_run_dir", "existing_run_dir"])
def test_import_killed_midway_leaves_nothing_that_looks_complete(ckpt, tmp_path, capsys, existing):
    out = tmp_path / "run"
    if existing:
        out.mkdir()
        (out / "notes.md").write_text("my notes\n")
    before = snapshot(out) if existing else None
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", KILL_AFTER_PARAMS, "import", str(ckpt), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (snapshot(out) == before) if existing else not out.exists()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".run.hf-import.tmp-"), leftovers
    # The next import for the same path removes the dead one's stage and completes.
    code, err = run_main(["import", ckpt, "--out", out], capsys)
    assert code == 0, err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert {"params", "config.gin"} <= set(os.listdir(out))
    if existing:
        assert (out / "notes.md").read_text() == "my notes\n"


def test_a_live_import_into_the_same_run_dir_is_refused(ckpt, tmp_path, capsys):
    stage = tmp_path / f".run.hf-import.tmp-{os.getppid()}"  # a live process's stage
    stage.mkdir()
    (stage / "config.gin").write_text("# being written\n")
    _refused(["import", ckpt, "--out", tmp_path / "run"], capsys, tmp_path, f"pid {os.getppid()}",
             "is writing")
