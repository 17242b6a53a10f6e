"""Data: sources, cleaning, tokenizers, packing and Grain pipelines (maxlm/data/README.md).

What the trainer uses: ``make_train_iterator``, ``make_eval_batches``, ``get_tokenizer``; for config
validation ``check_config`` and ``check_vocab``; ``DataStateMismatch`` is raised by
``iterator.set_state`` when a checkpoint's data state belongs to another pipeline. Post-training
data: ``sft`` (instruction and chat JSONL -> masked, packed rows) and ``chat`` (the one chat template).
"""

from maxlm.data.pipeline import DataIterator, DataStateMismatch, make_eval_batches, make_train_iterator
from maxlm.data.spec import check_config, check_vocab, parse_mixture
from maxlm.data.tokenizer import SPECIAL_TOKENS, BPETokenizer, ByteTokenizer, get_tokenizer

__all__ = ["BPETokenizer", "ByteTokenizer", "DataIterator", "DataStateMismatch", "SPECIAL_TOKENS",
           "check_config", "check_vocab", "get_tokenizer", "make_eval_batches", "make_train_iterator",
           "parse_mixture"]
