"""SFT (issue 15, item 1): the data rules, the reply-only loss mask, and a run through the shared loop
that learns a string task a base model cannot do, scored through maxlm's generation."""

import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from maxlm import config, model
from maxlm.data import chat, get_tokenizer
from maxlm.data import sft as sft_data

ROOT = Path(__file__).resolve().parents[1]
TOK = get_tokenizer("byte")
ASSISTANT = list(b"<|assistant|>\n")

INSTRUCTION = [
    {"instruction": "Reverse the word.", "input": "abc", "output": "cba"},
    {"instruction": "Say hi.", "output": "hi there"},
]
CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}]},
    {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue"}]},
]


def _write(path: Path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def _expected_weights(ids: np.ndarray) -> np.ndarray:
    """Written apart from maxlm.data.chat: reading a segment's tokens left to right, a token is a
    reply token from just after "<|assistant|>\\n" up to and including the next eos. The weight of
    position j is whether its target, token j + 1, is one."""
    reply = np.zeros(ids.size, bool)
    inside = False
    for j, t in enumerate(ids):
        reply[j] = inside
        if inside and t == TOK.eos_id:
            inside = False
        if j + 1 >= len(ASSISTANT) and list(ids[j + 1 - len(ASSISTANT):j + 1]) == ASSISTANT:
            inside = True
    return np.r_[reply[1:], False]


@pytest.mark.parametrize("records", [INSTRUCTION, CHATS], ids=["instruction", "chat"])
def test_loss_mask_covers_exactly_the_replies_packed(tmp_path, records):
    data = sft_data.load(_write(tmp_path / "d.jsonl", records * 3 + [
        {**r, "tag": i} for i, r in enumerate(records)]), "", 0.0, sft_data.Options(exact_dedup=False), TOK, 128)
    assert data.report.used == len(records) * 4 and not data.report.dropped
    rows = list(sft_data.packed_rows(data.train, 128, TOK.pad_id, seed=0, train=False, bins=4))
    assert any(r["segment_ids"].max() > 1 for r in rows), "examples should share rows"
    seen = []
    for row in rows:
        for seg in range(1, row["segment_ids"].max() + 1):
            at = np.flatnonzero(row["segment_ids"] == seg)
            ids = row["inputs"][at]
            assert row["positions"][at].tolist() == list(range(at.size))
            np.testing.assert_array_equal(row["weights"][at], _expected_weights(ids).astype(np.float32))
            assert (row["weights"][row["segment_ids"] == 0] == 0).all()
            targets = row["targets"][at][row["weights"][at] > 0]
            seen.append(targets.tolist())
    # Each example's trained targets are its replies as the template writes them, each then eos.
    for r in records:
        msgs = r["messages"] if "messages" in r else chat.instruction_messages(r["instruction"], r.get("input", ""),
                                                                               r["output"])
        want = []
        for m in msgs:
            if m["role"] == "assistant":
                want += list((m["content"] + "\n").encode()) + [TOK.eos_id]
        assert seen.count(want) == 4, (r, want)
    assert len(seen) == len(records) * 4


def test_template_is_shared_by_training_generation_serving_and_export(tmp_path):
    messages = CHATS[0]["messages"][:4]
    prompt = chat.encode_prompt(TOK, messages)
    assert TOK.decode(prompt) == chat.render(messages, add_generation_prompt=True)
    ids, mask = chat.encode_chat(TOK, CHATS[0]["messages"])
    assert ids[:prompt.size].tolist() == prompt.tolist() and mask[:prompt.size].sum() == len("Hello!\n") + 1
    assert chat.read_reply("4\n") == "4"
    from maxlm.hf.tokenizer_files import write_tokenizer
    from maxlm.serve.api import DEFAULT_CHAT_TEMPLATE, chat_renderer
    assert chat_renderer(DEFAULT_CHAT_TEMPLATE.read_text())(messages) == chat.render(messages, True)
    write_tokenizer(TOK, tmp_path, chat_template=chat.template_text())
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"] == chat.template_text()


def test_bad_lines_are_counted_with_line_numbers(tmp_path, capsys):
    good = {"instruction": "Uppercase the word.", "input": "abc", "output": "ABC"}
    path = _write(tmp_path / "bad.jsonl", [
        good,                                                   # 1
        "{not json",                                            # 2
        {"instruction": "no output"},                           # 3 missing field
        {"instruction": "x", "output": ""},                     # 4 empty reply
        {"messages": "hello"},                                  # 5 non-list messages
        {"messages": [{"role": "user", "content": "q"}]},       # 6 no assistant turn
        {"instruction": "long " * 40, "output": "yes"},         # 7 prompt longer than seq_len
        {"instruction": "Short reply.", "output": "ok"},        # 8 below min_reply_chars
        good,                                                   # 9 exact duplicate
        [1, 2],                                                 # 10 not an object
        "",                                                     # 11 empty line
        {"messages": [{"role": "robot", "content": "x"}]},      # 12 unknown role
    ])
    data = sft_data.load(path, "", 0.0, sft_data.Options(min_reply_chars=3), TOK, 64)
    rep = data.report
    assert rep.lines == 12 and rep.used == 1
    assert rep.used + sum(rep.dropped.values()) == rep.lines
    assert dict(rep.dropped) == {"bad_line": 7, "empty_reply": 1, "too_long": 1, "short_reply": 1, "exact_dup": 1}
    where = {int(w.rsplit(":", 1)[1]): why for w, why in rep.bad_lines}
    assert sorted(where) == [2, 3, 4, 5, 6, 7, 10, 11, 12]
    assert "not JSON" in where[2] and "'output'" in where[3] and "empty" in where[4]
    assert "not a list" in where[5] and "no assistant" in where[6] and "prompt of" in where[7]
    text = rep.summary()
    print(text)
    assert text.startswith("SFT data: 1 of 12 examples used;") and f"{path}:5 (" in text


def test_cleaning_stages_apply_to_sft_data(tmp_path):
    rec = lambda out: {"instruction": "Write.", "output": out}  # noqa: E731
    story = "Once upon a time there was a small fox who lived in a quiet forest near the river and read books"
    path = _write(tmp_path / "c.jsonl", [rec("Mail me at jane.doe@example.com please"),
                                         rec("Cafe\u0301 \u200b ok"), rec("Cafe\u0301 \u200b ok"),
                                         rec(story), rec(story + "!")])
    data = sft_data.load(path, "", 0.0, sft_data.Options(pii=True, near_dedup=True), TOK, 256)
    texts = [TOK.decode(r["inputs"][r["mask"] == 1]) for r in data.train]
    assert data.report.dropped == {"exact_dup": 1, "near_dup": 1}  # the exact pair is equal once normalised
    assert any("example.com" not in t and "Mail me at" in t for t in texts)
    assert "Café  ok\n" in texts or "Café ok\n" in texts


def test_every_reader_parses_synthetic_specs_alike():
    """SFT examples, GRPO prompts and preference pairs read synthetic:TASK[:N] through one parser:
    N defaults to 2000, and a count that is not a number or a field no reader takes is one line."""
    from maxlm.data import preference, prompts, sft as sft_data

    readers = [(sft_data.read, sft_data.SFTDataError), (prompts.read, prompts.PromptDataError),
               (preference.read, preference.PreferenceDataError)]
    for read, error in readers:
        assert read("synthetic:upper:12")[1].lines == 12
        for spec in ("synthetic:upper:12x", "synthetic:upper:12:unchanged:extra"):
            with pytest.raises(error) as err:
                read(spec)
            assert "N a number" in str(err.value) and "\n" not in str(err.value), str(err.value)
    for read, error in readers[:2]:  # only preference pairs take a field after N (their kinds)
        with pytest.raises(error, match="N a number"):
            read("synthetic:upper:12:unchanged")
    assert sft_data.synthetic_spec("synthetic:upper") == ("upper", 2000, None)


def test_bad_config_is_one_line(tmp_path):
    for bindings, needle in [(["TrainConfig.task='sft'"], "SFTConfig.data"),
                             (["TrainConfig.task='rlhf'"], "TrainConfig.task = 'rlhf' is not one of"),
                             (["TrainConfig.task='sft'", "SFTConfig.data='x.jsonl'", "SFTConfig.format='csv'"],
                              "SFTConfig.format"),
                             (["SFTConfig.eval_fraction=1.5"], "SFTConfig.eval_fraction = 1.5 must lie in [0, 1)")]:
        with pytest.raises(config.ConfigError) as err:
            config.load("sft_tiny.gin", bindings + ["SFTConfig.data=''"] * (bindings == ["TrainConfig.task='sft'"]))
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    missing = subprocess.run([sys.executable, "-m", "maxlm.sft", "--config=sft_tiny.gin",
                              "--gin_bindings=SFTConfig.data='nowhere/*.jsonl'", f"--run_dir={tmp_path / 'r'}"],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert missing.returncode == 2, missing.stderr
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and "no file matches 'nowhere/*.jsonl'" in lines[0], missing.stderr
    help_ = subprocess.run([sys.executable, "-m", "maxlm.sft", "--help"], capture_output=True, text=True,
                           cwd=ROOT, timeout=60)
    assert help_.returncode == 0 and "synthetic:reverse" in help_.stdout


def _cfg(run_dir: Path, steps: int, **extra) -> config.Config:
    bindings = [f"TrainConfig.run_dir={str(run_dir)!r}", f"TrainConfig.steps={steps}", "TrainConfig.peak_flops=1e12"]
    return config.load("sft_tiny.gin", bindings + [f"{k}={v!r}" for k, v in extra.items()], num_devices=8)


@pytest.mark.slow
def test_sft_learns_a_task_the_base_cannot_do(tmp_path):
    from maxlm.hf.load import load_model
    from maxlm.posttrain import build_task, sft
    from maxlm.train import pretrain

    cfg = _cfg(tmp_path / "run", 400)
    data = sft.load_data(cfg)
    held = data.eval_examples[:64]
    base = model.init_params(cfg.model, jax.random.split(jax.random.PRNGKey(cfg.train.seed))[1])
    before = sft.exact_match(cfg, base, held)
    start = time.perf_counter()
    summary = pretrain.train(cfg, build_task=build_task)
    train_s = time.perf_counter() - start
    loaded = load_model(cfg.train.run_dir)  # the trained run, opened as maxlm.generate opens it
    after = sft.exact_match(cfg.replace(model=vars(loaded.cfg)), loaded.params, held)
    print(f"\nSFT on {cfg.sft.data}: base {before}; after {cfg.train.steps} steps ({train_s:.0f} s) {after}")
    for prompt, want, got in after.rows[:3]:
        print(f"  {prompt!r} -> {got!r} (wanted {want!r})")
    assert before.score <= 0.05
    assert after.score >= 0.9, after.rows[:10]
    assert summary["eval_losses"][-1][1] < summary["eval_losses"][0][1] / 5
    # The export carries the same template, so transformers and vLLM prompt the model as SFT trained it.
    from maxlm.hf.export import export_model
    export_model(loaded, tmp_path / "hf")
    exported = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"]
    assert exported == chat.template_text()


@pytest.mark.slow
def test_sft_run_resumes_through_the_loop(tmp_path):
    from maxlm.posttrain import build_task
    from maxlm.train import pretrain

    run = tmp_path / "run"
    small = {"CheckpointConfig.every_steps": 10, "SFTConfig.eval_prompts": 0, "TrainConfig.eval_every": 20,
             "TrainConfig.log_every": 5}
    first = pretrain.train(_cfg(run, 10, **small), build_task=build_task)
    assert first["last_step"] == 10
    resumed = pretrain.train(_cfg(run, 20, **small), build_task=build_task)
    assert resumed["first_step"] == 10 and resumed["last_step"] == 20
    straight = pretrain.train(_cfg(tmp_path / "straight", 20, **small), build_task=build_task)
    assert resumed["loss"] == pytest.approx(straight["loss"], rel=1e-4)
