"""Tokenizers: byte-level (the default, needs no file) and BPE trained with Hugging Face ``tokenizers``.

Both expose one interface: ``encode(text, add_bos=True, add_eos=True) -> int32 array``,
``decode(ids) -> str``, ``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``. ``get_tokenizer`` takes
``"byte"`` or the path of a ``tokenizer.json`` written by ``python -m maxlm.data train-tokenizer``;
that same file ships with exported models.

The special tokens are defined once, here (``SPECIAL_TOKENS``). The byte tokenizer places them
after the 256 bytes (256, 257, 258); a trained BPE gives them ids 0, 1, 2.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterable, Iterator

import numpy as np

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)

# Pre-tokenisation of Llama 3 / GPT-4 (cl100k): letters, 1-3 digit numbers, punctuation runs and
# whitespace are split apart before byte-level BPE. A run of Han characters stays one piece, which
# BPE then merges into words, so Chinese text compresses as well as English.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _with_specials(body: np.ndarray, bos: int | None, eos: int | None) -> np.ndarray:
    head = 0 if bos is None else 1
    out = np.empty(head + body.size + (eos is not None), dtype=np.int32)
    if bos is not None:
        out[0] = bos
    out[head:head + body.size] = body
    if eos is not None:
        out[-1] = eos
    return out


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; the three special tokens follow them."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259
    name = "byte"
    fingerprint = "byte"

    def encode(self, text: str | bytes, add_bos: bool = True, add_eos: bool = True) -> np.ndarray:
        data = text.encode("utf-8", errors="replace") if isinstance(text, str) else bytes(text)
        body = np.frombuffer(data, dtype=np.uint8)
        return _with_specials(body, self.bos_id if add_bos else None, self.eos_id if add_eos else None)

    def encode_batch(self, texts: list[str], add_bos: bool = True, add_eos: bool = True) -> list[np.ndarray]:
        return [self.encode(t, add_bos, add_eos) for t in texts]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        # Specials and ids past the byte range (padded vocab rows a model may sample) carry no text.
        data = ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class BPETokenizer:
    """A Hugging Face ``tokenizers`` byte-level BPE loaded from ``tokenizer.json``.

    Byte-level means every string (any language, any bytes) encodes without an unknown token.
    ``encode`` adds bos/eos itself, so the file's own post-processor (which prepends bos for
    consumers such as vLLM) is bypassed and there is never a doubled bos."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.path = os.path.abspath(os.path.expanduser(path))
        try:
            with open(self.path, "rb") as f:
                blob = f.read()
            self._tok = Tokenizer.from_str(blob.decode("utf-8"))
        except OSError as err:
            raise ValueError(f"DataConfig.tokenizer = {path!r}: cannot read it ({err.strerror}); give "
                             "'byte' or a tokenizer.json from `python -m maxlm.data train-tokenizer`") from None
        except Exception as err:  # tokenizers raises its own exception type for bad JSON
            raise ValueError(f"DataConfig.tokenizer = {path!r} is not a valid tokenizer.json: "
                             f"{' '.join(str(err).split())}") from None
        self.name = path
        self.fingerprint = "sha256:" + hashlib.sha256(blob).hexdigest()[:16]
        ids = {tok: self._tok.token_to_id(tok) for tok in SPECIAL_TOKENS}
        missing = [tok for tok, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"DataConfig.tokenizer = {path!r} lacks the special tokens {missing} "
                             "(train it with `python -m maxlm.data train-tokenizer`)")
        self.bos_id, self.eos_id, self.pad_id = ids[BOS], ids[EOS], ids[PAD]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        body = np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        return _with_specials(body, self.bos_id if add_bos else None, self.eos_id if add_eos else None)

    def encode_batch(self, texts: list[str], add_bos: bool = True, add_eos: bool = True) -> list[np.ndarray]:
        """Many documents at once: the Rust side spreads them over threads."""
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        bos, eos = self.bos_id if add_bos else None, self.eos_id if add_eos else None
        return [_with_specials(np.asarray(e.ids, dtype=np.int32), bos, eos) for e in encs]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        keep = (ids >= 0) & (ids < self.vocab_size)
        keep &= (ids != self.bos_id) & (ids != self.eos_id) & (ids != self.pad_id)
        return self._tok.decode(ids[keep].tolist(), skip_special_tokens=True)

    def __getstate__(self):  # worker processes get the JSON, not a handle
        return {"path": self.path, "json": self._tok.to_str(), "name": self.name,
                "fingerprint": self.fingerprint}

    def __setstate__(self, state):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str(state["json"])
        self.path, self.name, self.fingerprint = state["path"], state["name"], state["fingerprint"]
        self.bos_id, self.eos_id, self.pad_id = (self._tok.token_to_id(t) for t in SPECIAL_TOKENS)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, {self.fingerprint})"


Tokenizer = ByteTokenizer | BPETokenizer


@functools.lru_cache(maxsize=16)
def _load_bpe(path: str, mtime_ns: int, size: int) -> BPETokenizer:
    return BPETokenizer(path)


def get_tokenizer(name_or_path: str) -> Tokenizer:
    """``"byte"`` or the path of a ``tokenizer.json``. A bad value is a ValueError of one line."""
    if name_or_path == "byte":
        return ByteTokenizer()
    from maxlm.storage import local_input  # a tokenizer.json in a bucket is read through the local cache

    path = local_input(name_or_path)
    if not os.path.isfile(path):
        raise ValueError(f"DataConfig.tokenizer = {name_or_path!r} is neither 'byte' nor an existing "
                         "tokenizer.json (train one with `python -m maxlm.data train-tokenizer`)")
    stat = os.stat(path)
    return _load_bpe(path, stat.st_mtime_ns, stat.st_size)


def train_bpe(texts: Iterator[str], vocab_size: int, *, min_frequency: int = 2,
              length: int | None = None, show_progress: bool = True):
    """A byte-level BPE (a ``tokenizers.Tokenizer``) trained on ``texts``; save it with ``.save(path)``.

    Special tokens take ids 0, 1, 2; the 256 byte symbols follow, then the learnt merges. The saved
    post-processor prepends bos, as Llama's tokenizer does, for consumers such as vLLM."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    floor = len(SPECIAL_TOKENS) + 256
    if vocab_size < floor:
        raise ValueError(f"vocab_size = {vocab_size} is below {floor} (3 special tokens + 256 bytes)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok
