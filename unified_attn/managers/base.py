"""`SingleTypeKVCacheManager`: the block table of every request in one KV-cache group.

A manager owns policy only: which blocks a request needs, which it may free early, and which
cached blocks make a valid prefix hit. Subclasses declare a frozen `Config` with their policy
fields; `block_size` and the pool are chosen by the worker and passed to the constructor.

Block tables are positional and append-only: entry i covers tokens `[i*bs, (i+1)*bs)`. Positions
a policy no longer needs are replaced in place by the null block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import attrs

from unified_attn.managers.block_pool import BlockPool, KVCacheBlock
from unified_attn.managers.hashing import hashes_at_block_size
from unified_attn.request import Request
from unified_attn.utils import cdiv


class SingleTypeKVCacheManager(ABC):
    """Allocation policy of one KV-cache group over the shared `BlockPool`.

    One instance per group, built by the coordinator from the `(manager_cls, config)` a
    backend declared. It keeps each request's block table (positional, append-only: position
    j holds tokens `[j * block_size, (j + 1) * block_size)`, the null block where the policy
    freed a block) and answers prefix-hit queries. A custom policy subclasses it (or a manager
    close to it), declares a frozen `Config`, and overrides the hooks
    `get_num_skipped_tokens`, `first_freeable_block`, `max_blocks_per_request` and
    `find_longest_cache_hit` (docs/custom-managers.md).
    """

    @attrs.frozen
    class Config:
        """Allocation-policy fields only (never block size or block counts)."""

    # Full attention's left-to-right hit is downward closed: the hybrid coordinator queries it
    # first as an upper bound and afterwards only trims it.
    hit_is_downward_closed: ClassVar[bool] = False
    # Whether a hit of L tokens needs every one of the group's blocks before L (full
    # attention): window-aware eviction then treats its cached blocks as chains (a block whose
    # parent is gone is dead) and as backing the other groups' blocks that end where its do.
    hit_needs_whole_prefix: ClassVar[bool] = False
    # Zero newly allocated blocks before use (state is read before it is fully written).
    needs_zeroed_blocks: ClassVar[bool] = False
    # Whether the policy frees blocks before the request ends (skips work for full attention).
    frees_blocks_early: ClassVar[bool] = True
    # Whether a block can only be cached when a step ends exactly on its boundary (states).
    caches_only_at_step_ends: ClassVar[bool] = False
    # Whether the group constrains prefix hits; False (cross-attention) leaves it out of the
    # hit search: a request starts with no hit blocks in it.
    takes_prefix_hits: ClassVar[bool] = True

    def __init__(
        self,
        config: Config,
        *,
        block_size: int,
        block_pool: BlockPool,
        group_id: int,
        enable_caching: bool,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        hash_block_size: int | None = None,
    ) -> None:
        if not isinstance(config, type(self).Config):
            raise TypeError(
                f"{type(self).__name__} needs a {type(self).__name__}.Config, "
                f"got {type(config).__name__}"
            )
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.config = config
        self.block_size = block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.max_in_flight_tokens = max_in_flight_tokens or max_model_len
        self.hash_block_size = hash_block_size or block_size
        if block_size % self.hash_block_size:
            raise ValueError(
                f"group {group_id}: block_size {block_size} is not a multiple of the hash block "
                f"size {self.hash_block_size}"
            )
        # Cached lengths are rounded down to this (the LCM of all group block sizes): blocks
        # past the last common boundary can never be hit. The coordinator sets it.
        self.cache_alignment = block_size
        self.null_block = block_pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Blocks of a running request already cached (or skipped); marks "allocated once".
        self.num_cached_block: dict[str, int] = {}
        self.new_block_ids: list[int] = []
        # Run statistics: blocks recycled before their request ended, blocks adopted from hits.
        self.num_blocks_freed_early = 0
        self.num_hit_blocks = 0

    # ---- policy hooks ------------------------------------------------------------------------

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens the next token will never attend to (their blocks may be freed)."""
        return 0

    def tokens_to_hold(self, num_tokens: int, num_encoder_tokens: int) -> int:
        """Tokens this group keeps for a request holding `num_tokens` decoder tokens and
        `num_encoder_tokens` encoder tokens (cross-attention keeps the encoder's)."""
        return num_tokens

    def first_freeable_block(self) -> int:
        """Blocks before this index are kept for the whole request (attention sinks)."""
        return 0

    @abstractmethod
    def max_blocks_per_request(self) -> int:
        """Worst-case live blocks of one request: the admission cap and the sizing rule."""

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int, alignment: int
    ) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix hit of at most `max_length` tokens, a multiple of `alignment`.

        `block_hashes` are at this manager's block size. Returns the hit blocks (null blocks at
        positions the policy does not need) and the hit length in tokens. Whether a length is
        a valid hit must not depend on `max_length`: asked again with the returned length, the
        search returns that length and the same blocks (the hybrid coordinator relies on it).
        """

    # ---- allocation ----------------------------------------------------------------------------

    def block_hashes(self, request: Request) -> Sequence[bytes]:
        return hashes_at_block_size(request.block_hashes, self.hash_block_size, self.block_size)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Free-pool blocks needed to hold `num_tokens`, counting revived free hit blocks."""
        required = cdiv(num_tokens, self.block_size)
        if apply_admission_cap:
            required = min(required, self.max_blocks_per_request())
        req_blocks = self.req_to_blocks.get(request_id, ())
        if request_id in self.num_cached_block:
            return required - len(req_blocks) if required > len(req_blocks) else 0
        # Hit blocks cover their positions; a new request's skipped positions are all inside
        # its hit, so they need no allocation either.
        num_new = max(required - len(new_computed_blocks) - len(req_blocks), 0)
        kept = self._kept_hit_blocks(new_computed_blocks, total_computed_tokens)
        evictable = sum(1 for b in kept if b.ref_cnt == 0 and not b.is_null)
        return num_new + evictable

    def _kept_hit_blocks(
        self, new_computed_blocks: Sequence[KVCacheBlock], num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """Hit blocks the request keeps (those in the skipped range are not touched)."""
        start = self.first_freeable_block()
        end = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        if end <= start:
            return list(new_computed_blocks)
        return [*new_computed_blocks[:start], *new_computed_blocks[end:]]

    def add_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], num_computed: int
    ) -> None:
        """Adopt prefix-hit blocks for a request that has none yet (first allocation only)."""
        if request_id in self.num_cached_block:
            return
        assert not self.req_to_blocks.get(request_id), "hits are adopted before any allocation"
        start = self.first_freeable_block()
        end = self.get_num_skipped_tokens(num_computed) // self.block_size
        blocks = list(new_computed_blocks)
        for i in range(max(start, 0), min(end, len(blocks))):
            blocks[i] = self.null_block
        self.block_pool.touch(blocks)
        self.num_hit_blocks += sum(1 for b in blocks if not b.is_null)
        self.req_to_blocks[request_id] = blocks
        self.num_cached_block[request_id] = len(blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Append fresh blocks so the table covers `num_tokens`; returns the new blocks."""
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
            self.num_cached_block[request_id] = 0
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        self._record_new(new_blocks)
        return new_blocks

    def _record_new(self, blocks: Sequence[KVCacheBlock]) -> None:
        if self.needs_zeroed_blocks:
            self.new_block_ids.extend(b.block_id for b in blocks)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's blocks that became full with `num_tokens` computed tokens."""
        num_cached = self.num_cached_block.get(request.request_id)
        if num_cached is None or num_tokens // self.block_size <= num_cached:
            return
        hashes = self.block_hashes(request)
        num_tokens = num_tokens // self.cache_alignment * self.cache_alignment
        num_full = min(num_tokens // self.block_size, len(hashes))
        if num_full <= num_cached:
            return
        blocks = self.req_to_blocks[request.request_id]
        self.block_pool.cache_full_blocks(
            blocks,
            hashes,
            num_cached,
            num_full,
            self.group_id,
            token_ids=request.all_token_ids,
            block_size=self.block_size,
        )
        self.num_cached_block[request.request_id] = num_full

    # ---- freeing -----------------------------------------------------------------------------

    def num_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks `remove_skipped_blocks` would return to the free queue (for admission)."""
        if not self.frees_blocks_early:
            return 0
        blocks = self.req_to_blocks.get(request_id, [])
        positions = self._skipped_positions(blocks, num_computed_tokens)
        return sum(1 for i in positions if blocks[i].ref_cnt == 1)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace blocks no future token attends to by the null block and free them."""
        if not self.frees_blocks_early:
            return
        blocks = self.req_to_blocks.get(request_id, [])
        freed = []
        for i in self._skipped_positions(blocks, num_computed_tokens):
            freed.append(blocks[i])
            blocks[i] = self.null_block
        if freed:
            self.num_blocks_freed_early += len(freed)
            self.block_pool.free_blocks(freed)

    def _skipped_positions(self, blocks: list[KVCacheBlock], num_computed_tokens: int) -> range:
        """Positions to free, last first, stopping at the first null (freed by an earlier step)."""
        start = self.first_freeable_block()
        end = min(self.get_num_skipped_tokens(num_computed_tokens) // self.block_size, len(blocks))
        if end <= start or blocks[end - 1].is_null:
            return range(0)  # nothing new to free (the common decode case)
        i = end - 1
        while i >= start and not blocks[i].is_null:
            i -= 1
        return range(end - 1, i, -1)

    def free(self, request_id: str) -> None:
        """Free every block of the request, tail first. Unknown requests are a no-op."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def take_new_block_ids(self) -> list[int]:
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    def new_step_starts(self) -> None:
        """Called once per scheduler step before any allocation."""
