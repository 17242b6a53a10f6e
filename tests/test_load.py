"""Opening trained models for use (maxlm.hf.load): which parameters are read, from where, onto
which mesh, and one line for every path that cannot be opened."""

import jax
import numpy as np
import pytest
from helpers import small_config

from maxlm import config, model
from maxlm.hf.load import LoadError, load_model
from maxlm.parallel import sharding
from maxlm.train import checkpoint, optim, step


def _write_run(run_dir, cfg, steps=(2, 4)):
    """A run directory whose checkpoint of step s holds params offset by s (so each is recognisable)."""
    cfg = cfg.replace(train={"run_dir": str(run_dir)})
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.gin").write_text(config.operative_gin(cfg))
    mesh = sharding.make_mesh(cfg.mesh.shape(1), jax.devices()[:1])
    opt = optim.make_optimizer(cfg.optim, cfg.train.steps)
    shardings = step.state_shardings(cfg, mesh, opt)
    ckpt = checkpoint.Checkpointer(run_dir, cfg.checkpoint)
    with jax.set_mesh(mesh):
        state = step.init_state(cfg, opt, shardings)
        for s in steps:
            moved = state.replace(params=jax.tree.map(lambda p, s=s: p + s, state.params))
            ckpt.save(s, moved, {}, cfg.to_dict(), {})
            ckpt.wait()
    ckpt.close()
    return state.params


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cfg = small_config(num_devices=1, mesh={"data": 1})
    run_dir = tmp_path_factory.mktemp("load") / "run"
    return run_dir, cfg, jax.tree.map(np.asarray, _write_run(run_dir, cfg))


def _embed(loaded):
    return np.asarray(loaded.params["embed"])


def test_newest_checkpoint_params_only(run):
    run_dir, cfg, params = run
    loaded = load_model(run_dir)
    assert loaded.step == 4 and loaded.source.endswith("checkpoints/4")
    np.testing.assert_array_equal(_embed(loaded), params["embed"] + 4)
    assert loaded.cfg.d_model == cfg.model.d_model and loaded.tokenizer.vocab_size == 259
    assert jax.tree.structure(loaded.params) == jax.tree.structure(model.abstract_params(cfg.model))


def test_chosen_step_and_checkpoint_folder(run):
    run_dir, _, params = run
    np.testing.assert_array_equal(_embed(load_model(run_dir, step=2)), params["embed"] + 2)
    folder = load_model(run_dir / "checkpoints" / "2")
    assert folder.step == 2
    np.testing.assert_array_equal(_embed(folder), params["embed"] + 2)


def test_dtype_override_and_tensor_parallel_placement(run):
    run_dir, cfg, params = run
    loaded = load_model(run_dir, dtype="bfloat16", tensor=4)
    assert loaded.cfg.dtype == "bfloat16" and loaded.mesh.shape["tensor"] == 4
    q = loaded.params["layers"]["attn"]["q_proj"]["kernel"]  # [layers, embed, heads, head_dim]
    assert q.sharding.spec[2] == "tensor" and len(q.sharding.device_set) == 4
    np.testing.assert_array_equal(np.asarray(q), params["layers"]["attn"]["q_proj"]["kernel"] + 4)


def test_a_damaged_newest_checkpoint_falls_back(tmp_path):
    cfg = small_config(num_devices=1, mesh={"data": 1})
    params = _write_run(tmp_path / "run", cfg)
    (tmp_path / "run" / "checkpoints" / "4" / "manifest.json").unlink()  # an interrupted save
    loaded = load_model(tmp_path / "run")
    assert loaded.step == 2
    np.testing.assert_array_equal(_embed(loaded), np.asarray(params["embed"]) + 2)
    with pytest.raises(LoadError, match=r"checkpoints/4: checkpoint is incomplete"):
        load_model(tmp_path / "run", step=4)


def test_imported_params_when_there_is_no_checkpoint(tmp_path):
    cfg = small_config(num_devices=1, mesh={"data": 1})
    params = model.init_params(cfg.model, jax.random.PRNGKey(3))
    checkpoint.save_params(tmp_path / "params", params)
    cfg = cfg.replace(train={"init_params": str(tmp_path / "params"), "run_dir": str(tmp_path)})
    (tmp_path / "config.gin").write_text(config.operative_gin(cfg))
    loaded = load_model(tmp_path)
    assert loaded.step is None and loaded.source == str(tmp_path / "params")
    np.testing.assert_array_equal(_embed(loaded), np.asarray(params["embed"]))


@pytest.mark.parametrize("where, kwargs, message", [
    ("missing", {}, "missing: does not exist"),
    ("", {}, "neither a maxlm run directory"),
    ("run", {"step": 3}, r"no checkpoint of step 3 \(have: 2, 4\)"),
    ("run", {"tensor": 64}, r"--tensor = 64 must lie in \[1, 8\]"),
    ("run", {"tensor": 8}, "ModelConfig.n_heads = 4 does not divide by --tensor = 8"),
    ("run", {"dtype": "float64"}, "dtype 'float64' is not one of"),
    ("run/checkpoints/2", {"step": 4}, "is the checkpoint of step 2, but --step 4 was asked"),
])
def test_bad_paths_are_one_line(run, where, kwargs, message):
    run_dir = run[0]
    with pytest.raises(LoadError, match=message) as err:
        load_model(run_dir.parent / where, **kwargs)
    assert "\n" not in str(err.value)


def test_a_run_without_weights_is_one_line(tmp_path):
    cfg = small_config(num_devices=1, mesh={"data": 1})
    (tmp_path / "config.gin").write_text(config.operative_gin(cfg))
    with pytest.raises(LoadError, match="holds no checkpoint yet"):
        load_model(tmp_path)
    (tmp_path / "config.gin").write_text("ModelConfig.d_model = 'wide'\n")
    with pytest.raises(LoadError, match=r"config.gin: .*d_model"):
        load_model(tmp_path)


@pytest.mark.parametrize("cores,shape,want", [
    (2, dict(n_heads=4, n_kv_heads=2, d_ff=128), 2),
    (4, dict(n_heads=6, n_kv_heads=2, d_ff=128), 2),  # 4 and 3 do not divide the kv heads
    (8, dict(n_heads=8, n_kv_heads=4, d_ff=96), 4),
    (2, dict(n_heads=4, n_kv_heads=1, d_ff=128), 1),  # one kv head: nothing to split
    (1, dict(n_heads=4, n_kv_heads=2, d_ff=128), 1),
    (2, dict(n_heads=4, n_kv_heads=2, d_ff=128, linear="int8"), 1),  # packed groups stay whole
])
def test_auto_tensor_takes_the_cores_the_heads_divide_by(monkeypatch, cores, shape, want):
    from maxlm.infer import placement

    monkeypatch.setattr(placement, "cpu_cores", lambda: cores)
    cfg = config.ModelConfig(vocab_size=64, d_model=48, n_layers=1, max_seq_len=16, **shape)
    assert placement.auto_tensor(cfg) == want


def test_tensor_none_loads_on_the_auto_mesh(run, monkeypatch):
    from maxlm.infer import placement

    run_dir, cfg, _ = run
    monkeypatch.setattr(placement, "cpu_cores", lambda: 2)
    loaded = load_model(run_dir, tensor=None)
    assert cfg.model.kv_heads % 2 == 0 and loaded.mesh.shape["tensor"] == 2
