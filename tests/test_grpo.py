"""GRPO (issue 16, item 4): group-relative advantages and the clipped, KL-penalised objective against
numpy written from the paper, completion-only weights, the gradient's direction, the verifiers, bad
input as one line, and through the shared loop: the Must-show (the mean reward rises over training,
printed with the KL to the reference) and an interrupted run that resumes where an uninterrupted
one ends (the rollouts are seeded by the step)."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import straight_and_resumed

from maxlm import config, model
from maxlm.data import chat, get_tokenizer
from maxlm.data import prompts as prompt_data
from maxlm.posttrain import grpo
from maxlm.posttrain.dpo import token_logps

TOK = get_tokenizer("byte")


def _write(path: Path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_group_advantages_equal_numpy():
    rewards = np.array([1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5, 0, 0.2, 0.9, 0.4], np.float32)
    adv, std = grpo.group_advantages(rewards, 4)
    for g in range(3):
        r = rewards[4 * g:4 * g + 4].astype(np.float64)
        s = np.sqrt(((r - r.mean()) ** 2).sum() / 3)  # the unbiased std, as torch.std in TRL
        np.testing.assert_allclose(adv[4 * g:4 * g + 4], (r - r.mean()) / (s + 1e-4), rtol=1e-5)
        np.testing.assert_allclose(std[4 * g:4 * g + 4], s, rtol=1e-5)
    assert not adv[4:8].any()  # a group of equal rewards teaches nothing
    unscaled, _ = grpo.group_advantages(rewards, 4, scale=False)  # Dr. GRPO: r - mean
    np.testing.assert_allclose(unscaled, rewards - np.repeat(rewards.reshape(3, 4).mean(1), 4), atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_metrics_equal_a_numpy_reference(beta):
    """Per token -min(ratio A, clip(ratio) A) + beta k3-KL, averaged over each completion's tokens;
    the sampling policy differs from the current one here, so the clip acts."""
    rng = np.random.default_rng(0)
    b, t, clip = 4, 6, 0.2
    logps = rng.normal(-2, 0.5, (b, t))
    old = logps + rng.normal(0, 0.3, (b, t))
    ref = logps + rng.normal(0, 0.2, (b, t))
    adv = np.array([1.5, -0.7, 0.0, 2.0])
    w = (np.arange(t)[None] < np.array([6, 3, 5, 1])[:, None]).astype(np.float64)
    ratio = np.exp(logps - old)
    pg = -np.minimum(ratio * adv[:, None], np.clip(ratio, 1 - clip, 1 + clip) * adv[:, None])
    kl = np.exp(ref - logps) - (ref - logps) - 1
    want = ((pg + beta * kl) * w).sum(1) / w.sum(1)
    clipped = ((ratio < 1 - clip) & (adv[:, None] < 0)) | ((ratio > 1 + clip) & (adv[:, None] > 0))
    losses, metrics = grpo.grpo_loss(*(jnp.asarray(x, jnp.float32) for x in (logps, old)),
                                     jnp.asarray(ref, jnp.float32) if beta else None, jnp.asarray(adv, jnp.float32),
                                     jnp.asarray(w, jnp.float32), clip=clip, beta=beta)
    np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(metrics["clip_fraction"]), (clipped * w).sum(1) / w.sum(1), atol=1e-6)
    np.testing.assert_allclose(np.asarray(metrics["kl"]), (kl * w).sum(1) / w.sum(1) if beta else 0, rtol=1e-5)
    assert np.asarray(metrics["completion_length"]).tolist() == [6, 3, 5, 1]


def test_rows_weigh_exactly_the_completion_and_the_gradient_favours_the_rewarded_one():
    cfg = config.load("grpo_tiny.gin", ["TrainConfig.init_from=''", "GRPOConfig.kl_coef=0.0"], num_devices=8)
    prompt = chat.encode_prompt(TOK, chat.instruction_messages("Uppercase the word.", "abc"))
    good, bad = (np.array(list(s.encode()) + [TOK.eos_id]) for s in ("ABC\n", "abc\n"))
    rows = grpo.training_rows([prompt, prompt], [good, bad], 80, TOK.pad_id)
    for i, c in enumerate((good, bad)):
        w = rows["weights"][i] > 0
        assert rows["targets"][i][w].tolist() == c.tolist()
        assert rows["inputs"][i][:prompt.size].tolist() == prompt.tolist()
        assert rows["segment_ids"][i].sum() == prompt.size + c.size - 1
    batch = {k: jnp.asarray(v) for k, v in rows.items()}
    batch.update(advantages=jnp.asarray([1.0, -1.0]), rewards=jnp.asarray([1.0, 0.0]), reward_std=jnp.zeros(2),
                 rows=jnp.ones(2))
    forward = lambda p, *a, dropout_rng=None: model.forward(cfg.model, p, *a)
    loss_fn = grpo.make_loss(cfg, forward, None)
    params = model.init_params(cfg.model, jax.random.PRNGKey(0))

    def seq_logps(p):
        logits, _ = forward(p, batch["inputs"], batch["segment_ids"], batch["positions"])
        return np.asarray(jnp.sum(token_logps(logits, batch["targets"], cfg.model.vocab_size) * batch["weights"], -1))

    grads = jax.grad(lambda p: loss_fn(p, batch, None)[0])(params)
    before, after = seq_logps(params), seq_logps(jax.tree.map(lambda p, g: p - 1e-2 * g, params, grads))
    assert after[0] > before[0] and after[1] < before[1], (before, after)


def test_verifiers():
    assert grpo.verifier("exact")("ABC", "ABC") == 1.0 and grpo.verifier("exact")("ABD", "ABC") == 0.0
    assert grpo.verifier("contains")("it is 7.", "7") == 1.0
    assert grpo.verifier("similarity")("ABD", "ABC") == pytest.approx(2 / 3)
    assert grpo.verifier("python:operator:eq")("x", "x") == 1.0
    for spec in ("python:no_such_module:f", "python:operator:no_such_function", "python:nocolon", "regex"):
        with pytest.raises(config.ConfigError) as err:
            grpo.verifier(spec)
        assert "\n" not in str(err.value) and "GRPOConfig.reward" in str(err.value)


def test_bad_input_is_one_line(tmp_path):
    for bindings, needle in [(["GRPOConfig.prompts=''"], "needs GRPOConfig.prompts"),
                             (["GRPOConfig.group_size=3"], "divide by GRPOConfig.group_size"),
                             (["GRPOConfig.group_size=1"], "GRPOConfig.group_size"),
                             (["GRPOConfig.temperature=0.0"], "temperature"),
                             (["GRPOConfig.reward='regex'"], "GRPOConfig.reward"),
                             (["GRPOConfig.clip_range=0.0"], "clip_range"),
                             (["GRPOConfig.max_new_tokens=80"], "max_new_tokens"),
                             (["TrainConfig.task='sft'", "SFTConfig.data='synthetic:upper'"], "GRPOConfig.prompts")]:
        with pytest.raises(config.ConfigError) as err:
            config.load("grpo_tiny.gin", bindings, num_devices=8)
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    path = _write(tmp_path / "p.jsonl", [{"prompt": "What is 3+4?", "answer": "7"}, "{not json",
                                         {"prompt": "p"}, {"prompt": [{"role": "assistant", "content": "x"}],
                                                           "answer": "y"},
                                         {"prompt": "q", "answer": 7}, {"prompt": "x" * 100, "answer": "y"},
                                         {"prompt": "What is 3+4?", "answer": "7"}, {"prompt": "2+2?", "answer": "4"}])
    data = prompt_data.load(path, 0.0, TOK, 80, 12)
    r = data.report
    assert r.lines == 8 and r.used == 2 and len(data.train) == 2
    assert dict(r.dropped) == {"bad_line": 4, "too_long": 1, "exact_dup": 1}
    where = {w.rsplit(":", 1)[1]: why for w, why in r.bad_lines}
    assert set(where) == {"2", "3", "4", "5", "6"}
    assert "'answer'" in where["3"] and "assistant" in where["4"] and "not a string" in where["5"]


def _loop_cfg(run_dir, *bindings):
    return config.load("grpo_tiny.gin", [f"TrainConfig.run_dir={str(run_dir)!r}", "TrainConfig.peak_flops=1e12",
                                         *bindings], num_devices=8)


def _rewards(run_dir: Path) -> list[tuple[int, float, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["reward"], r["kl"]) for r in rows if "reward" in r]


@pytest.mark.slow
def test_grpo_raises_the_mean_reward(sft_start, tmp_path):
    """The Must-show: the training reward (completions sampled from the current policy) rises by a
    clear margin from the first steps to the last, with the KL to the reference printed beside it,
    and the held-out prompts' greedy replies earn more at the end than at the start."""
    from maxlm.posttrain import build_task
    from maxlm.train import pretrain

    cfg = _loop_cfg(tmp_path / "grpo", f"TrainConfig.init_from={str(sft_start)!r}")
    summary = pretrain.train(cfg, build_task=build_task)
    logged = _rewards(tmp_path / "grpo")
    start, end = np.mean([r for _, r, _ in logged[:2]]), np.mean([r for _, r, _ in logged[-4:]])
    kl_end = np.mean([k for _, _, k in logged[-4:]])
    held = [m.get("eval/reward") for _, m in summary["eval_metrics"]]
    print(f"\nGRPO from {sft_start.name} ({cfg.train.steps} steps, {cfg.grpo.reward} reward): mean training reward "
          f"{start:.3f} (first {2 * cfg.train.log_every} steps) -> {end:.3f} (last {4 * cfg.train.log_every}), "
          f"KL to the reference {kl_end:.3f}; held-out greedy reward {held[0]:.3f} -> {held[-1]:.3f}")
    assert end > start + 0.15, logged
    assert held[-1] > held[0] + 0.05, held
    assert 0 < kl_end < 1.0


@pytest.mark.slow
def test_grpo_run_resumed_equals_straight(sft_start, tmp_path):
    common = [f"TrainConfig.init_from={str(sft_start)!r}", "TrainConfig.eval_every=10", "TrainConfig.log_every=5",
              "CheckpointConfig.every_steps=5", "GRPOConfig.eval_prompts=8", "TrainConfig.global_batch=16"]
    straight, resumed = straight_and_resumed(lambda run, n: _loop_cfg(run, *common, f"TrainConfig.steps={n}"), tmp_path,
                                             steps=10, stop_at=5)
    assert _rewards(tmp_path / "resumed")[-1] == pytest.approx(_rewards(tmp_path / "straight")[-1], rel=1e-5)
    assert resumed["loss"] == pytest.approx(straight["loss"], rel=1e-4, abs=1e-7)
    assert resumed["eval_metrics"][-1] == straight["eval_metrics"][-1]


@pytest.mark.slow
def test_a_reward_model_scores_the_rollouts(sft_start, tmp_path):
    """GRPOConfig.reward = 'model:RUN_DIR': the rollout's rewards are the reward model's scores of
    each prompt with its reply, as the run opened by maxlm.hf.load scores them; a run that is not a
    reward model, or no run at all, is one line."""
    from maxlm.hf.load import load_model
    from maxlm.posttrain import build_task, reward
    from maxlm.train import pretrain

    rm = tmp_path / "rm"
    pretrain.train(config.load("reward_tiny.gin", [f"TrainConfig.run_dir={str(rm)!r}", "TrainConfig.init_from=''",
                                                   "TrainConfig.steps=2", "TrainConfig.eval_every=2",
                                                   "TrainConfig.peak_flops=1e12"], num_devices=8),
                   build_task=build_task)
    fn = grpo.reward_function(_loop_cfg(tmp_path / "g", "TrainConfig.init_from=''", f"GRPOConfig.reward='model:{rm}'"))
    prompts = prompt_data.read("synthetic:upper:3")[0]
    replies = ["ABC", "xyz", ""]
    loaded = load_model(rm)
    head, pooling = reward.read_head(loaded.source, loaded.cfg, loaded.run_config)
    scorer = reward.Scorer(loaded.cfg, loaded.params, loaded.tokenizer, head, pooling=pooling)
    want = scorer([p.messages + [{"role": "assistant", "content": r}] for p, r in zip(prompts, replies)])
    np.testing.assert_allclose(fn(prompts, replies), want, rtol=1e-5, atol=1e-6)
    for run, needle in [(sft_start, "not a reward model"), (tmp_path / "nowhere", "config.gin is missing")]:
        with pytest.raises(config.ConfigError) as err:
            grpo.reward_function(_loop_cfg(tmp_path / "g", "TrainConfig.init_from=''", f"GRPOConfig.reward='model:{run}'"))
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
