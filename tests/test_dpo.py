"""DPO (issue 16, items 1 and 3): preference data through the one chat template with reply-only
weights, the DPO / IPO / robust losses and TRL's metrics against numpy and against TRL itself, the
reference (a frozen copy, or the base without LoRA adapters), and the Must-show: from a tiny SFT'd
model, DPO on a synthetic preference task lifts held-out reward accuracy above 0.9 and the rate at
which greedy replies follow the rule."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import straight_and_resumed

from maxlm import config, model
from maxlm.data import get_tokenizer
from maxlm.data import preference
from maxlm.posttrain import dpo

TOK = get_tokenizer("byte")
ASSISTANT = list(b"<|assistant|>\n")

# Summed reply log-probs of four pairs (policy and reference), with the reply lengths IPO needs.
PC = np.array([-10.0, -4.0, -20.0, -7.5])
PR = np.array([-12.0, -3.0, -15.0, -9.0])
RC = np.array([-11.0, -5.0, -18.0, -7.0])
RR = np.array([-11.5, -4.0, -16.0, -8.0])
LC = np.array([5.0, 3.0, 9.0, 4.0])
LR = np.array([6.0, 2.0, 7.0, 4.0])


def _log_sigmoid(x):
    return -np.log1p(np.exp(-x))


def _numpy_dpo(loss_type, beta, ls):
    """Written from the papers (and TRL's docs), apart from maxlm.posttrain.dpo."""
    cr, rr = PC - RC, PR - RR
    h = cr - rr
    if loss_type == "sigmoid":
        losses = -(1 - ls) * _log_sigmoid(beta * h) - ls * _log_sigmoid(-beta * h)
    elif loss_type == "robust":
        losses = (-(1 - ls) * _log_sigmoid(beta * h) + ls * _log_sigmoid(-beta * h)) / (1 - 2 * ls)
    else:
        losses = (cr / LC - rr / LR - 1 / (2 * beta)) ** 2
    return losses.mean(), {"rewards/chosen": (beta * cr).mean(), "rewards/rejected": (beta * rr).mean(),
                           "rewards/accuracies": (beta * cr > beta * rr).mean(),
                           "rewards/margins": (beta * cr - beta * rr).mean(),
                           "logps/chosen": PC.mean(), "logps/rejected": PR.mean()}


CASES = [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0), ("ipo", 0.5, 0.0), ("robust", 0.1, 0.1),
         ("robust", 0.3, 0.25)]


def _ours(loss_type, beta, ls):
    losses, metrics = dpo.dpo_loss(*(jnp.asarray(x, jnp.float32) for x in (PC, PR, RC, RR)), beta=beta,
                                   loss_type=loss_type, label_smoothing=ls, chosen_len=jnp.asarray(LC),
                                   rejected_len=jnp.asarray(LR))
    return float(losses.mean()), {k: float(v.mean()) for k, v in metrics.items()}


@pytest.mark.parametrize("loss_type,beta,ls", CASES)
def test_loss_and_metrics_equal_a_numpy_reference(loss_type, beta, ls):
    want_loss, want = _numpy_dpo(loss_type, beta, ls)
    loss, got = _ours(loss_type, beta, ls)
    assert set(got) == set(dpo.METRICS) == set(want)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert got["rewards/accuracies"] == 0.5  # pairs 0 and 3 are right, 1 and 2 wrong: the example is not trivial


def _trl_loss(loss_type, beta, ls):
    """TRL's DPOTrainer._compute_loss on the same summed log-probs: a stand-in model returns
    per-token log-probs whose sum over each completion is the given sequence log-prob, the
    reference log-probs come precomputed, and the trainer is a bare namespace with the fields the
    method reads."""
    torch = pytest.importorskip("torch")
    trainer_mod = pytest.importorskip("trl.trainer.dpo_trainer")
    import collections
    import types

    B, T = PC.size, 12
    comp = np.zeros((2 * B, T), np.int64)
    for i, n in enumerate(np.r_[LC, LR].astype(int)):
        comp[i, 1:1 + n] = 1  # the completion's tokens, after one prompt token
    per_token = np.zeros((2 * B, T - 1))
    for i, total in enumerate(np.r_[PC, PR]):
        n = int(np.r_[LC, LR][i])
        per_token[i, :n] = total / n  # targets of positions 0..n-1 are the completion's tokens
    out = types.SimpleNamespace(log_probs=torch.tensor(per_token), entropy=torch.zeros(2 * B, T - 1),
                                mean_logits=torch.zeros(2 * B, T - 1), is_top1=torch.zeros(2 * B, T - 1, dtype=bool))

    class Model:
        training = True

        def __call__(self, **kwargs):
            return out
    metrics = {"train": collections.defaultdict(list)}
    acc = types.SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x)
    fake = types.SimpleNamespace(model=Model(), accelerator=acc, aux_loss_enabled=False, ld_alpha=None,
                                 precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
                                 loss_weights=[1.0], beta=beta, label_smoothing=ls, use_weighting=False,
                                 _metrics=metrics, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.ones(2 * B, T, dtype=torch.long), "attention_mask": torch.ones(2 * B, T, dtype=torch.long),
              "completion_mask": torch.tensor(comp), "ref_chosen_logps": torch.tensor(RC),
              "ref_rejected_logps": torch.tensor(RR)}
    loss = trainer_mod.DPOTrainer._compute_loss(fake, fake.model, inputs, False)
    return float(loss), {k: metrics["train"][k][-1] for k in dpo.METRICS}


@pytest.mark.parametrize("loss_type,beta,ls", [c for c in CASES if c[0] != "sigmoid" or not c[2]])
def test_loss_and_metrics_equal_trl(loss_type, beta, ls):
    """sigmoid with label_smoothing (cDPO) is left out: TRL 1.x no longer smooths its sigmoid loss (its
    robust loss carries label smoothing); maxlm keeps cDPO's form, TRL 0.x's, checked against numpy above."""
    want_loss, want = _trl_loss(loss_type, beta, ls)
    loss, got = _ours(loss_type, beta, ls)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for k in dpo.METRICS:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


# ---- data


PAIRS = [
    {"prompt": "Uppercase the word.\n\nabc", "chosen": "ABC", "rejected": "abc"},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
     "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "five, I think"}]},
]


def _write(path: Path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def _expected_weights(ids: np.ndarray) -> np.ndarray:
    """Written apart from maxlm.data.chat: the reply is the tokens after the LAST "<|assistant|>\\n"
    up to and including eos; position j's weight is whether its target, token j + 1, is one."""
    starts = [j + 1 for j in range(len(ids)) if j + 1 >= len(ASSISTANT) and list(ids[j + 1 - len(ASSISTANT):j + 1]) == ASSISTANT]
    reply = np.zeros(ids.size, bool)
    reply[starts[-1]:] = True
    eos = starts[-1] + list(ids[starts[-1]:]).index(TOK.eos_id)
    reply[eos + 1:] = False
    return np.r_[reply[1:], False]


def test_pair_weights_cover_exactly_each_reply(tmp_path):
    path = _write(tmp_path / "p.jsonl", PAIRS)
    data = preference.load(path, "", 0.0, TOK, 128)
    assert data.report.used == 2 and not data.report.dropped
    batch = preference.eval_batches(data.train, TOK, seq_len=128, global_batch=2, num_batches=None)[0]
    assert set(batch) == set(dpo.PAIR_BATCH)
    assert batch["weights"].tolist() == [1.0, 1.0]  # one weight per pair
    for i, rec in enumerate(PAIRS):
        c, r = (batch[f"{s}_segment_ids"][i].sum() for s in preference.SIDES)
        ids = {s: batch[f"{s}_inputs"][i][:n] for s, n in zip(preference.SIDES, (c, r))}
        prompt = preference.chat.encode_prompt(TOK, preference.pair_of(rec, "x")[0].prompt)
        for side in preference.SIDES:
            assert np.array_equal(ids[side][:prompt.size], prompt)  # both sides share the prompt exactly
            w = batch[f"{side}_weights"][i]
            assert np.array_equal(w[:ids[side].size], _expected_weights(ids[side])), side
            assert not w[ids[side].size:].any()  # padding carries none
            reply = bytes(int(t) for t in np.asarray(batch[f"{side}_targets"][i])[w > 0] if t < 256).decode()
            text = rec[side] if isinstance(rec[side], str) else rec[side][0]["content"]
            assert reply == text + "\n"  # the reply, its closing newline, then eos (not a byte)
            assert np.asarray(batch[f"{side}_targets"][i])[w > 0][-1] == TOK.eos_id
        # the earlier assistant turn of the conversation ("Hello!") carries no weight
        assert int(batch["chosen_weights"][i].sum()) == len((PAIRS[i]["chosen"] if i == 0 else "4").encode()) + 2


def test_bad_lines_are_counted_with_line_numbers(tmp_path):
    lines = [PAIRS[0], "{not json", {"prompt": "p", "chosen": "a"}, {"prompt": "p", "chosen": "  ", "rejected": "b"},
             {"prompt": 5, "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": "x" * 300, "rejected": "b"},
             {"prompt": "p", "chosen": "same", "rejected": "same"},
             {"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "chosen": "a",
              "rejected": "b"},
             {"prompt": "p", "chosen": [{"role": "user", "content": "no reply"}], "rejected": "b"}, "", PAIRS[1]]
    path = _write(tmp_path / "bad.jsonl", lines)
    data = preference.load(path, "", 0.0, TOK, 128)
    r = data.report
    assert r.lines == 11 and r.used == 2
    assert dict(r.dropped) == {"bad_line": 6, "empty_reply": 1, "too_long": 1, "same_reply": 1}
    where = {w.rsplit(":", 1)[1]: why for w, why in r.bad_lines}
    assert set(where) == {"2", "3", "4", "5", "6", "7", "8", "9", "10"}
    assert "not JSON" in where["2"] and "'rejected'" in where["3"] and "empty" in where["4"]
    assert "not a string or a list" in where["5"] and "TrainConfig.seq_len = 128" in where["6"]
    assert "same" in where["7"] and "ends with an assistant" in where["8"] and "no assistant" in where["9"]
    assert f"{path}:6" in r.summary("preference data")


def test_synthetic_pairs_follow_and_break_the_rule():
    pairs, report = preference.read("synthetic:upper:40")
    assert report.lines == 40
    for p in pairs:
        word = p.prompt[0]["content"].split("\n\n")[1]
        assert p.chosen[0]["content"] == word.upper() and p.rejected[0]["content"] != word.upper()
    kinds = {p.rejected[0]["content"] == p.prompt[0]["content"].split("\n\n")[1] for p in pairs}
    assert kinds == {True, False}  # several kinds of wrong answer


def test_synthetic_pairs_take_the_kinds_of_wrong_reply_asked_for():
    """synthetic:TASK:N:KINDS rejects with the kinds named, in turn; "other" is the answer another
    task of the mixture gives (here: the uppercased word for "Capitalize", and the reverse)."""
    pairs, _ = preference.read("synthetic:upper+capitalize:40:unchanged+dropped+other")
    seen = set()
    for i, p in enumerate(pairs):
        instruction, word = p.prompt[0]["content"].split("\n\n")
        upper = instruction.startswith("Uppercase")
        right, other = (word.upper(), word.capitalize()) if upper else (word.capitalize(), word.upper())
        kind = ("unchanged", "dropped", "other")[(i // 2) % 3]
        rejected = p.rejected[0]["content"]
        assert p.chosen[0]["content"] == right and rejected != right
        assert {"unchanged": rejected == word, "dropped": len(rejected) == len(word) - 1,
                "other": rejected == other}[kind], (kind, p)
        seen.add((upper, kind))
    assert len(seen) == 6
    for spec, needle in [("synthetic:upper:40:sideways", "unknown kind of wrong reply 'sideways'"),
                         ("synthetic:upper:40:other", "needs a mixture"),
                         ("synthetic:upper:forty", "N a number")]:
        with pytest.raises(preference.PreferenceDataError) as err:
            preference.read(spec)
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_bad_config_is_one_line():
    for bindings, needle in [(["DPOConfig.data=''"], "needs DPOConfig.data"),
                             (["DPOConfig.loss_type='kto'"], "DPOConfig.loss_type"),
                             (["DPOConfig.label_smoothing=0.5"], "[0, 0.5)"),
                             (["DPOConfig.beta=0.0"], "beta"),
                             (["DPOConfig.loss_type='ipo'", "DPOConfig.label_smoothing=0.1"], "ipo"),
                             (["DPOConfig.precompute_ref=True", "ModelConfig.lora_rank=4"], "precompute_ref"),
                             (["TrainConfig.task='sft'", "SFTConfig.data='synthetic:upper'"], "DPOConfig.data")]:
        with pytest.raises(config.ConfigError, match=None) as err:
            config.load("dpo_tiny.gin", bindings, num_devices=8)
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


# ---- the loss on a model: sequence log-probs, per-pair normalisation, the reference


def test_sequence_logps_and_per_pair_means_match_a_direct_computation(tmp_path):
    """The loss function's log-probs equal each sequence scored alone (no padding, no pairing), and
    its sums divided by the pair weight are per-pair means (padding rows count for nothing)."""
    cfg = config.load("dpo_tiny.gin", ["TrainConfig.init_from=''"], num_devices=8)
    params = model.init_params(cfg.model, jax.random.PRNGKey(3))
    data = preference.load(_write(tmp_path / "p.jsonl", PAIRS), "", 0.0, TOK, 128)
    batch = preference.eval_batches(data.train, TOK, seq_len=128, global_batch=4, num_batches=None)[0]
    assert batch["weights"].tolist() == [1, 1, 0, 0]
    forward = lambda p, *a, dropout_rng=None: model.forward(cfg.model, p, *a)
    want = {}
    for side in preference.SIDES:
        for i, row in enumerate(data.train):
            ids, mask = row[side], row[f"{side}_mask"]
            logits, _ = model.forward(cfg.model, params, jnp.asarray(ids[None, :-1]))
            logp = jax.nn.log_softmax(logits[0, :, :cfg.model.vocab_size].astype(jnp.float32))
            want[side, i] = float(jnp.sum(logp[jnp.arange(ids.size - 1), ids[1:]] * mask[1:]))
    pc, pr = dpo.sequence_logps(forward, params, {k: jnp.asarray(v) for k, v in batch.items()}, cfg.model.vocab_size)
    for i in range(2):
        np.testing.assert_allclose([pc[i], pr[i]], [want["chosen", i], want["rejected", i]], rtol=2e-5)
    class FixedReference:  # the reference's log-probs, set by hand: only make_loss's arithmetic is under test
        def logps(self, _params, _batch):
            return jnp.asarray([want["chosen", 0] + 1, 0, 0, 0.]), jnp.asarray([want["rejected", 0] - 2, 0, 0, 0.])

    ref = FixedReference()
    loss_fn = dpo.make_loss(cfg, forward, ref)
    loss_sum, weight, aux = loss_fn(params, {k: jnp.asarray(v) for k, v in batch.items()}, None)
    assert float(weight) == 2
    np.testing.assert_allclose(float(aux["logps/chosen"]) / 2, (want["chosen", 0] + want["chosen", 1]) / 2, rtol=2e-5)
    np.testing.assert_allclose(float(aux["rewards/chosen"]) / 2, (0.1 * -1 + 0.1 * want["chosen", 1]) / 2, rtol=1e-4)


def _loop_cfg(run_dir, *bindings, gin="dpo_tiny.gin"):
    base = [f"TrainConfig.run_dir={str(run_dir)!r}", "TrainConfig.peak_flops=1e12"]
    return config.load(gin, base + list(bindings), num_devices=8)


def _heldout(cfg, run_dir):
    """(TRL's held-out metrics, the exact-match rate of greedy replies) of ``run_dir``'s newest
    checkpoint, with ``cfg``'s reference (its TrainConfig.init_from)."""
    from maxlm.hf.load import load_model
    from maxlm.posttrain import sft
    from maxlm.train import step

    loaded = load_model(run_dir)
    cfg = cfg.replace(model=vars(loaded.cfg))
    mesh = loaded.mesh  # the parameters' (one device): the batches go there too
    forward = step.model_forward(cfg, mesh)
    pairs = dpo.load_data(cfg)
    batches = preference.eval_batches(pairs.eval, TOK, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch,
                                      num_batches=None)
    loss_fn = dpo.make_loss(cfg, forward, dpo.load_reference(cfg, mesh, forward))
    metrics = dpo.heldout_metrics(loss_fn, loaded.params, batches, mesh, dpo.PAIR_BATCH)
    em = sft.exact_match(cfg, loaded.params, dpo.examples_of(pairs.eval_pairs[:100]), TOK, cfg.dpo.max_new_tokens)
    return metrics, em


@pytest.mark.slow
def test_dpo_lifts_heldout_reward_accuracy_and_the_rule_following_rate(sft_start, tmp_path):
    """The Must-show: from a tiny SFT'd model, DPO on synthetic preference pairs puts held-out
    reward accuracy above 0.9, with a positive margin, and more greedy replies follow the rule."""
    from maxlm.posttrain import build_task
    from maxlm.train import pretrain

    cfg = _loop_cfg(tmp_path / "dpo", f"TrainConfig.init_from={str(sft_start)!r}", "DPOConfig.eval_prompts=0")
    _, before = _heldout(cfg, sft_start)
    pretrain.train(cfg, build_task=build_task)
    metrics, after = _heldout(cfg, tmp_path / "dpo")
    print(f"\nDPO from {cfg.train.init_from} ({cfg.train.steps} steps): held-out pairs {int(metrics['pairs'])}, "
          + ", ".join(f"{k} {metrics[k]:.4g}" for k in dpo.METRICS) + f"; exact match {before.score:.1%} -> "
          f"{after.score:.1%} of {after.n}")
    assert metrics["pairs"] == len(dpo.load_data(cfg).eval)
    assert metrics["rewards/accuracies"] > 0.9, metrics
    assert metrics["rewards/margins"] > 0 and metrics["rewards/chosen"] > metrics["rewards/rejected"], metrics
    assert after.score > before.score, (before, after)


@pytest.mark.slow
def test_lora_dpo_resumed_equals_straight(sft_start, tmp_path):
    """LoRA DPO (the reference is the policy without its adapters): 10 steps, then resumed to 20,
    end where 20 straight steps end."""
    common = [f"TrainConfig.init_from={str(sft_start)!r}", "ModelConfig.lora_rank=8", "DPOConfig.eval_prompts=0",
              "TrainConfig.eval_every=10", "TrainConfig.log_every=10", "CheckpointConfig.every_steps=10",
              "OptimConfig.warmup_steps=30"]  # all 20 steps in warmup: the schedule ignores TrainConfig.steps
    straight, resumed = straight_and_resumed(lambda run, n: _loop_cfg(run, *common, f"TrainConfig.steps={n}"), tmp_path,
                                             steps=20, stop_at=10)
    assert resumed["loss"] == pytest.approx(straight["loss"], rel=1e-5)
    assert resumed["eval_losses"][-1] == pytest.approx(straight["eval_losses"][-1], rel=1e-5)
