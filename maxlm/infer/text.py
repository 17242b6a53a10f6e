"""Text of a completion as it grows: where a stop string ends it, and how much of it is safe to
show. Generation's streaming and the serving engine's streamed responses share these."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def stop_at(tokenizer: Any, tokens: np.ndarray, stop_strings: Sequence[str], start: int) -> tuple[int, str] | None:
    """(tokens to keep, completion text) when a stop string appears in the decoded tokens: keep up
    to the token that completes it, and the text before it. ``start``: tokens already checked."""
    text = tokenizer.decode(tokens)
    found = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    if not found:
        return None
    for n in range(max(start, 1), len(tokens) + 1):
        if any(s in tokenizer.decode(tokens[:n]) for s in stop_strings):
            return n, text[:min(found)]
    return len(tokens), text[:min(found)]


def safe_end(text: str, stop_strings: Sequence[str]) -> int:
    """How much of a running completion's text may be shown: not a trailing partial UTF-8
    character, nor a tail that could be the start of a stop string. An incomplete character at
    the end decodes to one U+FFFD; earlier ones are invalid bytes for good, so they are shown
    (holding back every trailing U+FFFD would stall a stream of invalid bytes to its end)."""
    end = len(text) - 1 if text.endswith("\ufffd") else len(text)
    for s in stop_strings:
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:k]):
                end -= k
                break
    return end
