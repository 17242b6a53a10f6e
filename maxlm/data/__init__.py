"""Data: document sources, tokenizers, and Grain pipelines that pack tokens into training batches."""

from maxlm.data.pipeline import make_eval_batches, make_train_iterator
from maxlm.data.tokenizer import ByteTokenizer, get_tokenizer

__all__ = ["ByteTokenizer", "get_tokenizer", "make_eval_batches", "make_train_iterator"]
