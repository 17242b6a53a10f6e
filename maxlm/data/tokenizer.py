"""Tokenizers. The byte tokenizer needs no download, so the default run works offline."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; three special tokens follow them."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str | bytes, add_bos: bool = True, add_eos: bool = True) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        body = np.frombuffer(data, dtype=np.uint8)
        head = [self.bos_id] if add_bos else []
        tail = [self.eos_id] if add_eos else []
        out = np.empty(len(head) + body.size + len(tail), dtype=np.int32)
        out[:len(head)] = head
        out[len(head):len(head) + body.size] = body
        out[len(head) + body.size:] = tail
        return out

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        # Specials and ids past the byte range (padded vocab rows a model may sample) carry no text.
        data = ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def get_tokenizer(name: str) -> ByteTokenizer:
    if name == "byte":
        return ByteTokenizer()
    raise ValueError(f"DataConfig.tokenizer = {name!r} is not supported; use 'byte' "
                     "(BPE tokenizers arrive with a later issue)")
