"""Exact and near-duplicate removal.

Exact: a blake2b digest of the normalised text; the first copy is kept.

Near: MinHash over character shingles with locality-sensitive hashing, both from ``datasketch``
(MinHash with its affine32 permutations, MinHashLSH for the banding). Shingles are runs of
``shingle`` words of the lowercased text, where each CJK character is a word, so the measure means
the same for English, Chinese and code. Documents stream through in order: each one's MinHash
queries the index of the documents kept so far; LSH, set ``lsh_margin`` below the threshold, finds
candidates with high recall, and a candidate counts only when the MinHash estimate of its Jaccard
similarity reaches ``threshold``, which removes LSH's false positives. A duplicate is dropped (and
reported with the document it duplicates, the earliest one on a tie); anything else is kept and
indexed. Only LSH candidates are ever compared, so the decision for a document depends only on the
documents it shares a band with: ``maxlm.data.clean_ray`` runs this same class once per connected
component of the band graph, on a cluster, and gets the same result. With the default 256
permutations the estimate's standard deviation near J = 0.8 is 0.025 (planted pairs at J >= 0.83
are found 99% of the time); 128 halves the signature memory (1 KiB per kept document at 256) and
lets more pairs just above the threshold slip through.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
from datasketch import MinHash, MinHashLSH

_CHUNK = 1 << 16  # shingles per MinHash.update_batch call: bounds memory for huge documents


def exact_key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=16).digest()


# Class of each BMP code point: 0 part of a word, 1 whitespace (as str.split() sees it), 2 a CJK
# character (a word by itself; ranges as in maxlm.data.quality). Beyond the BMP: part of a word.
_CLASS = np.zeros(0x10000, dtype=np.uint8)
_CLASS[[c for c in range(0x3001) if chr(c).isspace()]] = 1
for _lo, _hi in ((0x2E80, 0x2FDF), (0x3040, 0x30FF), (0x3100, 0x312F), (0x3400, 0x4DBF), (0x4E00, 0x9FFF),
                 (0xAC00, 0xD7AF), (0xF900, 0xFAFF)):
    _CLASS[_lo:_hi + 1] = 2
_U = np.uint64


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x ^ (x >> _U(33))) * _U(0xFF51AFD7ED558CCD)
        x = (x ^ (x >> _U(33))) * _U(0xC4CEB9FE1A85EC53)
        return x ^ (x >> _U(33))


def word_hashes(text: str) -> np.ndarray:
    """One uint64 per word of ``text`` (words as in maxlm.data.quality: whitespace-separated runs,
    each CJK character alone), computed with numpy over the code points, no Python loop per word."""
    cps = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
    if cps.size == 0:
        return np.zeros(0, dtype=_U)
    cls = _CLASS[np.minimum(cps, 0xFFFF)]
    word = cls != 1
    cjk = cls == 2
    prev_word = np.r_[False, word[:-1]]
    prev_cjk = np.r_[False, cjk[:-1]]
    starts = word & (~prev_word | cjk | prev_cjk)
    idx = np.flatnonzero(word)
    if idx.size == 0:
        return np.zeros(0, dtype=_U)
    first = np.flatnonzero(starts[idx])  # positions in idx where a word starts
    offset = np.arange(idx.size) - np.repeat(first, np.diff(np.r_[first, idx.size]))
    with np.errstate(over="ignore"):
        values = _mix(cps[idx].astype(_U) * _U(0x9E3779B97F4A7C15) + offset.astype(_U))
    return np.add.reduceat(values, first)  # wraps mod 2^64: an order-sensitive sum per word


def shingles(text: str, size: int = 5) -> np.ndarray:
    """The set of ``size``-word shingles of the lowercased text, as unique uint32 hashes.

    Words are whitespace-separated runs, except that each Han, kana or Hangul character is a word of
    its own (as in maxlm.data.quality), so a shingle is five words of English or five characters of
    Chinese. A text shorter than ``size`` words is one shingle."""
    hashes = word_hashes(text.lower())
    if hashes.size == 0:
        return np.zeros(0, dtype=np.uint32)
    size = min(size, hashes.size)
    count = hashes.size - size + 1
    h = np.full(count, 14695981039346656037, dtype=_U)  # FNV-1a over the words of each window
    with np.errstate(over="ignore"):
        for j in range(size):
            h = (h ^ hashes[j:j + count]) * _U(1099511628211)
    return np.unique((h ^ (h >> _U(32))).astype(np.uint32))


def _identity(x):
    return x


class NearDedup:
    """Streaming near-duplicate detector; ``signature`` is pure, so workers can compute it."""

    def __init__(self, threshold: float = 0.8, num_perm: int = 256, shingle: int = 5, seed: int = 1,
                 lsh_margin: float = 0.1):
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"near-dedup threshold = {threshold} must lie in (0, 1]")
        if num_perm < 16:
            raise ValueError(f"near-dedup num_perm = {num_perm} is too few (use >= 16; the default is 256)")
        if shingle < 1:  # 0 would make every document one empty shingle: all "duplicates"
            raise ValueError(f"near-dedup shingle = {shingle} must be at least 1 word")
        self.threshold, self.num_perm, self.shingle, self.seed = threshold, num_perm, shingle, seed
        self.lsh = MinHashLSH(num_perm=num_perm, params=lsh_params(threshold, num_perm, lsh_margin))
        self._perm = _permutations(num_perm, seed)  # shared by all signatures
        self.kept: list[np.ndarray] = []  # signatures of indexed documents, by key
        self.ids: list[str] = []

    def signature(self, text: str) -> np.ndarray:
        return signature(text, self.num_perm, self.shingle, self.seed, self._perm)

    def add(self, doc_id: str, sig: np.ndarray) -> tuple[str | None, float]:
        """Index the document unless it near-duplicates an indexed one: (duplicate-of id, estimate)."""
        m = MinHash(num_perm=self.num_perm, seed=self.seed, hashvalues=sig, permutations=self._perm,
                    scheme="affine32")
        best, best_j = None, 0.0
        for key in sorted(self.lsh.query(m)):  # ties go to the earliest indexed document
            j = float(np.mean(self.kept[key] == sig))
            if j > best_j:
                best, best_j = key, j
        if best is not None and best_j >= self.threshold:
            return self.ids[best], best_j
        key = len(self.kept)
        self.lsh.insert(key, m, check_duplication=False)
        self.kept.append(sig)
        self.ids.append(doc_id)
        return None, best_j


@functools.lru_cache(maxsize=64)
def lsh_params(threshold: float, num_perm: int, lsh_margin: float = 0.1) -> tuple[int, int]:
    """(bands, rows per band) that datasketch's MinHashLSH picks for ``threshold - lsh_margin``: two
    documents are LSH candidates when all ``rows`` values of some band agree."""
    lsh = MinHashLSH(threshold=max(threshold - lsh_margin, 0.05), num_perm=num_perm)
    return lsh.b, lsh.r


@functools.lru_cache(maxsize=8)
def _permutations(num_perm: int, seed: int) -> np.ndarray:
    return MinHash(num_perm=num_perm, seed=seed).permutations


def signature(text: str, num_perm: int = 256, shingle: int = 5, seed: int = 1, permutations=None) -> np.ndarray:
    """The datasketch MinHash values (uint32, ``num_perm`` of them) of the text's shingles."""
    if permutations is None:
        permutations = _permutations(num_perm, seed)
    m = MinHash(num_perm=num_perm, seed=seed, hashfunc=_identity, permutations=permutations,
                scheme="affine32")
    hashes = shingles(text, shingle)
    for start in range(0, hashes.size, _CHUNK):
        m.update_batch(hashes[start:start + _CHUNK].tolist())
    return m.hashvalues.copy()


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two shingle sets (as returned by ``shingles``)."""
    if a.size == 0 and b.size == 0:
        return 1.0
    inter = np.intersect1d(a, b, assume_unique=True).size
    return inter / (a.size + b.size - inter)


# ---- evaluation on planted near-duplicates (used by the tests and scripts/bench_data.py) --------

def planted_corpus(n_base: int = 300, targets=(0.95, 0.9, 0.85, 0.7, 0.5, 0.3), copies_per_target: int = 20,
                   words: int = 150, shingle: int = 5, seed: int = 0, tolerance: float = 0.02):
    """(docs, pairs): ``n_base`` unrelated documents in English-like and Chinese words, then edited
    copies of some of them whose exact shingle Jaccard similarity to their original is within
    ``tolerance`` of each target. pairs = [(copy index, original index, exact Jaccard)]."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    han = np.array([chr(c) for c in range(0x4E00, 0x4E00 + 3000)])
    vocab = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(20000)]
    vocab += ["".join(rng.choice(han, rng.integers(1, 3))) for _ in range(5000)]

    def fresh(n):
        return [vocab[i] for i in rng.integers(0, len(vocab), n)]
    base = [fresh(words) for _ in range(n_base)]
    docs = [" ".join(b) for b in base]
    sets = [shingles(d, shingle) for d in docs]
    pairs = []
    for target in targets:
        made = 0
        for attempt in range(copies_per_target * 50):
            if made == copies_per_target:
                break
            orig = int(rng.integers(0, n_base))
            lo, hi = 0, words  # bisect the number of substituted words to reach the target
            for _ in range(12):
                k = (lo + hi) // 2
                copy = list(base[orig])
                for pos in rng.choice(words, k, replace=False):
                    copy[pos] = fresh(1)[0]
                text = " ".join(copy)
                j = jaccard(shingles(text, shingle), sets[orig])
                if abs(j - target) <= tolerance:
                    break
                lo, hi = (k + 1, hi) if j > target else (lo, k)
            if abs(j - target) <= tolerance:
                pairs.append((len(docs), orig, j))
                docs.append(text)
                made += 1
    return docs, pairs


def score_planted(docs, pairs, threshold: float = 0.8, num_perm: int = 256, shingle: int = 5) -> dict:
    """Run NearDedup over ``docs`` in order; recall over planted pairs at or above the threshold,
    precision over every pair it reported (judged by exact Jaccard), and documents per second."""
    import time

    nd = NearDedup(threshold=threshold, num_perm=num_perm, shingle=shingle)
    start = time.perf_counter()
    sigs = [nd.signature(d) for d in docs]
    reported = {}
    for i, sig in enumerate(sigs):
        of, _ = nd.add(str(i), sig)
        if of is not None:
            reported[i] = int(of)
    seconds = time.perf_counter() - start
    above = [(c, o) for c, o, j in pairs if j >= threshold]
    found = sum(reported.get(c) == o for c, o in above)
    true = sum(jaccard(shingles(docs[c], shingle), shingles(docs[o], shingle)) >= threshold
               for c, o in reported.items())
    return {"docs": len(docs), "pairs_above": len(above), "pairs_below": len(pairs) - len(above),
            "found": found, "reported": len(reported), "true_reported": true,
            "recall": found / max(len(above), 1), "precision": true / max(len(reported), 1),
            "docs_per_s": len(docs) / seconds}
