"""Every shipped config parses and validates; every mistake is one clear line."""

import math
import subprocess
import sys

import jax
import pytest

from maxlm import config, model

CONFIGS = sorted(p.name for p in config.CONFIG_DIR.glob("*.gin"))


def intended_devices(cfg: config.Config) -> int:
    """The device count a config is written for: its fixed degrees, or 8 where one axis is -1."""
    degrees = [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, cfg.mesh.pipeline]
    fixed = math.prod(d for d in degrees if d != -1)
    return fixed * 8 if -1 in degrees else fixed


@pytest.mark.parametrize("name", CONFIGS)
def test_config_parses_and_validates(name):
    cfg = config.load(name)
    config.validate(cfg, intended_devices(cfg))
    assert cfg.source == name
    with open(config.CONFIG_DIR / name) as f:
        head = f.readline()
    assert head.startswith("# python -m maxlm.train --config="), "each config opens with its command"


def test_known_sizes():
    sizes = {name: model.param_count(config.load(name).model) / 1e6 for name in CONFIGS}
    assert sizes["gpt2_124m.gin"] == pytest.approx(124.4, abs=0.1)
    assert sizes["llama3_1b.gin"] == pytest.approx(1235.8, abs=0.5)
    assert sizes["llama3_8b.gin"] == pytest.approx(8030.3, abs=0.5)
    assert sizes["gpt175b.gin"] == pytest.approx(174600, rel=1e-3)


def test_operative_gin_round_trips(tmp_path):
    cfg = config.load("tiny.gin", ["TrainConfig.steps = 7", "OptimConfig.learning_rate = 0.5"])
    path = tmp_path / "op.gin"
    path.write_text(config.operative_gin(cfg))
    again = config.load(str(path))
    assert again.to_dict() == cfg.to_dict()


def test_bindings_override_and_bare_names():
    cfg = config.load("tiny", ["TrainConfig.steps = 3"])
    assert cfg.train.steps == 3


BAD = [
    (["ModelConfig.n_head = 3"], 8, "doesn't have a parameter named 'n_head'"),
    (["MeshConfig.data = 3"], 8, "= 3, but 8 devices are present"),
    (["MeshConfig.data = 1", "MeshConfig.tensor = 8"], 8, "ModelConfig.n_heads = 4 is not divisible by MeshConfig.tensor = 8"),
    (["MeshConfig.data = 2", "MeshConfig.tensor = 4", "ModelConfig.n_heads = 8"], 8,
     "ModelConfig.n_kv_heads = 2 is not divisible by MeshConfig.tensor = 4"),
    (["TrainConfig.global_batch = 12"], 8, "TrainConfig.global_batch = 12 is not divisible by data*fsdp*microbatches"),
    (["OptimConfig.microbatches = 3"], 1, "TrainConfig.global_batch = 16 is not divisible by data*fsdp*microbatches = 1*1*3"),
    (["ModelConfig.n_heads = 5"], 8, "ModelConfig.d_model = 192 is not divisible by ModelConfig.n_heads = 5"),
    (["ModelConfig.n_kv_heads = 3"], 8, "ModelConfig.n_heads = 4 is not divisible by ModelConfig.n_kv_heads = 3"),
    (["MeshConfig.data = 1", "MeshConfig.pipeline = 8"], 8,
     "ModelConfig.n_layers = 4 is not divisible by MeshConfig.pipeline * MeshConfig.pipeline_repeats = 8*1 = 8"),
    (["ModelConfig.attention_impl = 'cudnn'"], 8, "'cudnn' needs NVIDIA GPUs, but this run's devices are cpu"),
    (["ModelConfig.norm = 'batch'"], 8, "ModelConfig.norm = 'batch' is not one of rms, layer"),
    (["TrainConfig.seq_len = 512"], 8, "TrainConfig.seq_len = 512 exceeds ModelConfig.max_seq_len = 128"),
    (["MeshConfig.data = -1", "MeshConfig.fsdp = -1"], 8, "only one axis may be -1"),
    (["DataConfig.eval_fraction = 1.5"], 8, "DataConfig.eval_fraction = 1.5 must lie in [0, 1)"),
    (["MeshConfig.data = 3", "MeshConfig.fsdp = -1"], 8, "cannot fill 8 devices"),
    (["TrainConfig.steps = 0"], 8, "TrainConfig.steps must be positive, got 0"),
    (["TrainConfig.steps = 'many'"], 8, "TrainConfig.steps = 'many' should be of type int"),
    (["ModelConfig.tie_embeddings = 1"], 8, "ModelConfig.tie_embeddings = 1 should be of type bool"),
    # Ranges, checked before anything compiles (each once ended in a traceback or a silent misrun).
    (["ModelConfig.n_kv_heads = -1"], 8, "ModelConfig.n_kv_heads must be >= 0, got -1"),
    (["TrainConfig.seed = 4294967296"], 8, "TrainConfig.seed = 4294967296 must lie in [0, 4294967296)"),
    (["DataConfig.seed = -1"], 8, "DataConfig.seed = -1 must lie in [0, 4294967296)"),
    (["DataConfig.shards = -2"], 8, "DataConfig.shards must be >= 0, got -2"),
    (["TrainConfig.sample_tokens = -5"], 8, "TrainConfig.sample_tokens must be >= 0, got -5"),
    (["TrainConfig.sample_tokens = 256"], 8, "TrainConfig.sample_tokens = 256 must be below ModelConfig.max_seq_len"),
    (["TrainConfig.eval_every = 0"], 8, "TrainConfig.eval_every must be positive, got 0"),
    (["TrainConfig.log_every = 0"], 8, "TrainConfig.log_every must be positive, got 0"),
    (["OptimConfig.b2 = 1.0"], 8, "OptimConfig.b2 = 1.0 must lie in [0, 1)"),
    (["OptimConfig.learning_rate = 1e999"], 8, "OptimConfig.learning_rate = inf must be a finite number"),
]


@pytest.mark.parametrize("bindings,devices,message", BAD)
def test_bad_config_is_one_clear_line(bindings, devices, message):
    with pytest.raises(config.ConfigError) as err:
        config.load("tiny.gin", bindings, num_devices=devices)
    text = str(err.value)
    assert message in text
    assert "\n" not in text
    assert text.startswith("tiny.gin: ")


def test_vocab_smaller_than_the_tokenizer_is_refused_when_the_data_opens():
    """Validation reads no files; the tokenizer is checked against the model when data opens."""
    from maxlm.train import tasks

    cfg = config.load("tiny.gin", ["ModelConfig.vocab_size = 200"], num_devices=8)
    with pytest.raises(config.ConfigError) as err:
        tasks.open_lm_data(cfg)
    text = str(err.value)
    assert "has 259 tokens but ModelConfig.vocab_size = 200" in text
    assert "\n" not in text and text.startswith("tiny.gin: ")


def test_logical_sizes_match_every_parameter():
    """The divisibility checks use one size per logical name: every parameter agrees with it."""
    import flax.linen as nn

    for name in CONFIGS:
        m = config.load(name).model
        sizes = {k: size for k, (_, size) in m.logical_sizes().items()}
        boxed = model.abstract_params(m.__class__(**{**m.__dict__, "n_layers": 2}), boxed=True)
        for leaf in jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)):
            for dim, axis in zip(leaf.value.shape, leaf.names):
                assert dim == (2 if axis == "layers" else sizes[axis]), (name, leaf.names, leaf.value.shape)


def test_missing_config_file():
    with pytest.raises(config.ConfigError, match="config file 'nope.gin' not found"):
        config.load("nope.gin")


def test_gin_syntax_error_names_file(tmp_path):
    path = tmp_path / "broken.gin"
    path.write_text("ModelConfig.d_model = = 3\n")
    with pytest.raises(config.ConfigError) as err:
        config.load(str(path))
    assert str(err.value).startswith("broken.gin: ") and "\n" not in str(err.value)


@pytest.mark.parametrize("binding,message", [
    ("ModelConfig.n_head=3", "doesn't have a parameter named 'n_head'"),
    ("MeshConfig.tensor=3", "MeshConfig"),
])
def test_cli_prints_one_line_and_exits_2(binding, message):
    proc = subprocess.run([sys.executable, "-m", "maxlm.train", "--config=tiny.gin", f"--gin_bindings={binding}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr
    assert lines[0].startswith("maxlm.train: config error: tiny.gin: ")
