"""Fuzzing `python -m maxlm.hf` and `python -m maxlm.plan`: every option, and for hf the checkpoint
it reads, driven out of range, to the wrong type or empty. Each input must be refused with a
non-zero exit, at most 3 lines on stderr, no traceback, and every file that was there before
unchanged, with nothing new (sha256 of the whole workspace before and after).

The table is fixed, plus a few junk strings from a seeded generator. The CLIs run in-process
(``main(argv)``), and a few cases run through the real entry point as subprocesses."""

import dataclasses
import json
import math
import random
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
from safetensors.numpy import save_file

from maxlm import hf
from maxlm.plan import planner as plan
from test_hf_reliability import K_PROJ, LLAMA, hf_tensors, snapshot

RNG = random.Random(1234)
JUNK = ["".join(RNG.choice("azAZ09-_.:/=, ~'\"\\é\t") for _ in range(RNG.randint(1, 12))) for _ in range(4)]
DROP, DIR = object(), object()  # in HFCase.config: remove the field; in HFCase.files: make a directory


@dataclasses.dataclass(frozen=True)
class HFCase:
    name: str
    argv: tuple[str, ...] = ("import", "{hf}", "--out", "{run}")
    config: dict = dataclasses.field(default_factory=dict)  # fields merged into config.json
    raw_config: str | bytes | None = None  # config.json's bytes instead
    tensors: Callable[[dict], dict] | None = None  # a change to the weights
    files: dict = dataclasses.field(default_factory=dict)  # name in HF_DIR -> bytes, DIR, or None (remove)


def _set(name, value):
    return lambda t: {**t, name: value(t[name]) if callable(value) else value}


def _args() -> list[HFCase]:
    out = [HFCase(f"argv {argv}", argv) for argv in [
        (), ("export",), ("",), ("import",), ("import", "{hf}"), ("import", "--out", "{run}"),
        ("import", "{hf}", "--out"), ("import", "{hf}", "{hf}", "--out", "{run}"),
        ("import", "{hf}", "--out", "{run}", "--bogus"), ("import", "{hf}", "--out=--"),
        ("import", "{hf}", "--out", "{run}", "--dtype"), ("--out", "{run}", "import", "{hf}", "-x"),
    ]]
    for value in ["", " ", "int8", "float64", "FLOAT32", "bf16", "nan", "-1", *JUNK]:
        out.append(HFCase(f"--dtype {value!r}", ("import", "{hf}", "--out", "{run}", "--dtype", value)))
    hf_dirs = ["", " ", "{root}/missing", "{file}", "{root}", "/dev/null", "{hf}\0x", *JUNK]
    out += [HFCase(f"HF_DIR {d!r}", ("import", d, "--out", "{run}")) for d in hf_dirs]
    outs = ["", " ", "{file}", "{file}/run", "{hf}", "{hf}/run", "{hf}/..", "{root}", "{existing}",
            "{gin_only}", "{run}\0x", "/proc/maxlm-fuzz/run"]
    out += [HFCase(f"--out {o!r}", ("import", "{hf}", "--out", o)) for o in outs]
    return out


def _config_fields() -> list[HFCase]:
    shapes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "head_dim")
    ints = shapes + ("max_position_embeddings",)
    bad = {f: [-1, "32", 1.5, True, [], {}, math.nan, DROP if f not in ("head_dim", "num_key_value_heads",
                                                                    "max_position_embeddings") else -5]
           for f in ints}
    for f in shapes:  # plausible numbers that do not describe these weights
        bad[f] += [10**9, 2 * LLAMA.get(f, 8)] + ([0] if f != "head_dim" else [])
    for f in ("rms_norm_eps", "rope_theta", "initializer_range"):
        bad[f] = [0, -1.0, "1e-5", True, [], math.nan, math.inf, -math.inf]
    for f in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        bad[f] = ["yes", 2, [], {}] + ([True] if f != "tie_word_embeddings" else [])
    bad["model_type"] = ["bert", "", None, 5, [], {}, "Llama", True, DROP]
    bad["hidden_act"] = ["gelu", "", 5, None, []]
    llama3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=16)
    bad["rope_scaling"] = ["x", [1], 5, {"rope_type": "yarn", "factor": 4.0}, {"rope_type": "llama3"},
                           {**llama3, "factor": "8"}, {**llama3, "factor": math.nan},
                           {**llama3, "attention_factor": "x"}, {**llama3, "attention_factor": 2.0},
                           {"rope_type": []}]
    bad["rope_parameters"] = ["x", [1]]
    cases = [HFCase(f"config {f}={'<dropped>' if v is DROP else repr(v)}", config={f: v})
             for f, values in bad.items() for v in values]
    gpt2 = dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=200, n_positions=64)
    bad_gpt2 = dict(n_head=[0, -4, 3, "4"], n_embd=[0, "x"], n_inner=[-1], n_positions=[0],
                    activation_function=["relu", None], scale_attn_weights=[False],
                    add_cross_attention=[True], layer_norm_epsilon=[math.nan])
    cases += [HFCase(f"gpt2 config {f}={v!r}", raw_config=json.dumps({**gpt2, f: v}))
              for f, values in bad_gpt2.items() for v in values]
    return cases


def _files() -> list[HFCase]:
    raw = ["", "[]", "null", "{", '"llama"', "{}", "NaN", b"\xff\xfe\x00garbage", json.dumps([LLAMA])]
    cases = [HFCase(f"config.json {r!r}", raw_config=r) for r in raw]
    cases += [HFCase("config.json is a directory", files={"config.json": DIR}),
              HFCase("no config.json", files={"config.json": None})]
    weights = {"empty": b"", "garbage": b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage",
               "huge header": (10**15).to_bytes(8, "little") + b"{", "directory": DIR, "missing": None}
    cases += [HFCase(f"model.safetensors {k}", files={"model.safetensors": v}) for k, v in weights.items()]
    cases += [HFCase("pickle only", files={"model.safetensors": None, "pytorch_model.bin": b"\x80\x04junk"}),
              HFCase("index garbage", files={hf.INDEX_FILE: b"{"}),
              HFCase("index not an object", files={hf.INDEX_FILE: b'{"weight_map": []}'}),
              HFCase("index names a missing shard",
                     files={hf.INDEX_FILE: json.dumps({"weight_map": {K_PROJ: "gone.safetensors"}}).encode()})]
    return cases


def _tensors() -> list[HFCase]:
    changes = {
        "nan": lambda x: np.full_like(x, np.nan), "inf": lambda x: np.where(x > 0, np.inf, x),
        "-inf": lambda x: np.full_like(x, -np.inf), "float64 overflow": lambda x: x.astype(np.float64) * 1e300,
        "int32": lambda x: x.astype(np.int32), "int64": lambda x: x.astype(np.int64),
        "uint8": lambda x: x.astype(np.uint8), "bool": lambda x: x > 0,
        "wrong shape": lambda x: x[:4], "transposed": lambda x: np.ascontiguousarray(x.T),
        "scalar": lambda x: np.array(1.0, np.float32), "empty": lambda x: x[:0],
    }
    cases = [HFCase(f"{K_PROJ} {k}", tensors=_set(K_PROJ, v)) for k, v in changes.items()]
    cases += [HFCase("missing tensor", tensors=lambda t: {k: v for k, v in t.items() if k != K_PROJ}),
              HFCase("extra tensor",
                     tensors=_set("model.layers.0.self_attn.q_norm.weight", np.ones(8, np.float32))),
              HFCase("embedding nan", tensors=_set("model.embed_tokens.weight",
                                                   lambda x: np.where(x > 0.05, np.nan, x).astype(x.dtype)))]
    return cases


HF_CASES = _args() + _config_fields() + _files() + _tensors()
PLAN_OPTIONS = {  # option -> values it must refuse (--price is argparse's prefix of --price_per_gpu_hour)
    "--tokens": ["", " ", "abc", "nan", "inf", "-inf", "-1", "0", "-0.0", "1e400", "1e19", "0x10", "1,000", "--"],
    "--gpus": ["", "abc", "nan", "0", "-1", "-8", "2.0", "1e3", "7", "99999999999999999999999", "1" * 400, "--"],
    "--mfu": ["", "abc", "nan", "inf", "0", "-0.5", "1.0001", "2", "1e400", "--"],
    "--price_per_gpu_hour": ["", "abc", "nan", "inf", "-0.01", "-1", "1e5", "1e400", "--"],
    "--price": ["-3", "nan"],
    "--aot_layers": ["", "abc", "1", "-1", "-2", "2.5", "nan", "--"],
    "--gpu": ["", "h900", "H100", "a100 ", "8"],
    "--config": ["", " ", "nonexistent.gin", "{root}", "{garbage}", "{bad_field}", "{binary}", "--"],
    "--gin_bindings": ["", " ", "garbage", "ModelConfig.nope = 1", "ModelConfig.n_layers = -1",
                       "ModelConfig.n_layers = 'x'", "TrainConfig.global_batch = 0", "MeshConfig.data = 0",
                       "OptimConfig.b1 = 1.5", "ModelConfig.d_model = 1e999", "include 'nope.gin'", "--"],
    "--json": ["1", "yes", ""], "--aot": ["no"], "--aot_stock_xla": ["1"],
}
PLAN_CASES = [[f"{opt}={v}"] for opt, values in PLAN_OPTIONS.items() for v in values + JUNK[:2]
              if opt not in ("--json", "--aot", "--aot_stock_xla") or v in values]
PLAN_CASES += [["--tokens"], ["--gpus"], ["--bogus"], ["extra"], ["--gpus", "-4"], ["--tokens", "-inf"],
               ["--config=tiny.gin", "--gin_bindings=MeshConfig.data = 3"]]


# ---------------------------------------------------------------------------------------------- hf


def _workspace(root, case: HFCase, tensors: dict) -> dict[str, str]:
    """A checkpoint (changed as ``case`` says), an existing run directory, a file and earlier
    outputs, under ``root``; returns the placeholders of the argv templates."""
    hf_dir, run, existing, gin_only = root / "hf", root / "run", root / "existing", root / "gin_only"
    for d in (hf_dir, run, existing / "params", gin_only):
        d.mkdir(parents=True)
    config = {k: v for k, v in {**LLAMA, **case.config}.items() if v is not DROP}
    raw = json.dumps(config).encode() if case.raw_config is None else case.raw_config
    (hf_dir / "config.json").write_bytes(raw.encode() if isinstance(raw, str) else raw)
    save_file(case.tensors(dict(tensors)) if case.tensors else tensors, str(hf_dir / "model.safetensors"))
    for name, data in case.files.items():
        path = hf_dir / name
        if path.exists():
            path.unlink()
        if data is DIR:
            path.mkdir()
        elif data is not None:
            path.write_bytes(data)
    (run / "notes.txt").write_text("an earlier run's notes\n")
    (existing / "params" / "x").write_bytes(b"old params")
    (existing / "config.gin").write_text("# an earlier import\n")
    (gin_only / "config.gin").write_text("# an earlier config\n")
    (root / "afile.txt").write_text("keep me\n")
    return {"hf": str(hf_dir), "run": str(run), "existing": str(existing), "gin_only": str(gin_only),
            "file": str(root / "afile.txt"), "root": str(root)}


def _refused_cleanly(main, argv, root, capfd, prefix) -> None:
    before = snapshot(root)
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse
        code = stop.code
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert code not in (0, None), (argv, code, err)
    assert 1 <= len(lines) <= 3 and "Traceback" not in err, (argv, err)
    assert lines[-1].startswith(prefix), (argv, err)
    assert snapshot(root) == before, f"{argv}: files changed or appeared"


@pytest.fixture(scope="module")
def tensors():
    return hf_tensors()


@pytest.mark.parametrize("case", HF_CASES, ids=[c.name for c in HF_CASES])
def test_hf_refuses_cleanly(case, tensors, tmp_path, capfd):
    places = _workspace(tmp_path, case, tensors)
    argv = [arg.format(**places) for arg in case.argv]
    _refused_cleanly(hf.main, argv, tmp_path, capfd, "maxlm.hf: error: ")


def test_hf_accepts_the_unchanged_workspace(tensors, tmp_path, capfd):
    """The control: the fuzzed workspace itself imports, so each refusal above is the change's."""
    places = _workspace(tmp_path, HFCase("control"), tensors)
    assert hf.main(["import", places["hf"], "--out", places["run"]]) == 0, capfd.readouterr().err
    assert (tmp_path / "run" / "notes.txt").read_text() == "an earlier run's notes\n"


# -------------------------------------------------------------------------------------------- plan


@pytest.fixture(scope="module")
def plan_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    (root / "garbage.gin").write_text("this is = = not gin\n")
    (root / "bad_field.gin").write_text("ModelConfig.n_layers = -4\n")
    (root / "binary.gin").write_bytes(b"\xff\xfe\x00\x01")
    return root


@pytest.mark.parametrize("argv", PLAN_CASES, ids=[" ".join(a) for a in PLAN_CASES])
def test_plan_refuses_cleanly(argv, plan_root, capfd):
    places = {name: str(plan_root / f"{name}.gin") for name in ("garbage", "bad_field", "binary")}
    argv = [arg.format(root=plan_root, **places) if "{" in arg else arg for arg in argv]
    _refused_cleanly(plan.main, argv, plan_root, capfd, "maxlm.plan: ")


# ---------------------------------------------------------------------- the real entry points, and the tally


SUBPROCESS = [
    ("maxlm.hf", "--out {file}"), ("maxlm.hf", "nan"),
    ("maxlm.plan", "--tokens=nan"), ("maxlm.plan", "--gpus=0"),
]


@pytest.mark.parametrize("module,what", SUBPROCESS, ids=[f"{m} {w}" for m, w in SUBPROCESS])
def test_real_entry_points_refuse_in_one_line(module, what, tensors, tmp_path):
    if module == "maxlm.hf":
        case = HFCase(what, tensors=_set(K_PROJ, lambda x: np.full_like(x, np.nan)) if what == "nan" else None)
        places = _workspace(tmp_path, case, tensors)
        argv = ["import", places["hf"], "--out", places["file"] if "file" in what else places["run"]]
    else:
        argv = [what]
    before = snapshot(tmp_path)
    proc = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert snapshot(tmp_path) == before


def test_fuzz_tally():
    assert len(HF_CASES) >= 150 and len(PLAN_CASES) >= 100, (len(HF_CASES), len(PLAN_CASES))
    print(f"fuzz: hf {len(HF_CASES)} inputs, plan {len(PLAN_CASES)} inputs; all rejected cleanly")
