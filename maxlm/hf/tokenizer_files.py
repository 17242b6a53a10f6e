"""maxlm tokenizers as Hugging Face tokenizer files, and back.

``write_tokenizer(tokenizer, out_dir)`` writes ``tokenizer.json`` (the ``tokenizers`` library's
format), ``tokenizer_config.json`` and ``special_tokens_map.json``, such that
``AutoTokenizer.from_pretrained(out_dir)(text).input_ids == tokenizer.encode(text, add_eos=False)``:
a prompt is tokenised by transformers and vLLM exactly as maxlm tokenises it (bos first, no eos),
and ``decode(ids, skip_special_tokens=True)`` gives the text back.

* The byte tokenizer becomes a byte-level BPE without merges: id ``b`` is byte ``b`` (spelt with
  GPT-2's byte-to-unicode alphabet, as every byte-level BPE spells bytes), the specials are added
  tokens 256..258. maxlm's byte tokenizer encodes a literal ``<|bos|>`` in text as its 7 bytes, so
  ``split_special_tokens`` is set: transformers then encodes special-token strings in text as text.
* A BPE tokenizer's own ``tokenizer.json`` is copied with the bos-prepending post-processor. maxlm's
  BPE (the same ``tokenizers`` library) does match special-token strings in text, and so does this.

``load_tokenizer(hf_dir)`` gives back maxlm's interface (``encode``/``decode``/``vocab_size``/
``bos_id``/``eos_id``/``pad_id``): a ``ByteTokenizer`` for the byte file above, a ``BPETokenizer``
for a file with maxlm's specials, else a wrapper around any Hugging Face ``tokenizer.json``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from maxlm.data.tokenizer import (
    BOS,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    BPETokenizer,
    ByteTokenizer,
    _with_specials,
)

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@functools.cache
def byte_alphabet() -> tuple[str, ...]:
    """GPT-2's printable spelling of each byte (``bytes_to_unicode``): printable Latin-1 bytes stand
    for themselves, the rest are shifted past 255. ``tokenizers``' ByteLevel pre-tokenizer and
    decoder use this same table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return tuple(chars[b] for b in range(256))


def _bos_processor(bos_id: int) -> Any:
    from tokenizers import processors

    return processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                         special_tokens=[(BOS, bos_id)])


def byte_tokenizer_json() -> str:
    """The ``tokenizers`` JSON equivalent to maxlm's ``ByteTokenizer``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte = ByteTokenizer()
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(byte_alphabet())}, merges=[]))
    # One "word" per text (no regex split): without merges the split cannot change the ids.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [byte.bos_id, byte.eos_id, byte.pad_id]
    tok.post_processor = _bos_processor(byte.bos_id)
    return tok.to_str(pretty=True)


def _bpe_tokenizer_json(tokenizer: BPETokenizer) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer._tok.to_str())
    tok.post_processor = _bos_processor(tokenizer.bos_id)
    return tok.to_str(pretty=True)


def write_tokenizer(tokenizer: Any, out_dir: str | Path, *, model_max_length: int | None = None,
                    chat_template: str | None = None) -> list[str]:
    """Write FILES for a maxlm ByteTokenizer or BPETokenizer into ``out_dir``; returns their names.

    ``chat_template`` (a Jinja string) goes into tokenizer_config.json only when given."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, ByteTokenizer):
        text, split = byte_tokenizer_json(), True
    elif isinstance(tokenizer, BPETokenizer):
        text, split = _bpe_tokenizer_json(tokenizer), False
    else:
        raise TypeError(f"cannot export a {type(tokenizer).__name__} (expected ByteTokenizer or BPETokenizer)")
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": True, "add_eos_token": False,  # what tokenizer.json's post-processor does
        "clean_up_tokenization_spaces": False,  # decode must give the text back unchanged
        "split_special_tokens": split,
        "model_max_length": model_max_length if model_max_length is not None else 10**30,
        "added_tokens_decoder": {str(tokenizer_id): {"content": content, "lstrip": False, "rstrip": False,
                                                     "normalized": False, "single_word": False,
                                                     "special": True}
                                 for content, tokenizer_id in zip(SPECIAL_TOKENS, (
                                     tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id))},
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out_dir / "tokenizer.json").write_text(text)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return list(FILES)


# ---------------------------------------------------------------------------------------------
# Hugging Face tokenizer files -> maxlm's interface


class HFTokenizer:
    """Any Hugging Face ``tokenizer.json`` behind maxlm's tokenizer interface; maxlm adds bos/eos
    itself (the file's post-processor is bypassed, as ``BPETokenizer`` does). ``add_bos`` False
    (e.g. GPT-2, whose bos is its eos and which transformers never prepends): ``encode`` adds no
    bos even when asked, as transformers' tokenizer adds none."""

    def __init__(self, tok: Any, bos_id: int | None, eos_id: int | None, pad_id: int | None,
                 source: str, split_special_tokens: bool = False, add_bos: bool = True):
        self._tok, self.name, self.fingerprint = tok, source, source
        tok.encode_special_tokens = split_special_tokens
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos = add_bos
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._special = {i for i in (bos_id, eos_id, self.pad_id) if i is not None}

    def encode(self, text: str | bytes, add_bos: bool = True, add_eos: bool = True) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        body = np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        bos = self.bos_id if add_bos and self.add_bos else None
        return _with_specials(body, bos, self.eos_id if add_eos else None)

    def encode_batch(self, texts: list[str], add_bos: bool = True, add_eos: bool = True) -> list[np.ndarray]:
        return [self.encode(t, add_bos, add_eos) for t in texts]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        keep = [int(i) for i in ids if 0 <= i < self.vocab_size and int(i) not in self._special]
        return self._tok.decode(keep, skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size})"


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot be read as JSON ({' '.join(str(err).split())})") from None
    return value if isinstance(value, dict) else {}


def _is_byte_file(data: dict[str, Any]) -> bool:
    model = data.get("model") or {}
    added = {t.get("content"): t.get("id") for t in data.get("added_tokens") or [] if isinstance(t, dict)}
    byte = ByteTokenizer()
    return (model.get("type") == "BPE" and not model.get("merges")
            and model.get("vocab") == {c: b for b, c in enumerate(byte_alphabet())}
            and added == {BOS: byte.bos_id, EOS: byte.eos_id, PAD: byte.pad_id})


def _token_id(tok: Any, value: Any) -> int | None:
    if isinstance(value, dict):  # an AddedToken as transformers serialises it
        value = value.get("content")
    return tok.token_to_id(value) if isinstance(value, str) else None


def load_tokenizer(hf_dir: str | Path) -> Any:
    """maxlm's tokenizer interface over ``hf_dir/tokenizer.json`` (see the module docstring).

    Problems are a one-line ValueError naming the file."""
    from tokenizers import Tokenizer

    hf_dir = Path(hf_dir).expanduser()
    path = hf_dir / "tokenizer.json"
    data = _json(path)
    if not data:
        raise ValueError(f"{path}: not found or not a tokenizer.json object")
    if _is_byte_file(data):
        return ByteTokenizer()
    try:
        tok = Tokenizer.from_str(json.dumps(data))
    except Exception as err:  # tokenizers raises its own exception type
        raise ValueError(f"{path}: not a valid tokenizer.json ({' '.join(str(err).split())})") from None
    if all(tok.token_to_id(t) is not None for t in SPECIAL_TOKENS):
        return BPETokenizer(str(path))
    config, model_config = _json(hf_dir / "tokenizer_config.json"), _json(hf_dir / "config.json")
    ids = {}
    for name in ("bos", "eos", "pad"):
        found = _token_id(tok, config.get(f"{name}_token"))
        fallback = model_config.get(f"{name}_token_id")
        if isinstance(fallback, list):  # e.g. Llama 3 instruct lists several eos ids
            fallback = fallback[0] if fallback else None
        ids[name] = found if found is not None else fallback
    return HFTokenizer(tok, ids["bos"], ids["eos"], ids["pad"], str(path),
                       bool(config.get("split_special_tokens", False)), _adds_bos(tok, config, ids["bos"]))


def _adds_bos(tok: Any, config: dict[str, Any], bos_id: int | None) -> bool:
    """Whether transformers prepends bos: ``tokenizer_config.json``'s ``add_bos_token`` when it is
    set, else whether the file's post-processor puts bos first."""
    if bos_id is None:
        return False
    if isinstance(config.get("add_bos_token"), bool):
        return config["add_bos_token"]
    try:
        ids = tok.encode("a", add_special_tokens=True).ids
    except Exception:  # tokenizers raises its own exception type
        return False
    return bool(ids) and ids[0] == bos_id and tok.encode("a", add_special_tokens=False).ids[:1] != [bos_id]
