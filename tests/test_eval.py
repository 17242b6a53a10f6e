"""maxlm.eval: perplexity and multiple-choice scores against direct computation with model.forward,
answer extraction, kappa against textbook examples, the rating sheet, bad input, and eval_tasks
inside a training run."""

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from maxlm import config, model
from maxlm.data import get_tokenizer
from maxlm.eval import TaskError, load_task, multiple_choice, perplexity
from maxlm.eval.cli import main
from maxlm.eval.generation import extract_answer
from maxlm.eval.human import COLUMNS, DIMENSIONS, agreement, cohen_kappa, fleiss_kappa, read_sheet, write_sheet
from maxlm.eval.loglikelihood import Scorer, bucket, encode_pair

FIXTURES = Path(__file__).parent / "fixtures" / "eval"
MC = FIXTURES / "mc.jsonl"
TOK = get_tokenizer("byte")


@pytest.fixture(scope="module")
def tiny():
    """A random Llama-family model with a 64-token context, opinionated enough (init_std 0.2)
    that its choices' log-likelihoods are far apart."""
    cfg = config.ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_multiple=64,
                             max_seq_len=64, dtype="float32", init_std=0.2)
    return cfg, model.init_params(cfg, jax.random.PRNGKey(1))


def direct_logprobs(cfg, params, tokens):
    """log p(tokens[i + 1] | tokens[:i + 1]) for one sequence, straight from model.forward. Zeros
    after the end (so that every call has one shape) cannot change earlier logits: it is causal."""
    n = len(tokens) - 1
    padded = np.zeros((1, cfg.max_seq_len), np.int32)
    padded[0, :n] = tokens[:-1]
    logits = model.forward(cfg, params, padded)[0][0, :n, :cfg.vocab_size]
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    return np.asarray(logp)[np.arange(n), np.asarray(tokens[1:])]


def test_perplexity_and_bits_per_byte_equal_direct_computation(tiny):
    cfg, params = tiny
    texts = ["hello world", "def f(x):\n    return x * 2\n" * 6, "naïve café ☕"]  # one spans 3 windows
    got = perplexity.score_texts(Scorer(cfg, params, batch_size=4), TOK, texts)
    nll = tokens = 0
    for text in texts:
        ids = TOK.encode(text)  # [bos] + bytes + [eos], as in training
        for start in range(0, len(ids) - 1, cfg.max_seq_len):
            piece = ids[start:start + cfg.max_seq_len + 1]
            nll -= direct_logprobs(cfg, params, piece).sum()
            tokens += len(piece) - 1
    n_bytes = sum(len(t.encode()) for t in texts)
    assert got["tokens"] == tokens and got["bytes"] == n_bytes == tokens - len(texts)  # + each eos
    assert got["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(nll / math.log(2) / n_bytes, rel=1e-5)


def test_windows_cover_every_prediction_once():
    ids = np.arange(10)
    pieces = perplexity.windows(ids, 4)
    assert [list(p) for p in pieces] == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9]]
    assert bucket(1, 64) == 16 and bucket(17, 64) == 32 and bucket(100, 64) == 64


def test_encode_pair_moves_trailing_whitespace_and_adds_bos():
    ctx, cont = encode_pair(TOK, "Answer:  ", "Paris")
    assert ctx.tolist() == [TOK.bos_id, *b"Answer:"] and cont.tolist() == list(b"  Paris")


def test_multiple_choice_matches_direct_loglikelihoods(tiny, tmp_path):
    cfg, params = tiny
    question, choices = "Q: which word? A: ", ["cat", " dog", "elephant", "x"]  # trailing and leading spaces
    direct = []
    for choice in choices:  # lm-eval's split: the context's trailing space joins the continuation
        ctx = [TOK.bos_id, *question.rstrip().encode()]
        cont = list(("  " + choice).encode())
        direct.append(direct_logprobs(cfg, params, ctx + cont)[-len(cont):].sum())
    gold = int(np.argmax(direct))
    task = load_task(str(write_jsonl(tmp_path / "one.jsonl",
                                     [{"question": question, "choices": choices, "answer": "ABCD"[gold]}])))
    out = multiple_choice.evaluate(task, Scorer(cfg, params, batch_size=8), TOK)
    sample = out["samples"][0]
    np.testing.assert_allclose(sample["loglikelihoods"], direct, atol=1e-4)
    assert sample["gold"] == gold and out["metrics"]["acc"] == 1.0
    chars = np.array([len(c) for c in choices])  # acc_norm divides by characters, as lm-eval 0.4 does
    assert sample["pred_norm"] == int(np.argmax(np.array(direct) / chars))


def test_few_shot_context_is_first_other_questions():
    task = load_task(str(MC))
    doc = task.docs[0]
    shots = multiple_choice.shots_for(doc, task.docs, 2)
    assert shots == [task.docs[1], task.docs[2]]
    ctx = multiple_choice.context(task.docs[1], multiple_choice.shots_for(task.docs[1], task.docs, 2))
    assert ctx == ("The capital of France is Paris\n\n"
                   "Water boils at sea level at 100 degrees Celsius\n\nQuestion: What is 2 + 3?\nAnswer: ")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("text, strict, want", [
    ("She pays 2 * 3 = 6 dollars.\n#### 6", False, "6"),
    ("#### 1,234", False, "1234"),
    ("so the total is $18.00.", False, "18"),
    ("first 3, then -3.50", False, "-3.5"),
    ("The answer is 42. Then 7 more happened", False, "7"),
    ("no digits here", False, None),
    ("The answer is 42", True, None),
    ("#### -7", True, "-7"),
])
def test_extract_answer(text, strict, want):
    assert extract_answer(text, strict=strict) == want


def test_generation_exact_match(tiny, monkeypatch):
    from maxlm.eval import generation

    task = load_task(str(FIXTURES / "gsm.jsonl"))
    replies = iter(["Tom has 7 apples.", "#### 35", "She reads 2,000 pages.\n#### 2,000", "3.00", "it is 3"])
    seen = []
    monkeypatch.setattr(generation, "complete",
                        lambda cfg, params, tok, prompts, **kw: (seen.extend(prompts), [next(replies) for _ in prompts])[1])
    out = generation.evaluate(task, None, None, TOK, shots=1)
    assert [s["exact_match"] for s in out["samples"]] == [1, 0, 1, 1, 0]
    assert out["metrics"]["exact_match"] == 0.6 and out["metrics"]["exact_match_strict"] == 0.2
    assert seen[0] == (f"Question: {task.docs[1].question}\nAnswer: {task.docs[1].answer}\n\n"
                       f"Question: {task.docs[0].question}\nAnswer:")


def test_generation_runs_on_a_model(tiny):
    from maxlm.eval import generation

    cfg, params = tiny
    out = generation.evaluate(load_task(str(FIXTURES / "gsm.jsonl")), cfg, params, TOK, limit=2, batch_size=2,
                              new_tokens=8)
    assert out["metrics"]["questions"] == 2 and all(isinstance(s["output"], str) for s in out["samples"])


# ---- agreement


def test_cohen_kappa_textbook_example():
    # Wikipedia's example: 50 proposals, both yes 20, A yes B no 5, A no B yes 10, both no 15.
    a = ["y"] * 20 + ["y"] * 5 + ["n"] * 10 + ["n"] * 15
    b = ["y"] * 20 + ["n"] * 5 + ["y"] * 10 + ["n"] * 15
    assert cohen_kappa(a, b, categories=("y", "n")) == pytest.approx(0.4)  # p_o 0.7, p_e 0.5
    assert cohen_kappa([1, 2, 3], [1, 2, 3]) == pytest.approx(1.0)
    assert math.isnan(cohen_kappa([3, 3], [3, 3]))  # chance agreement already perfect


FLEISS_WIKIPEDIA = [[0, 0, 0, 0, 14], [0, 2, 6, 4, 2], [0, 0, 3, 5, 6], [0, 3, 9, 2, 0], [2, 2, 8, 1, 1],
                    [7, 7, 0, 0, 0], [3, 2, 6, 3, 0], [2, 5, 3, 2, 2], [6, 5, 2, 1, 0], [0, 2, 2, 3, 7]]


def test_fleiss_kappa_textbook_example():
    assert round(fleiss_kappa(np.array(FLEISS_WIKIPEDIA)), 3) == 0.210
    with pytest.raises(ValueError):
        fleiss_kappa(np.array([[1, 1], [2, 1]]))


def test_kappa_against_scikit_learn():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    a = rng.integers(1, 6, 60)
    b = np.where(rng.random(60) < 0.6, a, rng.integers(1, 6, 60))
    assert cohen_kappa(a, b) == pytest.approx(metrics.cohen_kappa_score(a, b))
    assert cohen_kappa(a, b, weights="quadratic") == pytest.approx(metrics.cohen_kappa_score(a, b, weights="quadratic"))


def test_fleiss_against_statsmodels():
    inter = pytest.importorskip("statsmodels.stats.inter_rater")
    assert fleiss_kappa(np.array(FLEISS_WIKIPEDIA)) == pytest.approx(inter.fleiss_kappa(np.array(FLEISS_WIKIPEDIA)))


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def fill(sheet, out, rater, ratings):
    """A rater's copy of ``sheet`` with ``ratings[i]`` (one per dimension) on row i."""
    rows = read_rows(sheet)
    for row, values in zip(rows, ratings):
        row["rater"] = rater
        row.update({d: str(v) for d, v in zip(DIMENSIONS, values)})
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return out


def test_sheet_round_trip_and_agreement(tmp_path, capsys):
    sheet = tmp_path / "sheet.csv"
    write_sheet(sheet, "t", [("p1, with a comma", "out\nwith a newline", "ref"), ("p2", "o2", ""), ("p3", "o3", "")])
    rows = read_rows(sheet)
    assert [r["prompt"] for r in rows] == ["p1, with a comma", "p2", "p3"] and rows[0]["output"] == "out\nwith a newline"
    assert all(r[d] == "" for r in rows for d in DIMENSIONS)
    a = fill(sheet, tmp_path / "a.csv", "ann", [(5, 4, 3, 5), (2, 4, 3, 5), (1, 1, 3, 5)])
    b = fill(sheet, tmp_path / "b.csv", "bob", [(5, 4, 2, 5), (2, 3, 3, 5), (1, 1, 4, 5)])
    c = fill(sheet, tmp_path / "c.csv", "cy", [(4, 4, 2, 5), (2, 4, 3, 5), (1, 2, 4, 5)])
    assert read_sheet(a) == ("ann", {"t-0": dict(zip(DIMENSIONS, (5, 4, 3, 5))),
                                     "t-1": dict(zip(DIMENSIONS, (2, 4, 3, 5))),
                                     "t-2": dict(zip(DIMENSIONS, (1, 1, 3, 5)))})
    two = agreement([a, b])
    acc = two["dimensions"]["accuracy"]
    assert acc["kappa_kind"] == "cohen" and acc["kappa"] == pytest.approx(1.0) and acc["all_agree"] == 1.0
    assert two["dimensions"]["coherence"]["kappa"] == pytest.approx(cohen_kappa([4, 4, 1], [4, 3, 1]))
    assert two["dimensions"]["coherence"]["rater_means"] == {"ann": 3.0, "bob": 8 / 3}
    three = agreement([a, b, c])
    counts = [[0, 2, 1, 0, 0], [0, 0, 3, 0, 0], [0, 0, 1, 2, 0]]  # instruction_following: 3,2,2 / 3,3,3 / 3,4,4
    assert three["dimensions"]["instruction_following"]["kappa"] == pytest.approx(fleiss_kappa(np.array(counts)))
    assert math.isnan(three["dimensions"]["harmlessness"]["kappa"])  # everyone said 5 everywhere
    assert main(["--agreement", str(a), str(b), str(c), "--out", str(tmp_path / "agree.json")]) == 0
    printed = capsys.readouterr().out
    assert "3 raters, 3 items" in printed and "fleiss kappa" in printed
    assert json.loads((tmp_path / "agree.json").read_text())["raters"] == ["ann", "bob", "cy"]


# ---- the command line and bad input


@pytest.fixture(scope="module")
def exported(tiny, tmp_path_factory):
    """The tiny model exported as a Hugging Face directory (what `--checkpoint HF_DIR` reads)."""
    from maxlm.hf.export import export_model
    from maxlm.hf.load import LoadedModel
    from maxlm.infer.placement import inference_mesh

    cfg, params = tiny
    out = tmp_path_factory.mktemp("export") / "hf"
    export_model(LoadedModel(cfg, params, TOK, inference_mesh(1), "random"), out)
    return out


def test_cli_multiple_choice_perplexity_and_json(exported, tiny, tmp_path, capsys):
    cfg, params = tiny
    out = tmp_path / "results.json"
    code = main(["--checkpoint", str(exported), "--task", f"{MC},{FIXTURES / 'text.txt'}", "--limit", "6",
                 "--batch-size", "4", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "acc_norm" in printed and "bits_per_byte" in printed
    results = json.loads(out.read_text())["results"]
    mc, ppl = results
    assert mc["task"] == "mc" and mc["metrics"]["questions"] == 6 and len(mc["samples"]) == 6
    direct = multiple_choice.evaluate(load_task(str(MC)), Scorer(cfg, params, batch_size=3), TOK, limit=6)
    np.testing.assert_allclose([s["loglikelihoods"] for s in mc["samples"]],
                               [s["loglikelihoods"] for s in direct["samples"]], atol=1e-4)
    text = (FIXTURES / "text.txt").read_text()
    assert ppl["metrics"]["bytes"] == len(text.encode()) and ppl["metrics"]["bits_per_byte"] > 0


def test_cli_human_sheet(exported, tmp_path, capsys):
    sheet = tmp_path / "sheet.csv"
    assert main(["--checkpoint", str(exported), "--task", str(FIXTURES / "prompts.jsonl"), "--human-sheet",
                 str(sheet), "--limit", "3", "--max-new-tokens", "8", "--batch-size", "2"]) == 0
    rows = read_rows(sheet)
    assert len(rows) == 3 and list(rows[0]) == list(COLUMNS) and all(r["accuracy"] == "" for r in rows)
    assert "wrote 3 prompts" in capsys.readouterr().out


BAD_FILES = {
    "malformed.jsonl": ('{"question": "q", "choices": ["a", "b"], "answer": 0}\n{"question": "q2", "choices": [\n',
                        ":2: malformed JSON"),
    "range.jsonl": ('{"question": "q", "choices": ["a", "b"], "answer": 0}\n'
                    '{"question": "q2", "choices": ["a", "b"], "answer": "C"}\n', ":2: field 'answer' = 'C' is out of range"),
    "index.jsonl": ('{"question": "q", "choices": ["a", "b"], "answer": 2}\n', ":1: field 'answer' = 2 is out of range"),
    "empty.jsonl": ("\n\n", "holds no task lines (empty file)"),
    "nochoices.jsonl": ('{"question": "q", "choices": ["a", "b"], "answer": 0}\n{"question": "q", "answer": 0}\n',
                        ":2: missing field 'choices'"),
    "choice.jsonl": ('{"question": "q", "choices": ["a", ""], "answer": 0}\n', ":1: field 'choices' entry 1"),
    "fields.jsonl": ('{"q": "x"}\n', ":1: no field 'question'"),
    "question.jsonl": ('{"question": 3, "choices": ["a", "b"], "answer": 0}\n', ":1: field 'question' should be a str"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_task_file_is_one_line_and_exit_2(name, tmp_path, capsys):
    text, expected = BAD_FILES[name]
    path = tmp_path / name
    path.write_text(text)
    assert main(["--checkpoint", str(tmp_path / "nowhere"), "--task", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and expected in err, err


@pytest.mark.parametrize("argv, expected", [
    (["--task", "mmlu"], "unknown task 'mmlu'"),
    (["--task", "nothere.jsonl"], "nothere.jsonl: no such task file"),
    (["--task", "perplexity:packed:/x"], "packed rows"),
    (["--task", "perplexity:"], "names no data source"),
    (["--task", str(MC), "--shots", "-1"], "argument --shots: -1 must be >= 0"),
    (["--task", str(MC), "--limit", "zero"], "argument --limit: 'zero' is not an integer"),
    (["--task", str(MC), "--agreement", "a.csv"], "--agreement takes only the filled sheets"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, expected, tmp_path, capsys):
    try:
        code = main(["--checkpoint", str(tmp_path)] + argv)
    except SystemExit as stop:  # argparse's own checks exit from the parser
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


def test_missing_checkpoint_and_bad_sheet_are_one_line(tmp_path, capsys):
    assert main(["--checkpoint", str(tmp_path / "missing"), "--task", str(MC)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path / "missing") in err and "does not exist" in err
    sheet = tmp_path / "s.csv"
    write_sheet(sheet, "t", [("p", "o", "")])
    a = fill(sheet, tmp_path / "a.csv", "ann", [(5, 4, 3, 5)])
    b = fill(sheet, tmp_path / "b.csv", "bob", [(5, 4, 3, 5)])
    b.write_text(b.read_text().replace(",5,4,3,5,", ",5,,3,5,"))
    assert main(["--agreement", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{b}:2: column 'coherence' is empty" in err, err
    assert main(["--agreement", str(a)]) == 2
    assert "at least two" in capsys.readouterr().err


def test_eval_tasks_config_validation():
    ok = config.build(train=dict(eval_tasks=f"{MC}, perplexity:stdlib"))
    assert ok.train.eval_tasks
    for value, expected in (("mmlu", "unknown task 'mmlu'"), ("a/x.jsonl, b/x.jsonl", "two tasks named 'x'"),
                            (", ,", "names no task"), ("perplexity:packed:d", "packed rows")):
        with pytest.raises(config.ConfigError, match="TrainConfig.eval_tasks") as info:
            config.build(train=dict(eval_tasks=value))
        assert expected in str(info.value)
    with pytest.raises(TaskError, match="no such task file"):
        load_task("missing/x.jsonl")


@pytest.mark.slow
def test_eval_tasks_in_a_training_run(tmp_path):
    """eval_tasks are evaluated at step 0, every eval_every steps and at the end, logged as
    eval/<task>/<metric>; the last one equals `maxlm.eval` on the saved checkpoint."""
    from maxlm import train
    from tests.helpers import small_config

    run_dir = tmp_path / "run"
    tasks = f"{MC}, {FIXTURES / 'text.txt'}, {FIXTURES / 'gsm.jsonl'}"
    cfg = small_config(train=dict(steps=4, eval_every=2, eval_batches=1, log_every=2, run_dir=str(run_dir),
                                  eval_tasks=tasks))
    train.train(cfg)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    for r in evals:
        assert 0 <= r["eval/mc/acc"] <= 1 and 0 <= r["eval/mc/acc_norm"] <= 1 and r["eval/text/bits_per_byte"] > 0
        assert 0 <= r["eval/gsm/exact_match"] <= 1
    events = b"".join(p.read_bytes() for p in (run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert b"eval/mc/acc" in events and b"eval/text/bits_per_byte" in events  # the scalars' tags
    out = tmp_path / "r.json"
    assert main(["--checkpoint", str(run_dir), "--task", tasks, "--out", str(out)]) == 0
    mc, text, _ = json.loads(out.read_text())["results"]
    assert mc["metrics"]["acc"] == evals[-1]["eval/mc/acc"]
    assert text["metrics"]["bits_per_byte"] == pytest.approx(evals[-1]["eval/text/bits_per_byte"], rel=1e-4)


def test_help_lists_everything(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--checkpoint", "--task", "--shots", "--limit", "--out", "--batch-size", "--human-sheet",
                 "--agreement", "perplexity:SOURCE", "add_bos_token=True"):
        assert flag in text


def test_bad_eval_task_file_stops_training_before_step_one(tmp_path):
    from maxlm import train
    from maxlm.train.resilience import TrainingError
    from tests.helpers import small_config

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "choices": ["a", "b"], "answer": 5}\n')
    cfg = small_config(train=dict(steps=2, run_dir=str(tmp_path / "run"), eval_tasks=str(bad)))
    with pytest.raises(TrainingError, match=rf"TrainConfig.eval_tasks: {bad}:1: field 'answer' = 5 is out of range"):
        train.train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


# ---- review fixes


def spy_run(monkeypatch, fail=None):
    """Record every call of maxlm.infer.generate.run (prompts and stops), then run it (or raise ``fail``)."""
    from maxlm.infer import generate

    calls, real = [], generate.run

    def spy(cfg, params, prompts, max_new_tokens, **kw):
        calls.append({"prompts": [np.asarray(p).tolist() for p in prompts], "max_new_tokens": max_new_tokens, **kw})
        if fail is not None:
            raise fail
        return real(cfg, params, prompts, max_new_tokens, **kw)

    monkeypatch.setattr(generate, "run", spy)
    return calls


def test_generation_prompts_keep_their_end_on_a_small_context(exported, tiny, tmp_path, monkeypatch):
    """max_seq_len 64 with --max-new-tokens 256: each prompt the model receives is the intended one
    (its last 63 tokens when longer), not its last token; run() gets GSM's stop strings and eos."""
    from maxlm.eval import generation

    calls = spy_run(monkeypatch)
    out = tmp_path / "gsm.json"
    assert main(["--checkpoint", str(exported), "--task", str(FIXTURES / "gsm.jsonl"), "--shots", "1",
                 "--limit", "3", "--max-new-tokens", "256", "--batch-size", "4", "--out", str(out)]) == 0
    samples = json.loads(out.read_text())["results"][0]["samples"]
    intended = [TOK.encode(s["prompt"], add_bos=True, add_eos=False)[-63:].tolist() for s in samples]
    assert [p for c in calls for p in c["prompts"]] == intended
    assert all(len(p) == 63 for p in intended)  # one shot makes each prompt longer than the context
    assert all(c["max_new_tokens"] == 256 and tuple(c["stop_strings"]) == generation.STOP_STRINGS
               and list(c["stop_tokens"]) == [TOK.eos_id] for c in calls)
    assert all("Question:" not in s["output"] and "\n\n" not in s["output"] for s in samples)
    cfg, params = tiny  # a short prompt is passed whole, <|bos|> first
    calls.clear()
    generation.complete(cfg, params, TOK, ["Question: 1+1?\nAnswer:"], new_tokens=256, batch_size=2)
    assert calls[0]["prompts"] == [TOK.encode("Question: 1+1?\nAnswer:", add_bos=True, add_eos=False).tolist()]


def test_complete_drops_eos_from_the_text(tiny, monkeypatch):
    from maxlm.eval import generation
    from maxlm.infer import generate

    cfg, params = tiny
    done = SimpleNamespace(tokens=[np.array([*b"42", TOK.eos_id]), np.array([*b"7 and"])],
                           finish=["stop_token", "length"], texts=["42<eos>", "7 and"])
    monkeypatch.setattr(generate, "run", lambda cfg, params, prompts, n, **kw: done)
    assert generation.complete(cfg, params, TOK, ["a", "b"], new_tokens=4, batch_size=2) == ["42", "7 and"]


def test_human_sheet_uses_eos_only_and_never_overwrites(exported, tmp_path, capsys, monkeypatch):
    calls = spy_run(monkeypatch)
    sheet = tmp_path / "sheet.csv"
    argv = ["--checkpoint", str(exported), "--task", str(FIXTURES / "prompts.jsonl"), "--human-sheet", str(sheet),
            "--limit", "2", "--max-new-tokens", "256", "--batch-size", "2"]
    assert main(argv) == 0
    assert calls and all(tuple(c["stop_strings"]) == () and list(c["stop_tokens"]) == [TOK.eos_id] for c in calls)
    capsys.readouterr()
    calls.clear()
    sheet.write_text("a rater's work\n")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err and str(sheet) in err, err
    assert not calls and sheet.read_text() == "a rater's work\n"  # refused before generating


def test_human_sheet_generation_error_is_one_line(exported, tmp_path, capsys, monkeypatch):
    from maxlm.infer.generate import PromptError

    spy_run(monkeypatch, fail=PromptError(0, "prompt has 99 tokens;\n  the context leaves room for 63"))
    sheet = tmp_path / "sheet.csv"
    assert main(["--checkpoint", str(exported), "--task", str(FIXTURES / "prompts.jsonl"), "--human-sheet",
                 str(sheet), "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prompt has 99 tokens; the context leaves room for 63" in err, err
    assert not sheet.exists()


def test_answer_out_of_range_with_many_choices_is_one_line(tmp_path, capsys):
    path = tmp_path / "wide.jsonl"
    write_jsonl(path, [{"question": "q", "choices": [f"c{i}" for i in range(30)], "answer": 30}])
    assert main(["--checkpoint", str(tmp_path), "--task", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "field 'answer' = 30 is out of range for 30 choices (0..29" in err, err


def test_sheets_with_a_bom_and_shared_names_stay_apart(tmp_path):
    sheet = tmp_path / "s.csv"
    write_sheet(sheet, "t", [("p1", "o1", ""), ("p2", "o2", "")])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = fill(sheet, tmp_path / "a" / "r.csv", "ann", [(5, 4, 3, 5), (2, 4, 3, 5)])
    b = fill(sheet, tmp_path / "b" / "r.csv", "ann", [(4, 4, 3, 5), (2, 3, 3, 5)])
    b.write_bytes(b"\xef\xbb\xbf" + b.read_bytes())  # as Excel saves "CSV UTF-8"
    assert read_sheet(b)[0] == "ann"
    result = agreement([str(a), str(b)])
    assert len(result["raters"]) == 2 and len(set(result["raters"])) == 2
    assert result["dimensions"]["accuracy"]["rater_means"] == {f"ann ({a})": 3.5, f"ann ({b})": 3.0}
    same = agreement([str(a), str(a)])  # one file given twice still counts as two raters
    assert len(set(same["raters"])) == 2


def test_out_is_written_atomically(tmp_path, capsys):
    from maxlm.eval import loglikelihood
    from maxlm.infer import generate

    assert loglikelihood.bucket is generate.bucket and loglikelihood.MIN_BUCKET == generate.MIN_BUCKET
    sheet = tmp_path / "s.csv"
    write_sheet(sheet, "t", [("p", "o", "")])
    a = fill(sheet, tmp_path / "a.csv", "ann", [(5, 4, 3, 5)])
    b = fill(sheet, tmp_path / "b.csv", "bob", [(4, 4, 3, 5)])
    (tmp_path / "out").mkdir()
    assert main(["--agreement", str(a), str(b), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a directory" in err, err
    assert main(["--agreement", str(a), str(b), "--out", str(tmp_path / "agree.json")]) == 0
    assert json.loads((tmp_path / "agree.json").read_text())["items"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv", "agree.json", "b.csv", "out", "s.csv"]


def test_scorer_gathers_across_processes(tiny, monkeypatch):
    from jax.experimental import multihost_utils

    cfg, params = tiny
    scorer = Scorer(cfg, params, batch_size=2)
    tokens = np.ones((2, 16), np.int32)
    args = (tokens, tokens, np.broadcast_to(np.arange(16, dtype=np.int32), tokens.shape), tokens)
    alone = scorer.rows(*args)
    gathered = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda x, tiled=False: (gathered.append(tiled), jax.device_get(x))[1])
    multi = scorer.rows(*args)
    assert gathered == [True]
    for x, y in zip(alone, multi):
        np.testing.assert_array_equal(x, y)


def test_eval_tasks_open_before_restore_or_compile(tmp_path, monkeypatch):
    from maxlm import train
    from maxlm.train import loop, step
    from maxlm.train.resilience import TrainingError
    from tests.helpers import small_config

    def never(*a, **k):
        raise AssertionError("restored or compiled before the eval tasks were read")

    monkeypatch.setattr(loop.Loop, "start_state", never)
    monkeypatch.setattr(step, "compile_steps", never)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "choices": ["a", "b"], "answer": 5}\n')
    cfg = small_config(train=dict(steps=2, run_dir=str(tmp_path / "run"), eval_tasks=str(bad)))
    with pytest.raises(TrainingError, match="TrainConfig.eval_tasks"):
        train.train(cfg)


@pytest.mark.slow
def test_a_failing_eval_task_is_skipped_not_fatal(tmp_path, monkeypatch, capsys):
    from maxlm import train
    from tests.helpers import small_config

    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise ValueError("continuation too long\nfor the context")

    monkeypatch.setattr(multiple_choice, "evaluate", broken)
    run_dir = tmp_path / "run"
    cfg = small_config(train=dict(steps=2, eval_every=1, eval_batches=1, log_every=1, run_dir=str(run_dir),
                                  eval_tasks=f"{MC}, {FIXTURES / 'text.txt'}"))
    train.train(cfg)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and all("eval/text/bits_per_byte" in r for r in evals)
    assert not any("eval/mc/acc" in r for r in evals) and len(calls) == 1  # tried once, then skipped
    skipped = [r for r in rows if r.get("event") == "eval_task_skipped"]
    assert len(skipped) == 1 and skipped[0]["task"] == "mc"
    assert "continuation too long for the context" in skipped[0]["reason"]
