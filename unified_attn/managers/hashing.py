"""Chained block hashes for prefix caching.

A block's hash fingerprints the whole prefix up to the end of the block:
`sha256(parent_hash or ROOT, len, token_ids as int64 little-endian, extra_keys)`. sha256 over a
canonical byte encoding makes hashes reproducible across processes and machines.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, NewType

if TYPE_CHECKING:
    from unified_attn.request import Request

BlockHash = NewType("BlockHash", bytes)
# A block hash followed by the 4-byte big-endian group id: the key of the prefix cache.
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)

ROOT_HASH = BlockHash(hashlib.sha256(b"unified_attn/root-block-hash/v1").digest())
ExtraKeys = tuple[tuple[str, object], ...]


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    arr = array("q", token_ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
) -> BlockHash:
    """Hash one full block chained onto its parent's hash (None for the first block)."""
    h = hashlib.sha256(parent_hash or ROOT_HASH)
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(_token_bytes(token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return BlockHash(h.digest())


def block_extra_keys(request: Request, block_start: int) -> ExtraKeys | None:
    """Tagged extra keys of the block starting at token `block_start`.

    The adapter (LoRA) identity is on every block; the cache salt and the encoder input's
    digest (encoder-decoder models: the decoder's keys depend on it) on the first block only
    (the chain carries them onward). Tags keep a salt equal to an adapter name from colliding.
    """
    keys: list[tuple[str, object]] = []
    if request.lora_name is not None:
        keys.append(("adapter", request.lora_name))
    if block_start == 0 and request.cache_salt is not None:
        keys.append(("cache_salt", request.cache_salt))
    if block_start == 0 and request.encoder_token_ids:
        digest = hashlib.sha256(_token_bytes(request.encoder_token_ids)).hexdigest()
        keys.append(("encoder", digest))
    return tuple(keys) or None


def request_block_hasher(block_size: int):
    """A function `request -> new block hashes` that hashes the request's newly full blocks."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")

    def hash_new_full_blocks(request: Request) -> list[bytes]:
        tokens = request.all_token_ids
        start = len(request.block_hashes) * block_size
        if len(tokens) < start + block_size:
            return []  # no new full block (the common decode case)
        parent = request.block_hashes[-1] if request.block_hashes else None
        new_hashes: list[bytes] = []
        for begin in range(start, len(tokens) - block_size + 1, block_size):
            extra = block_extra_keys(request, begin)
            parent = hash_block_tokens(parent, tokens[begin : begin + block_size], extra)
            new_hashes.append(parent)
        return new_hashes

    return hash_new_full_blocks


def with_group_id(block_hash: bytes, group_id: int) -> BlockHashWithGroupId:
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big"))


def split_group_id(key: bytes) -> tuple[bytes, int]:
    """A cache key (`with_group_id`) back into the plain block hash and the group id."""
    return key[:-4], int.from_bytes(key[-4:], "big")


def hashes_at_block_size(
    hashes: Sequence[bytes], hash_block_size: int, block_size: int
) -> Sequence[bytes]:
    """Hashes of `block_size`-token blocks from hashes of `hash_block_size`-token blocks.

    Chaining makes the last fine hash inside a coarse block a fingerprint of the coarse block.
    Equal sizes return `hashes` itself (no copy: lookups only read it).
    """
    if block_size == hash_block_size:
        return hashes
    ratio = block_size // hash_block_size
    return hashes[ratio - 1 :: ratio]
