"""The KV block pool's bookkeeping, on the host: a free list, reference counts and the prefix cache.

The device holds a pool of ``num_blocks`` fixed-size K/V blocks per layer (``PagedKVCache``); each
sequence owns a list of block ids (its block table). Block 0 is never handed out: block tables are
padded with it, and it is never written, so padded entries read zeros that the mask ignores.

Prefix caching (as vLLM's automatic prefix caching): once a block is full, it is keyed by a hash
of every token up to its end (the parent block's hash and its own tokens), so two requests whose
prompts share a prefix of whole blocks share those blocks. Blocks are reference-counted; a freed
block whose hash is known stays in the cache, at the back of the free list (least recently freed
first out), until the allocator reuses it, and a later request with the same prefix takes it back.
A shared block is never written: ``writable`` copies it first (copy-on-write), which happens when a
request reuses every block of a prompt that ends on a block boundary and recomputes its last token.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

NULL_BLOCK = 0


class OutOfBlocks(Exception):
    """The free list is empty (the scheduler preempts, never crashes)."""


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The prefix hash of each full block of ``tokens``: block i's hash covers tokens [0, (i+1)*bs)."""
    hashes, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size])))
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks = {num_blocks}: the pool needs at least 2 blocks (block 0 is reserved)")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refs = [0] * num_blocks
        # Free blocks in reuse order (an ordered dict as an LRU list: reuse pops the oldest).
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[int, int] = {}  # prefix hash -> block
        self.hash_of: dict[int, int] = {}  # block -> its prefix hash
        self.hit_tokens = 0  # prompt tokens found in the prefix cache
        self.queried_tokens = 0  # prompt tokens looked up
        self.copies = 0  # copy-on-write copies made

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    def allocate(self) -> int:
        """A fresh block (reference count 1); evicts the least recently freed cached block."""
        if not self.free:
            raise OutOfBlocks
        block, _ = self.free.popitem(last=False)
        old = self.hash_of.pop(block, None)
        if old is not None and self.cached.get(old) == block:
            del self.cached[old]
        self.refs[block] = 1
        return block

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a block nobody holds goes to the back of the free list
        (still findable by its hash until it is reused)."""
        for block in blocks:
            self.refs[block] -= 1
            assert self.refs[block] >= 0, f"block {block} released twice"
            if self.refs[block] == 0:
                self.free[block] = None

    def match_prefix(self, tokens: Sequence[int]) -> list[int]:
        """The cached blocks that hold ``tokens``' longest prefix of whole blocks, each now held
        once more. At least the last token is left to compute (its logits pick the next token)."""
        if not self.prefix_caching:
            return []
        self.queried_tokens += len(tokens)
        blocks = []
        for h in block_hashes(tokens, self.block_size):
            block = self.cached.get(h)
            if block is None:
                break
            if self.refs[block] == 0:
                del self.free[block]
            self.refs[block] += 1
            blocks.append(block)
        self.hit_tokens += min(len(blocks) * self.block_size, len(tokens) - 1)
        return blocks

    def unmatch(self, tokens: Sequence[int], blocks: Sequence[int]) -> None:
        """Undo ``match_prefix`` (the request could not be admitted after all)."""
        self.release(blocks)
        self.queried_tokens -= len(tokens)
        self.hit_tokens -= min(len(blocks) * self.block_size, len(tokens) - 1)

    def register(self, tokens: Sequence[int], blocks: Sequence[int], computed: int) -> None:
        """Key each of ``blocks`` that ``computed`` tokens fill by its prefix hash."""
        if not self.prefix_caching:
            return
        full = computed // self.block_size
        for i, h in enumerate(block_hashes(tokens[:full * self.block_size], self.block_size)):
            block = blocks[i]
            if block in self.hash_of:
                continue
            if h not in self.cached:  # a twin computed at the same time stays unshared
                self.cached[h] = block
                self.hash_of[block] = h

    def writable(self, blocks: list[int], index: int) -> int | None:
        """Make ``blocks[index]`` safe to write: a block shared with others (or kept in the prefix
        cache) is replaced by a private copy. Returns the source block to copy from, else None."""
        block = blocks[index]
        if self.refs[block] == 1 and block not in self.hash_of:
            return None
        fresh = self.allocate()
        self.release([block])
        blocks[index] = fresh
        self.copies += 1
        return block

    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def leaks(self) -> list[int]:
        """Blocks still referenced (empty once every sequence has finished)."""
        return [b for b in range(1, self.num_blocks) if self.refs[b]]
