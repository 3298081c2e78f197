"""KV-cache events: what entered and left the prefix cache, with vLLM's semantics.

A consumer (a KV-aware router, a cache index) replays them in order into a mirror
`{(block_hash, group_id): number of cached blocks}` that then equals the pool's cached set:
`BlockStored` adds one per hash, `BlockRemoved` takes one away, `AllBlocksCleared` empties it.

Hashes are the plain block hashes (`hashing.hash_block_tokens`, 32 bytes), not the pool's
`hash + group id` keys: a router computes the plain chained hash from a prompt's tokens and keys
on it, and vLLM publishes the plain hash too. The group travels beside it as `group_id`, so
`(block_hash, group_id)` is the pool's key (KV_CACHE_RULES.md rule 9).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class BlockStored:
    """Blocks of one request in one group that became cached, in sequence order.

    `token_ids` are the tokens they cover (`len(token_ids) == len(block_hashes) * block_size`,
    empty for blocks imported without their tokens); `parent_block_hash` is the hash of the
    block just before the first one (None at the start of the sequence), so the hashes chain
    `parent -> block_hashes[0] -> block_hashes[1] -> ...`.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    group_id: int


@attrs.frozen
class BlockRemoved:
    """Cached blocks that lost their hash: evicted on reuse, or by `evict_blocks`."""

    block_hashes: list[bytes]
    group_id: int


@attrs.frozen
class AllBlocksCleared:
    """`reset_prefix_cache` forgot every cached block."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
