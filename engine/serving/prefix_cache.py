"""Prefix caching for the serving loop: a request whose prompt starts with tokens another request
already prefilled (a shared system prompt, one document asked several questions) reuses their
KV entries instead of computing them again, as vLLM's automatic prefix caching does.

- Block-granular: a prompt is cut into blocks of `block_size` tokens. A block is identified by
  its tokens and its parent block (the blocks before it), so a block is only ever reused after
  exactly the same prefix: the KV entries of a position depend on every token before it.
- Only full blocks of prompt tokens are cached, and a hit never covers a prompt's last token:
  its logits are needed to choose the first output token, so at least that token is computed.
- Shared, not copied: a request's KV (RequestKV) is the list of its cached prefix blocks followed
  by its own entries; each attention call reads the blocks in order (as paged attention reads a
  block table). A block is reference-counted: every live request using it holds a reference.
- Bounded: the cache holds at most `budget_tokens` tokens of blocks. To make room it evicts the
  least recently used block that no live request holds and that no cached block extends (a leaf:
  evicting a parent would strand its children). When every block is held, new blocks are not
  cached (counted in `stats.skipped`).
- Exact: the reused KV entries are the bits the request would compute itself when prefill is
  batch-invariant (the engine's bfloat16 kernels on a CPU: a position's KV does not depend on the
  chunk it is computed in). tests/test_prefix_cache.py checks each request's greedy output
  against its solo run with the cache on and off.

One cache belongs to one serving run (engine.serving.loop makes it), so no session sees another's
prompts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.errors import InputError
from engine.metrics import reusable_prefix_tokens

DEFAULT_BLOCK_SIZE = 32
DEFAULT_BUDGET_TOKENS = 8192
MAX_BLOCK_SIZE = 1024


@dataclass(eq=False)
class Block:
    """block_size prompt tokens at positions [start, start + block_size) after the parent's."""

    parent: Block | None
    tokens: tuple[int, ...]
    start: int
    keys: tuple[torch.Tensor, ...]  # per layer (1, Hkv, block_size, D)
    values: tuple[torch.Tensor, ...]
    refs: int = 0  # live requests holding it
    children: int = 0  # cached blocks that extend it
    last_used: int = 0  # the cache's clock at its last hit or insertion


@dataclass
class CacheStats:
    lookups: int = 0  # prompt lookups (a request waiting to start looks up again at each step)
    hits: int = 0  # ... that found at least one block
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    skipped_blocks: int = 0  # not cached: the budget was full of blocks in use

    def to_jsonable(self) -> dict:
        return dict(vars(self))


class PrefixCache:
    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, budget_tokens: int = DEFAULT_BUDGET_TOKENS):
        if not _is_int(block_size) or not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise InputError(f"prefix cache block size must be an integer in 1..{MAX_BLOCK_SIZE} (got {block_size})")
        if not _is_int(budget_tokens) or budget_tokens < block_size:
            raise InputError(f"prefix cache budget must be an integer of at least one block ({block_size} tokens; "
                             f"got {budget_tokens})")
        self.block_size = block_size
        self.budget_tokens = budget_tokens
        self._blocks: dict[tuple[int, tuple[int, ...]], Block] = {}  # (id of parent or 0, tokens) -> block
        self._clock = itertools.count(1)
        self.stats = CacheStats()

    @property
    def cached_tokens(self) -> int:
        return len(self._blocks) * self.block_size

    def __len__(self) -> int:
        return len(self._blocks)

    def _key(self, parent: Block | None, tokens: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        return (0 if parent is None else id(parent), tokens)

    def _chunks(self, prompt_ids: list[int], computed: int):
        """The prompt's blocks a cache may hold once its first `computed` tokens have KV."""
        b = self.block_size
        for start in range(0, reusable_prefix_tokens(len(prompt_ids), computed, b), b):
            yield start, tuple(prompt_ids[start:start + b])

    def _walk(self, prompt_ids: list[int]) -> list[Block]:
        blocks: list[Block] = []
        for _, tokens in self._chunks(prompt_ids, len(prompt_ids)):
            block = self._blocks.get(self._key(blocks[-1] if blocks else None, tokens))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def peek(self, prompt_ids: list[int]) -> int:
        """How many of the prompt's tokens a match would reuse now (no side effects: a router
        asks every replica's cache)."""
        return len(self._walk(prompt_ids)) * self.block_size

    def match(self, prompt_ids: list[int]) -> list[Block]:
        """The longest chain of cached blocks the prompt starts with, never covering its last
        token; each is marked used now and held (acquire) for the caller."""
        self.stats.lookups += 1
        blocks = self._walk(prompt_ids)
        now = next(self._clock)
        for block in blocks:
            block.last_used = now
        self.acquire(blocks)
        if blocks:
            self.stats.hits += 1
        return blocks

    @staticmethod
    def acquire(blocks: list[Block]) -> None:
        for block in blocks:
            block.refs += 1

    @staticmethod
    def release(blocks: list[Block]) -> None:
        for block in blocks:
            if block.refs <= 0:
                raise RuntimeError("prefix cache: a block was released more often than it was held")
            block.refs -= 1

    def insert(self, prompt_ids: list[int], upto: int, kv: RequestKV) -> int:
        """Cache every full block of prompt positions [0, upto) not cached yet, from the
        request's KV (its own entries are copied; its prefix blocks are already cached).
        Returns the number of blocks added."""
        parent, added = None, 0
        now = next(self._clock)
        for start, tokens in self._chunks(prompt_ids, upto):
            key = self._key(parent, tokens)
            block = self._blocks.get(key)
            if block is None:
                if not self._make_room():
                    self.stats.skipped_blocks += 1
                    break
                keys, values = kv.entries(start, start + self.block_size)
                block = Block(parent, tokens, start, keys, values, last_used=now)
                self._blocks[key] = block
                if parent is not None:
                    parent.children += 1
                self.stats.inserted_blocks += 1
                added += 1
            parent = block
        return added

    def _make_room(self) -> bool:
        """Evict until one more block fits; False if every remaining block is held."""
        while self.cached_tokens + self.block_size > self.budget_tokens:
            victims = [b for b in self._blocks.values() if b.refs == 0 and b.children == 0]
            if not victims:
                return False
            victim = min(victims, key=lambda b: (b.last_used, -b.start))  # oldest; deepest first on a tie
            del self._blocks[self._key(victim.parent, victim.tokens)]
            if victim.parent is not None:
                victim.parent.children -= 1
            self.stats.evicted_blocks += 1
        return True


class RequestKV:
    """A request's KV cache in packed serving: its cached prefix blocks (shared, read-only)
    followed by its own entries. `update` is the one call packed attention makes
    (engine.serving.packed): append this step's keys/values for a layer, return all of them."""

    def __init__(self, blocks: list[Block] | tuple[Block, ...] = ()):
        self.blocks = tuple(blocks)
        self.reused = sum(len(b.tokens) for b in self.blocks)  # positions [0, reused) are the blocks'
        self._keys: dict[int, torch.Tensor] = {}  # layer -> (1, Hkv, own, D)
        self._values: dict[int, torch.Tensor] = {}

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self._keys:
            keys = torch.cat([self._keys[layer], keys], dim=-2)
            values = torch.cat([self._values[layer], values], dim=-2)
        self._keys[layer], self._values[layer] = keys, values
        if not self.blocks:
            return keys, values
        return (torch.cat([*(b.keys[layer] for b in self.blocks), keys], dim=-2),
                torch.cat([*(b.values[layer] for b in self.blocks), values], dim=-2))

    def entries(self, start: int, end: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Copies of the own entries at positions [start, end), every layer."""
        if start < self.reused:
            raise ValueError(f"positions from {start} are in the request's cached prefix (up to {self.reused})")
        lo, hi = start - self.reused, end - self.reused
        layers = sorted(self._keys)
        if not layers or self._keys[layers[0]].shape[-2] < hi:
            raise ValueError(f"positions up to {end} are not computed yet")
        return (tuple(self._keys[i][:, :, lo:hi].clone() for i in layers),
                tuple(self._values[i][:, :, lo:hi].clone() for i in layers))

    def truncate(self, length: int) -> None:
        """Keep positions [0, length) (a benchmark repeating one step; a rejected draft's
        entries); the cached prefix is never cut."""
        if length < self.reused:
            raise ValueError(f"cannot cut into the cached prefix ({self.reused} tokens)")
        own = length - self.reused
        for layer in self._keys:
            self._keys[layer] = self._keys[layer][:, :, :own]
            self._values[layer] = self._values[layer][:, :, :own]

    def get_seq_length(self, layer: int = 0) -> int:
        own = self._keys.get(layer)
        return self.reused + (0 if own is None else own.shape[-2])


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
