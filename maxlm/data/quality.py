"""Quality heuristics in the style of Gopher (Rae et al. 2021, appendix A) and C4 (Raffel et al. 2020).

A document is kept or dropped with one reason (the first rule it fails); boilerplate lines (cookie
and privacy notices, "all rights reserved", ICP footers ...) are removed first and counted. Every
threshold is a field of ``QualityConfig``; presets tune them per kind of source (``web``, ``books``,
``code``, ``none``) and ``python -m maxlm.data clean --quality web --set min_words=20`` overrides any.

Words are whitespace-separated runs, except that each Han, kana or Hangul character counts as one
word, so the length rules mean the same thing for Chinese as for English. The mean-word-length rule
only looks at the non-CJK words, and only when there are enough of them.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np

_CJK = r"\u2e80-\u2fdf\u3040-\u30ff\u3100-\u312f\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_WORDS = re.compile(rf"[{_CJK}]|[^\s{_CJK}]+")
_IS_CJK = re.compile(rf"[{_CJK}]")
_NOT_ALNUM = re.compile(r"[\W_]+")  # what remains after removing it: letters and digits (any script)
_BULLET = re.compile(r"^\s*(?:[-*•‣◦▪●·]|\d+[.)])\s")
_ELLIPSIS = ("...", "…", "。。。")

# Lines that are navigation, legal or tracking furniture, not content (checked on lines < 200 chars).
BOILERPLATE = re.compile("|".join([
    r"javascript (?:is )?(?:disabled|required|must be enabled)|enable javascript",
    r"\bcookies?\b.*\b(?:policy|consent|accept|use|settings)\b|\baccept (?:all )?cookies\b",
    r"\bprivacy policy\b|\bterms (?:of (?:use|service)|and conditions)\b",
    r"\ball rights reserved\b|^\s*(?:copyright\s*)?(?:©|\(c\))\s*\d{4}",
    r"\bclick here\b|\bsubscribe to (?:our|the) newsletter\b|\bfollow us on\b|\bshare (?:this|on)\b",
    r"\bsign (?:in|up)\b.*\b(?:account|free)\b|\bskip to (?:main )?content\b",
    r"版权所有|隐私政策|用户协议|免责声明|点击(?:这里|此处)|关注我们|扫码关注|扫一扫|ICP备|网站地图|返回顶部",
]), re.IGNORECASE)

_BOILERPLATE_GATE = re.compile(r"javascript|cookie|privacy|terms|rights reserved|©|\(c\)|click here|"
                               r"subscribe|follow us|share|sign|skip to|版权|隐私|用户协议|免责|点击|关注|扫|ICP备|"
                               r"网站地图|返回顶部", re.IGNORECASE)
_GATE_LOWER = re.compile(_BOILERPLATE_GATE.pattern.lower())
_HAS_ALPHA = re.compile(r"[^\W\d_]")


@dataclasses.dataclass(frozen=True)
class QualityConfig:
    """Thresholds; a rule whose bound is 0 (or None for the n-gram tables) is off."""

    min_words: int = 50  # Gopher: 50..100,000 words
    max_words: int = 100_000
    min_mean_word_len: float = 3.0  # Gopher: 3..10 characters (non-CJK words only)
    max_mean_word_len: float = 10.0
    max_symbol_ratio: float = 0.1  # '#' and '...' per word
    max_bullet_lines: float = 0.9  # fraction of lines starting with a bullet
    max_ellipsis_lines: float = 0.3  # fraction of lines ending with an ellipsis
    min_alpha_words: float = 0.8  # fraction of words with at least one letter
    min_alnum_ratio: float = 0.5  # fraction of non-space characters that are letters or digits
    max_dup_line_frac: float = 0.3  # lines that repeat an earlier line
    max_dup_para_frac: float = 0.3
    max_dup_line_chars: float = 0.2  # characters in repeated lines
    max_dup_para_chars: float = 0.2
    # Gopher: the most frequent word n-gram may cover at most this fraction of the characters.
    top_ngram_chars: tuple = ((2, 0.20), (3, 0.18), (4, 0.16))
    # Gopher: characters inside word n-grams that occur more than once.
    dup_ngram_chars: tuple = ((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10))
    max_line_chars: int = 0  # code (Codex/StarCoder): longest line, e.g. minified files
    max_mean_line_chars: float = 0.0
    remove_boilerplate: bool = True  # C4: drop furniture lines before judging
    drop_lorem_ipsum: bool = True  # C4: placeholder pages

    def replace(self, **changes) -> "QualityConfig":
        return dataclasses.replace(self, **changes)


_OFF = dict(min_words=0, max_words=0, min_mean_word_len=0.0, max_mean_word_len=0.0, max_symbol_ratio=0.0,
            max_bullet_lines=0.0, max_ellipsis_lines=0.0, min_alpha_words=0.0, min_alnum_ratio=0.0,
            max_dup_line_frac=0.0, max_dup_para_frac=0.0, max_dup_line_chars=0.0, max_dup_para_chars=0.0,
            top_ngram_chars=(), dup_ngram_chars=(), max_line_chars=0, max_mean_line_chars=0.0,
            remove_boilerplate=False, drop_lorem_ipsum=False)

PRESETS = {
    "web": QualityConfig(),
    # Long-form prose: no upper length bound, more tolerance for repeated headers and dialogue.
    "books": QualityConfig(max_words=0, min_words=200, max_dup_line_frac=0.5, max_dup_line_chars=0.3,
                           max_bullet_lines=0.0, max_ellipsis_lines=0.5, remove_boilerplate=False,
                           top_ngram_chars=(), dup_ngram_chars=((10, 0.2),)),
    # Source code: symbols and short repeated lines are normal; minified or generated files are not.
    "code": QualityConfig(**{**_OFF, "min_words": 5, "min_alnum_ratio": 0.25, "max_line_chars": 1000,
                             "max_mean_line_chars": 100.0, "max_dup_line_frac": 0.7}),
    "none": QualityConfig(**_OFF),
}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_setting(name: str, value: str, current):
    """One NAME=VALUE override, parsed by the field's type and range-checked; ValueError names it."""
    if isinstance(current, bool):
        if value.lower() not in _TRUE + _FALSE:
            raise ValueError(f"quality setting {name}={value!r} is not a valid bool (use true or false)")
        return value.lower() in _TRUE
    try:
        if isinstance(current, tuple):  # "2:0.2,3:0.18": n-gram size, fraction of the characters
            parsed = tuple((int(n), float(f)) for n, f in (item.split(":") for item in value.split(",") if item))
        else:
            parsed = type(current)(value)
    except ValueError:
        raise ValueError(f"quality setting {name}={value!r} is not a valid {type(current).__name__}") from None
    if isinstance(current, tuple):
        bad = [f"{n}:{f}" for n, f in parsed if n < 1 or not 0.0 <= f <= 1.0]
        if bad:
            raise ValueError(f"quality setting {name}={value!r}: {bad[0]} is out of range (each N:F needs "
                             "an n-gram size N >= 1 and a fraction F in [0, 1])")
    elif not 0 <= parsed < float("inf"):  # also false for nan
        raise ValueError(f"quality setting {name}={value!r} is out of range: give a finite number >= 0 "
                         "(0 turns the rule off)")
    return parsed


def config_from(preset: str, overrides: dict[str, str] | None = None) -> QualityConfig:
    """A preset with NAME=VALUE overrides (strings parsed by each field's type, range-checked)."""
    if preset not in PRESETS:
        raise ValueError(f"quality preset {preset!r} is not one of {', '.join(PRESETS)}")
    cfg = PRESETS[preset]
    fields = {f.name: f for f in dataclasses.fields(QualityConfig)}
    changes = {}
    for name, value in (overrides or {}).items():
        if name not in fields:
            raise ValueError(f"quality setting {name!r} is unknown; known: {', '.join(fields)}")
        changes[name] = _parse_setting(name, value, getattr(cfg, name))
    return cfg.replace(**changes)


def words_of(text: str) -> list[str]:
    return _WORDS.findall(text)


def _repeated_fraction(items: list[str]) -> tuple[float, float]:
    """(fraction of items that repeat an earlier one, fraction of their characters)."""
    if not items:
        return 0.0, 0.0
    seen, dup, dup_chars = set(), 0, 0
    for item in items:
        if item in seen:
            dup += 1
            dup_chars += len(item)
        else:
            seen.add(item)
    total_chars = sum(len(i) for i in items) or 1
    return dup / len(items), dup_chars / total_chars


def _ngram_ids(ids: np.ndarray, n: int) -> np.ndarray:
    """A dense id per word n-gram, from a 64-bit polynomial hash of its word ids (collisions
    between distinct n-grams of one document are vanishingly rare at 64 bits)."""
    windows = np.lib.stride_tricks.sliding_window_view(ids.astype(np.uint64), n)
    h = np.zeros(windows.shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * np.uint64(0x100000001B3) + windows[:, j] + np.uint64(1)
    _, inverse = np.unique(h, return_inverse=True)
    return inverse.reshape(-1)


def ngram_stats(words: list[str], top_ns=(2, 3, 4), dup_ns=(5, 6, 7, 8, 9, 10)) -> dict:
    """Gopher's repetition measures over word n-grams, as fractions of the words' characters."""
    out = {}
    if not words:
        return out
    vocab: dict[str, int] = {}
    ids = np.fromiter((vocab.setdefault(w, len(vocab)) for w in words), dtype=np.int64, count=len(words))
    lengths = np.fromiter((len(w) for w in words), dtype=np.int64, count=len(words))
    total = int(lengths.sum()) or 1
    for n in top_ns:
        if len(words) < n:
            continue
        grams = _ngram_ids(ids, n)
        counts = np.bincount(grams)
        best = int(np.argmax(counts))
        first = int(np.flatnonzero(grams == best)[0])
        out[f"top_{n}gram"] = float(counts[best] * lengths[first:first + n].sum() / total)
    for n in dup_ns:
        if len(words) < n:
            continue
        grams = _ngram_ids(ids, n)
        repeated = np.bincount(grams)[grams] > 1
        covered = np.zeros(len(words) + 1, dtype=np.int64)
        starts = np.flatnonzero(repeated)
        np.add.at(covered, starts, 1)
        np.add.at(covered, starts + n, -1)
        mask = np.cumsum(covered)[:-1] > 0
        out[f"dup_{n}gram"] = float(lengths[mask].sum() / total)
    return out


def remove_boilerplate(text: str) -> tuple[str, int]:
    """(text without furniture lines, lines removed). One pass of a keyword gate over the whole
    text; only the lines it hits are matched against the full patterns."""
    low = text.lower()  # a case-sensitive search of the lowered text is ~6x faster than IGNORECASE
    gate, hay = (_GATE_LOWER, low) if len(low) == len(text) else (_BOILERPLATE_GATE, text)
    hits = [m.start() for m in gate.finditer(hay)]
    if not hits:
        return text, 0
    drop = []
    for pos in hits:
        start = text.rfind("\n", 0, pos) + 1
        end = text.find("\n", pos)
        end = len(text) if end < 0 else end
        if (drop and drop[-1][0] == start) or end - start >= 200:
            continue
        if BOILERPLATE.search(text, start, end):
            drop.append((start, end))
    if not drop:
        return text, 0
    pieces, last = [], 0
    for start, end in drop:
        pieces.append(text[last:start])
        last = end + 1  # the line and its newline
    pieces.append(text[last:])
    return "".join(pieces), len(drop)


def check(text: str, cfg: QualityConfig) -> tuple[str | None, str | None, dict]:
    """(text to keep or None, reason dropped or None, stats such as boilerplate lines removed)."""
    stats = collections.Counter()
    if cfg.remove_boilerplate:
        text, removed = remove_boilerplate(text)
        stats["boilerplate_lines"] += removed
        text = text.strip("\n")
    if not text.strip():
        return None, "empty_after_boilerplate", stats
    if cfg.drop_lorem_ipsum and "lorem ipsum" in text.lower():
        return None, "lorem_ipsum", stats
    words = words_of(text)
    n = len(words)
    if cfg.min_words and n < cfg.min_words:
        return None, "too_few_words", stats
    if cfg.max_words and n > cfg.max_words:
        return None, "too_many_words", stats
    if cfg.min_mean_word_len or cfg.max_mean_word_len:
        latin = [w for w in words if not _IS_CJK.match(w)]
        if len(latin) >= max(10, n // 2):
            mean = sum(map(len, latin)) / len(latin)
            if cfg.min_mean_word_len and mean < cfg.min_mean_word_len:
                return None, "short_words", stats
            if cfg.max_mean_word_len and mean > cfg.max_mean_word_len:
                return None, "long_words", stats
    if cfg.max_symbol_ratio and n:
        symbols = text.count("#") + sum(text.count(e) for e in _ELLIPSIS)
        if symbols / n > cfg.max_symbol_ratio:
            return None, "symbol_ratio", stats
    if cfg.min_alpha_words and n and sum(1 for w in words if _HAS_ALPHA.search(w)) / n < cfg.min_alpha_words:
        return None, "alpha_words", stats
    if cfg.min_alnum_ratio:
        visible = len(text) - sum(text.count(c) for c in " \n\t\u3000")
        alnum = len(_NOT_ALNUM.sub("", text))
        if visible and alnum / visible < cfg.min_alnum_ratio:
            return None, "alnum_ratio", stats
    lines = [ln.strip() for ln in text.split("\n")]
    nonblank = [ln for ln in lines if ln]
    if nonblank:
        share = 1.0 / len(nonblank)
        if cfg.max_bullet_lines and sum(bool(_BULLET.match(ln + " ")) for ln in nonblank) * share > cfg.max_bullet_lines:
            return None, "bullet_lines", stats
        if cfg.max_ellipsis_lines and sum(ln.endswith(_ELLIPSIS) for ln in nonblank) * share > cfg.max_ellipsis_lines:
            return None, "ellipsis_lines", stats
        if cfg.max_line_chars and max(map(len, text.split("\n"))) > cfg.max_line_chars:
            return None, "long_line", stats
        if cfg.max_mean_line_chars and len(text) / len(nonblank) > cfg.max_mean_line_chars:
            return None, "long_lines_mean", stats
    # Gopher's repetition checks, on lines and on paragraphs: (fraction, characters) repeated.
    units = (("line", lambda: nonblank, cfg.max_dup_line_frac, cfg.max_dup_line_chars),
             ("paragraph", lambda: [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()],
              cfg.max_dup_para_frac, cfg.max_dup_para_chars))
    for unit, split, max_frac, max_chars in units:
        if max_frac or max_chars:
            frac, chars = _repeated_fraction(split())
            if max_frac and frac > max_frac:
                return None, f"dup_{unit}s", stats
            if max_chars and chars > max_chars:
                return None, f"dup_{unit}_chars", stats
    if cfg.top_ngram_chars or cfg.dup_ngram_chars:
        measured = ngram_stats(words, [n for n, _ in cfg.top_ngram_chars], [n for n, _ in cfg.dup_ngram_chars])
        for n, bound in cfg.top_ngram_chars:
            if measured.get(f"top_{n}gram", 0.0) > bound:
                return None, f"top_{n}gram", stats
        for n, bound in cfg.dup_ngram_chars:
            if measured.get(f"dup_{n}gram", 0.0) > bound:
                return None, f"dup_{n}gram", stats
    return text, None, stats
