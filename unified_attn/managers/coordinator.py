"""Coordinators fan one request out to the managers of every group and find common hits."""

from __future__ import annotations

import math
from collections.abc import Sequence

from unified_attn.managers.base import SingleTypeKVCacheManager
from unified_attn.managers.block_pool import BlockPool, KVCacheBlock
from unified_attn.managers.eviction import EvictionPolicy, GroupLayout
from unified_attn.managers.hashing import hashes_at_block_size
from unified_attn.managers.scheduler_config import SchedulerKVCacheConfig
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

    def _hashes_for(
        self, manager: SingleTypeKVCacheManager, hashes: Sequence[bytes]
    ) -> Sequence[bytes]:
        if manager.block_size == self.hash_block_size:
            return hashes  # the common case, without a call
        return hashes_at_block_size(hashes, self.hash_block_size, manager.block_size)

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
        # Downward-closed groups are searched once and trimmed; the others may search again.
        self._trimmed = frozenset(
            g for g in self.hit_order if self.managers[g].hit_is_downward_closed
        )
        self._rechecked = [g for g in self.hit_order if g not in self._trimmed]
        self._no_search = [g for g in range(len(self.managers)) if g not in self.hit_order]
        self._no_hit: GroupBlocks = tuple([] for _ in self.managers)  # never mutated

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[GroupBlocks, int]:
        """Every group in `hit_order` searches at the current hit, which only shrinks, until
        each one has confirmed it.

        A search returns the longest valid hit up to the length it is given, so a group
        confirms the length its search returned (asked again it would return the same);
        downward-closed groups confirm every length up to theirs (their blocks are trimmed).
        In the common case (no group cuts below a later group's hit) that is one search per
        group, and a hit that reaches 0 ends the search at once.
        """
        if not self.hit_order:
            return self._no_hit, 0
        hit = max_length // self.alignment * self.alignment
        results: list[list[KVCacheBlock] | None] = [None] * len(self.managers)
        confirmed: list[int | None] = [None] * len(self.managers)  # each group's last result
        while hit > 0:
            for gid in self.hit_order:
                done = confirmed[gid]
                if done == hit or (done is not None and gid in self._trimmed):
                    continue
                manager = self.managers[gid]
                hashes = self._hashes_for(manager, block_hashes)
                results[gid], hit = manager.find_longest_cache_hit(hashes, hit, self.alignment)
                confirmed[gid] = hit
                if hit <= 0:
                    return self._no_hit, 0
            if all([confirmed[gid] == hit for gid in self._rechecked]):
                return self._hit_blocks(results, hit), hit
        return self._no_hit, 0

    def _hit_blocks(self, results: list[list[KVCacheBlock] | None], hit: int) -> GroupBlocks:
        """Each group's blocks of a `hit`-token hit, from the groups' last search results.

        Downward-closed groups are trimmed to the hit; the others confirmed exactly this hit,
        so their blocks already cover it. Groups that take no hits get an empty list.
        """
        for gid in self._no_search:
            results[gid] = []
        for gid in self._trimmed:
            blocks, block_size = results[gid], self.managers[gid].block_size
            if blocks is not None and len(blocks) * block_size > hit:
                results[gid] = blocks[: hit // block_size]
        return tuple(results)  # type: ignore[arg-type]  # every entry is a list now


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
