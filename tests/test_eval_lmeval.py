"""maxlm.eval's multiple-choice scores equal lm-evaluation-harness's on the same exported model.

lm-eval 0.4.13 runs in its peer environment (tests/peer_envs.py) with its Hugging Face model
(``--model hf``, ``add_bos_token=True``: both sides score ``<|bos|> + context``) over a local YAML
task on the same JSONL file, once with 0 shots and once with 2. Its 2-shot prompts are
deterministic because the YAML picks shots with the ``first_n`` sampler from the test split itself
(lm-eval then skips the question being asked), which is the rule maxlm.eval uses. The file has
multi-token and multi-byte choices, choices with leading spaces and contexts with trailing
whitespace; the 2-shot contexts outgrow the model's 128 tokens, so left truncation is compared too.
"""

import glob
import json
import os
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest

from maxlm import config, model
from maxlm.data import get_tokenizer
from tests.peer_envs import peer_env, require_peer

MC = Path(__file__).parent / "fixtures" / "eval" / "mc.jsonl"
TOLERANCE = 1e-3  # nats per choice; fp32 on both sides, measured ~2e-5

YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
fewshot_split: test
fewshot_config:
  sampler: first_n
num_fewshot: {shots}
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
target_delimiter: " "
fewshot_delimiter: "\\n\\n"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def run_lm_eval(python: Path, hf_dir: Path, tmp: Path, shots: list[int]) -> dict[int, tuple[dict, list[dict]]]:
    """{shots: (aggregate metrics, per-question samples)} from one lm-eval run."""
    tasks = tmp / "lmeval_tasks"
    tasks.mkdir()
    names = {k: f"maxlm_mc_{k}shot" for k in shots}
    for k, name in names.items():
        (tasks / f"{name}.yaml").write_text(YAML.format(name=name, data=MC, shots=k))
    out = tmp / "lmeval_out"
    env = peer_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp / "hf_home"),
                   TOKENIZERS_PARALLELISM="false")
    cmd = [str(python), "-m", "lm_eval", "--model", "hf",
           "--model_args", f"pretrained={hf_dir},dtype=float32,add_bos_token=True",
           "--tasks", ",".join(names.values()), "--include_path", str(tasks), "--device", "cpu",
           "--batch_size", "8", "--log_samples", "--output_path", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(Path(glob.glob(str(out / "*" / "results_*.json"))[0]).read_text())["results"]
    got = {}
    for k, name in names.items():
        (path,) = glob.glob(str(out / "*" / f"samples_{name}_*.jsonl"))
        samples = sorted((json.loads(line) for line in Path(path).read_text().splitlines()), key=lambda s: s["doc_id"])
        got[k] = (results[name], samples)
    return got


@pytest.mark.slow
@pytest.mark.lmeval
def test_multiple_choice_matches_lm_evaluation_harness(tmp_path):
    python = require_peer("lmeval")
    from maxlm.eval.cli import main
    from maxlm.hf.export import export_model
    from maxlm.hf.load import LoadedModel
    from maxlm.infer.placement import inference_mesh

    cfg = config.ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_multiple=64,
                             max_seq_len=128, dtype="float32", init_std=0.2)  # an opinionated random model
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    hf_dir = tmp_path / "hf"
    export_model(LoadedModel(cfg, params, get_tokenizer("byte"), inference_mesh(1), "random"), hf_dir)

    peer = run_lm_eval(python, hf_dir, tmp_path, [0, 2])
    worst = 0.0
    for shots, (metrics, samples) in peer.items():
        out = tmp_path / f"maxlm_{shots}.json"
        assert main(["--checkpoint", str(hf_dir), "--task", str(MC), "--shots", str(shots), "--out", str(out)]) == 0
        (ours,) = json.loads(out.read_text())["results"]
        assert len(samples) == len(ours["samples"]) == 20
        for theirs, mine in zip(samples, ours["samples"]):
            args = [theirs["arguments"][f"gen_args_{i}"] for i in range(len(mine["choices"]))]
            assert [a["arg_0"] for a in args] == [mine["context"]] * len(args)  # the same prompt text
            lls = np.array([float(r[0][0]) for r in theirs["resps"]])
            worst = max(worst, float(np.abs(lls - mine["loglikelihoods"]).max()))
            np.testing.assert_allclose(mine["loglikelihoods"], lls, atol=TOLERANCE, rtol=0,
                                       err_msg=f"{shots}-shot question {theirs['doc_id']}")
            assert (mine["acc"], mine["acc_norm"]) == (theirs["acc"], theirs["acc_norm"]), theirs["doc_id"]
        assert ours["metrics"]["acc"] == pytest.approx(metrics["acc,none"])
        assert ours["metrics"]["acc_norm"] == pytest.approx(metrics["acc_norm,none"])
    print(f"max |maxlm - lm-eval| log-likelihood over 0- and 2-shot: {worst:.2e}")
