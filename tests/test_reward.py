"""Reward model (issue 16, item 2): the Bradley-Terry loss against numpy, the head reading the last
reply token (checked against each sequence scored alone), the Must-show (held-out accuracy above
0.9 on a synthetic preference set whose rule is learnable), resume through the shared loop, the
scoring function (from the run and from its Hugging Face export, which carries the head) and bad
input as one line."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import straight_and_resumed

from maxlm import config, model
from maxlm.data import get_tokenizer, preference
from maxlm.posttrain import reward
from maxlm.train import step

ROOT = Path(__file__).resolve().parents[1]
TOK = get_tokenizer("byte")
PAIRS = [{"prompt": "Uppercase the word.\n\nabc", "chosen": "ABC", "rejected": "abc"},
         {"prompt": [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Uppercase: xy"}],
          "chosen": [{"role": "assistant", "content": "XY"}], "rejected": [{"role": "assistant", "content": "YX!"}]}]


def _write(path: Path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


@pytest.mark.parametrize("center", [0.0, 0.05])
def test_loss_and_metrics_equal_a_numpy_reference(center):
    """Written from TRL's RewardTrainer docs, apart from maxlm.posttrain.reward."""
    rc, rr = np.array([1.5, -0.2, 0.3, 2.0]), np.array([0.5, 0.4, -1.0, 2.5])
    want = -np.log(1 / (1 + np.exp(-(rc - rr)))) + center * (rc + rr) ** 2
    losses, metrics = reward.reward_loss(jnp.asarray(rc), jnp.asarray(rr), center)
    np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-6)
    assert np.asarray(metrics["accuracy"]).tolist() == [1, 0, 1, 0]
    np.testing.assert_allclose(np.asarray(metrics["margin"]), rc - rr, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(metrics["rewards/chosen"]), rc, rtol=1e-6)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_the_head_reads_each_sequence_as_scored_alone(tmp_path, pooling):
    """Padded pair rows give each sequence's reward as if it were scored alone, unpadded: the head on
    the final hidden state at the token before the reply's eos ("last"), or its mean over the
    positions that predict reply tokens ("mean")."""
    cfg = config.load("reward_tiny.gin", ["TrainConfig.init_from=''"], num_devices=8)
    params = model.init_params(cfg.model, jax.random.PRNGKey(1))
    head = reward.head_params(cfg).init(jax.random.PRNGKey(2))[reward.HEAD]
    head = {**head, "bias": jnp.asarray(0.25, head["bias"].dtype)}
    data = preference.load(_write(tmp_path / "p.jsonl", PAIRS), "", 0.0, TOK, 64)
    batch = preference.eval_batches(data.train, TOK, seq_len=64, global_batch=4, num_batches=None)[0]
    for side in preference.SIDES:
        feats = {k: jnp.asarray(batch[f"{side}_{k}"]) for k in ("inputs", "segment_ids", "positions", "weights")}
        got = np.asarray(reward.rewards(cfg.model, params, head, feats, pooling=pooling))
        for i, row in enumerate(data.train):
            ids, mask = row[side], row[f"{side}_mask"]
            assert ids[-1] == TOK.eos_id
            _, hidden = model.forward_hidden(cfg.model, params, jnp.asarray(ids[None, :-1]), final=True)
            per_token = np.asarray(hidden[0].astype(jnp.float32) @ head["score"] + head["bias"])
            want = per_token[-1] if pooling == "last" else per_token[mask[1:] > 0].mean()
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)
    # The scorer computes the same from conversations.
    from maxlm.data import chat

    pairs, _ = preference.read(str(tmp_path / "p.jsonl"))
    scorer = reward.Scorer(cfg.model, params, TOK, head, batch=3, pooling=pooling)
    scores = scorer([p.messages(s) for p in pairs for s in preference.SIDES])
    feats = {k: jnp.asarray(batch[f"chosen_{k}"]) for k in ("inputs", "segment_ids", "positions", "weights")}
    np.testing.assert_allclose(scores[0], np.asarray(reward.rewards(cfg.model, params, head, feats, pooling=pooling))[0],
                               rtol=1e-5)
    assert chat.encode_chat(TOK, pairs[0].messages("chosen"))[0].tolist() == data.train[0]["chosen"].tolist()


def _loop_cfg(run_dir, *bindings):
    return config.load("reward_tiny.gin", [f"TrainConfig.run_dir={str(run_dir)!r}", "TrainConfig.peak_flops=1e12",
                                           *bindings], num_devices=8)


@pytest.mark.slow
def test_reward_model_separates_heldout_pairs(sft_start, tmp_path):
    """The Must-show: held-out accuracy above 0.9 on reward_tiny.gin's set, whose rule a small model
    can learn (follow the prompt's instruction, upper case or capitalized, on the whole word); and the
    scoring function, from the run and from its export (the head in reward_head.safetensors), ranks
    the held-out pairs the same way. (On synthetic:upper's letter-by-letter kinds, reversed and
    substituted, this 0.4M model stays at chance: the README has the figures.)"""
    from maxlm.hf.cli import main as hf_main
    from maxlm.hf.load import load_model
    from maxlm.posttrain import build_task
    from maxlm.posttrain.dpo import PAIR_BATCH, heldout_metrics
    from maxlm.train import pretrain

    cfg = _loop_cfg(tmp_path / "rm", f"TrainConfig.init_from={str(sft_start)!r}")
    summary = pretrain.train(cfg, build_task=build_task)
    loaded = load_model(tmp_path / "rm")
    head, pooling = reward.read_head(loaded.source, loaded.cfg, loaded.run_config)
    assert pooling == cfg.reward.pooling
    pairs = reward.load_data(cfg)
    params = {**loaded.params, step.TASK_PARAMS: {reward.HEAD: head}}
    batches = preference.eval_batches(pairs.eval, TOK, seq_len=cfg.train.seq_len, global_batch=16, num_batches=None)
    metrics = heldout_metrics(reward.make_loss(cfg), params, batches, loaded.mesh, PAIR_BATCH)
    print(f"\nreward model from {sft_start.name} ({cfg.train.steps} steps): held-out pairs {int(metrics['pairs'])}, "
          + ", ".join(f"{k} {metrics[k]:.4g}" for k in reward.METRICS)
          + f"; eval loss {summary['eval_losses'][0][1]:.4f} -> {summary['eval_losses'][-1][1]:.4f}")
    assert metrics["pairs"] == len(pairs.eval) >= 150
    assert metrics["accuracy"] > 0.9, metrics
    assert metrics["margin"] > 0

    scorer = reward.Scorer(loaded.cfg, loaded.params, loaded.tokenizer, head, pooling=pooling)
    chosen = scorer([p.messages("chosen") for p in pairs.eval_pairs])
    rejected = scorer([p.messages("rejected") for p in pairs.eval_pairs])
    assert np.mean(chosen > rejected) == pytest.approx(metrics["accuracy"], abs=1e-9)
    assert hf_main(["export", str(tmp_path / "rm"), "--out", str(tmp_path / "hf")]) == 0
    exported = load_model(tmp_path / "hf")
    exported_head, exported_pooling = reward.read_head(exported.source, exported.cfg)
    assert exported_pooling == pooling
    from_export = reward.Scorer(exported.cfg, exported.params, exported.tokenizer, exported_head, pooling=pooling)
    np.testing.assert_allclose(from_export([p.messages("chosen") for p in pairs.eval_pairs[:8]]), chosen[:8],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_reward_run_resumed_equals_straight(sft_start, tmp_path):
    common = [f"TrainConfig.init_from={str(sft_start)!r}", "TrainConfig.eval_every=10", "TrainConfig.log_every=10",
              "CheckpointConfig.every_steps=10", "OptimConfig.warmup_steps=30"]  # the schedule ignores steps
    straight, resumed = straight_and_resumed(lambda run, n: _loop_cfg(run, *common, f"TrainConfig.steps={n}"), tmp_path,
                                             steps=20, stop_at=10)
    assert resumed["loss"] == pytest.approx(straight["loss"], rel=1e-5)
    assert resumed["eval_losses"][-1] == pytest.approx(straight["eval_losses"][-1], rel=1e-5)


def test_bad_input_is_one_line(tmp_path):
    for bindings, needle in [(["RewardConfig.data=''"], "needs RewardConfig.data"),
                             (["RewardConfig.eval_fraction=0.0"], "held-out pairs"),
                             (["RewardConfig.center_rewards_coefficient=-1.0"], "center_rewards_coefficient"),
                             (["RewardConfig.pooling='max'"], "RewardConfig.pooling"),
                             (["MeshConfig.data=4", "MeshConfig.pipeline=2"], "pipeline"),
                             (["TrainConfig.task='sft'", "SFTConfig.data='synthetic:upper'"], "RewardConfig.data")]:
        with pytest.raises(config.ConfigError) as err:
            config.load("reward_tiny.gin", bindings, num_devices=8)
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    bad = _write(tmp_path / "bad.jsonl", [PAIRS[0], "{not json", {"prompt": "p", "chosen": "a"}, PAIRS[1]])
    pairs = reward.load_data(_loop_cfg(tmp_path / "r", f"RewardConfig.data={bad!r}", "RewardConfig.eval_fraction=0.5"))
    assert pairs.report.used == 2 and {w.rsplit(":", 1)[1] for w, _ in pairs.report.bad_lines} == {"2", "3"}
    proc = subprocess.run([sys.executable, "-m", "maxlm.reward", f"--run_dir={tmp_path / 'x'}",
                           "--gin_bindings=RewardConfig.data='nowhere/*.jsonl'"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no file matches 'nowhere/*.jsonl'" in lines[0], proc.stderr
    help_ = subprocess.run([sys.executable, "-m", "maxlm.reward", "--help"], capture_output=True, text=True,
                           cwd=ROOT, timeout=60)
    assert help_.returncode == 0 and "reward_head.safetensors" in help_.stdout
