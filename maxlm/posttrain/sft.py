"""SFT as a task of the shared loop: pre-training's next-token cross-entropy (``tasks.lm_loss``)
on packed chat examples whose ``weights`` cover exactly the reply tokens (``maxlm.data.sft``).

``sft_task(cfg, forward)`` reads and cleans ``SFTConfig.data`` once, prints what was used and
dropped, and returns the Task; checkpoints, resume, eval and metrics are the loop's. Its closing
sample answers held-out prompts greedily through ``maxlm.infer.generate`` (the same template and
encoding as training) and reports the exact-match rate, also available as ``exact_match`` for tests
and notebooks. A trainable mask (LoRA) or another loss (distillation) wraps this same data.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from maxlm import data
from maxlm.config import Config, ConfigError
from maxlm.data import chat
from maxlm.data import sft as sft_data
from maxlm.train.tasks import LM_BATCH, Task, lm_loss


def load_data(cfg: Config) -> sft_data.SFTData:
    """SFTConfig's examples, cleaned and tokenized; unusable data as a whole is a ConfigError."""
    sc = cfg.sft
    try:
        data.check_vocab(dataclasses.replace(cfg.data, source="stdlib"), cfg.model.vocab_size)
        tokenizer = data.get_tokenizer(cfg.data.tokenizer)
        return sft_data.load(sc.data, sc.eval_data, sc.eval_fraction, sft_data.Options.of(sc), tokenizer,
                             cfg.train.seq_len)
    except (sft_data.SFTDataError, ValueError) as err:
        raise ConfigError(f"{cfg.source}: SFTConfig.data: {err}") from None


@dataclasses.dataclass
class ExactMatch:
    score: float
    n: int
    rows: list[tuple[str, str, str]]  # (prompt, wanted, got), for printing a few

    def __str__(self) -> str:
        return f"exact match {self.score:.1%} of {self.n} held-out prompts"


def exact_match(cfg: Config, params: Any, examples: list[sft_data.Example], tokenizer: Any = None,
                max_new_tokens: int | None = None) -> ExactMatch:
    """Greedy replies to each example's prompt (the conversation up to its last assistant turn),
    read back through the template and compared with that turn's content exactly."""
    from maxlm.infer import generate

    tokenizer = tokenizer or data.get_tokenizer(cfg.data.tokenizer)
    prompts, wanted, shown = [], [], []
    for ex in examples:
        last = max(i for i, m in enumerate(ex.messages) if m["role"] == "assistant")
        prompts.append(chat.encode_prompt(tokenizer, ex.messages[:last]))
        wanted.append(ex.messages[last]["content"])
        shown.append(ex.messages[last - 1]["content"] if last else "")
    if not prompts:
        return ExactMatch(0.0, 0, [])
    result = generate.run(cfg.model, params, prompts, max_new_tokens or cfg.sft.max_new_tokens,
                          tokenizer=tokenizer, stop_tokens=[tokenizer.eos_id], seed=cfg.train.seed)
    got = [chat.read_reply(text) for text in result.texts]
    hits = sum(g == w for g, w in zip(got, wanted))
    return ExactMatch(hits / len(prompts), len(prompts), list(zip(shown, wanted, got)))


def sft_task(cfg: Config, forward: Callable) -> Task:
    sc, tc = cfg.sft, cfg.train
    examples = load_data(cfg)
    tokenizer = data.get_tokenizer(cfg.data.tokenizer)
    if jax.process_index() == 0:
        print(examples.report.summary("SFT data"), flush=True)
        if examples.eval_report is not None:
            print(examples.eval_report.summary("SFT eval data"), flush=True)
    where = dict(process_index=jax.process_index(), process_count=jax.process_count())

    def train_batches():
        return sft_data.train_iterator(examples, tokenizer, seq_len=tc.seq_len, global_batch=tc.global_batch,
                                       seed=cfg.data.seed, bins=sc.packing_bins,
                                       prefetch=cfg.data.prefetch, **where)

    def eval_batches():
        return sft_data.eval_batches(examples, tokenizer, seq_len=tc.seq_len, global_batch=tc.global_batch,
                                     num_batches=tc.eval_batches, bins=sc.packing_bins, **where)

    def sample(params) -> str:
        held = examples.eval_examples[:sc.eval_prompts]
        em = exact_match(cfg, params, held, tokenizer)
        lines = [str(em)] + [f"  {p!r} -> {g!r} (wanted {w!r})" for p, w, g in em.rows[:5]]
        return "\n".join(lines)

    return Task("sft", lm_loss(forward, cfg.model.vocab_size, tc.z_loss), LM_BATCH, train_batches, eval_batches,
                sample=sample if sc.eval_prompts else None)
