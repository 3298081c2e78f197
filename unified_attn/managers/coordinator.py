"""Coordinators fan one request out to the managers of every group and find common hits."""

from __future__ import annotations

import math
from collections.abc import Sequence

from unified_attn.managers.base import SingleTypeKVCacheManager
from unified_attn.managers.block_pool import BlockPool, KVCacheBlock
from unified_attn.managers.config import SchedulerKVCacheConfig
from unified_attn.managers.eviction import EvictionPolicy, GroupLayout
from unified_attn.managers.hashing import hashes_at_block_size
from unified_attn.request import Request

GroupBlocks = tuple[list[KVCacheBlock], ...]


class KVCacheCoordinator:
    """Instantiates whatever manager class each group names, over one shared block pool."""

    def __init__(
        self,
        config: SchedulerKVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int | None,
        enable_caching: bool,
        eviction: EvictionPolicy = "lru",
    ) -> None:
        sizes = [config.group_block_size(i) for i in range(len(config.groups))] or [
            config.block_size
        ]
        layouts = [
            GroupLayout(sizes[gid], getattr(group.manager_cls, "hit_needs_whole_prefix", False))
            for gid, group in enumerate(config.groups)
        ]
        self.block_pool = BlockPool(
            config.num_blocks, enable_caching, eviction=eviction, group_layouts=layouts
        )
        self.hash_block_size = math.gcd(*sizes)
        self.alignment = math.lcm(*sizes)
        self.managers: list[SingleTypeKVCacheManager] = [
            group.manager_cls(
                group.config,
                block_size=sizes[gid],
                block_pool=self.block_pool,
                group_id=gid,
                enable_caching=enable_caching,
                max_model_len=max_model_len,
                max_in_flight_tokens=max_in_flight_tokens,
                hash_block_size=self.hash_block_size,
            )
            for gid, group in enumerate(config.groups)
        ]
        for manager in self.managers:
            manager.cache_alignment = self.alignment
        self._freeing = [m for m in self.managers if m.frees_blocks_early]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[GroupBlocks, int]:
        return tuple([] for _ in self.managers), 0

    def _hashes_for(self, manager: SingleTypeKVCacheManager, hashes: Sequence[bytes]):
        return hashes_at_block_size(list(hashes), self.hash_block_size, manager.block_size)

    # ---- fan-out -------------------------------------------------------------------------------

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: GroupBlocks,
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
        num_encoder_tokens: int = 0,
    ) -> int:
        need = 0
        for m, hits in zip(self.managers, new_computed_blocks, strict=True):
            need += m.get_num_blocks_to_allocate(
                request_id,
                m.tokens_to_hold(num_tokens, num_encoder_tokens),
                hits,
                total_computed_tokens,
                apply_admission_cap,
            )
        return need

    def num_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        freeable = 0
        for m in self._freeing:
            freeable += m.num_freeable_skipped_blocks(request_id, num_computed_tokens)
        return freeable

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self._freeing:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def add_computed_blocks(
        self, request_id: str, new_computed_blocks: GroupBlocks, num_computed: int
    ) -> None:
        # Touch the hits of every group before any group allocates, so no allocation can evict
        # another group's hit.
        for m, hits in zip(self.managers, new_computed_blocks, strict=True):
            m.add_computed_blocks(request_id, hits, num_computed)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_encoder_tokens: int = 0
    ) -> GroupBlocks:
        return tuple(
            [
                m.allocate_new_blocks(request_id, m.tokens_to_hold(num_tokens, num_encoder_tokens))
                for m in self.managers
            ]
        )

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for m in self.managers:
            m.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        return tuple(m.get_blocks(request_id) for m in self.managers)

    def new_step_starts(self) -> None:
        for m in self.managers:
            m.new_step_starts()


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Caching off (or no groups): every lookup misses."""


class UnitaryCoordinator(KVCacheCoordinator):
    """Exactly one group: its own hit search, aligned to its block size."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[GroupBlocks, int]:
        manager = self.managers[0]
        if not manager.takes_prefix_hits:
            return ([],), 0
        hashes = self._hashes_for(manager, block_hashes)
        blocks, hit = manager.find_longest_cache_hit(hashes, max_length, manager.block_size)
        return (blocks,), hit


class HybridCoordinator(KVCacheCoordinator):
    """Several groups: the longest hit every group can serve, found as a fixed point."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Downward-closed (full attention) groups first: their left-to-right scan is a cheap
        # upper bound, later only trimmed.
        # Groups that take no hits (cross-attention) are left out: they start empty.
        self.hit_order = sorted(
            (g for g, m in enumerate(self.managers) if m.takes_prefix_hits),
            key=lambda g: not self.managers[g].hit_is_downward_closed,
        )

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[GroupBlocks, int]:
        hashes = [self._hashes_for(m, block_hashes) for m in self.managers]
        if not self.hit_order:
            return tuple([] for _ in self.managers), 0
        hit = max_length // self.alignment * self.alignment
        results: list[list[KVCacheBlock] | None] = [None] * len(self.managers)
        while True:
            before = hit
            for gid in self.hit_order:
                manager = self.managers[gid]
                if manager.hit_is_downward_closed and results[gid] is not None:
                    continue
                blocks, hit = manager.find_longest_cache_hit(hashes[gid], hit, self.alignment)
                results[gid] = blocks
            if hit == before:
                break
        return tuple(
            (blocks or [])[: hit // m.block_size]
            for m, blocks in zip(self.managers, results, strict=True)
        ), hit


def make_coordinator(
    config: SchedulerKVCacheConfig,
    max_model_len: int,
    max_in_flight_tokens: int | None,
    enable_caching: bool,
    eviction: EvictionPolicy = "lru",
) -> KVCacheCoordinator:
    if not enable_caching or not config.groups:
        cls: type[KVCacheCoordinator] = NoPrefixCacheCoordinator
    elif len(config.groups) == 1:
        cls = UnitaryCoordinator
    else:
        cls = HybridCoordinator
    return cls(config, max_model_len, max_in_flight_tokens, enable_caching, eviction)
