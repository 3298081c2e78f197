"""Hypothesis state machines for window-aware eviction.

* `WindowAwareMachine`: the scheduler-and-runner machine of
  `test_kv_cache_manager_state_machine.py` over a manager with `eviction="window_aware"` (every
  invariant there keeps holding), plus a check of every "dead" verdict against a brute-force
  oracle: no lookup, for any prefix of any request seen so far, can hit the block's key at the
  moment it is evicted as dead.
* `LockstepMachine`: the same steps fed to a second, LRU manager: block ids, hits and refusals
  are identical until the first block is evicted as dead ("LRU order otherwise").
"""

from __future__ import annotations

from hypothesis import event

from tests.managers.helpers import machine_test_case
from tests.managers.test_kv_cache_manager_state_machine import (
    SCENARIOS,
    KVCacheManagerMachine,
    Scenario,
    full,
    sliding,
)
from unified_attn.managers import KVCacheBlocks, KVCacheManager, SchedulerKVCacheConfig
from unified_attn.managers.eviction import DeadBlockFinder
from unified_attn.managers.free_queue import KVCacheBlock
from unified_attn.managers.hashing import split_group_id

# A small pool: more evictions, so more blocks die.
SMALL_HYBRID = Scenario("small_hybrid_full_sliding", (full(), sliding(4)), 16, 2, 20, 4)


def window_aware_manager(sc: Scenario) -> KVCacheManager:
    config = SchedulerKVCacheConfig(sc.num_blocks, sc.block_size, sc.groups)
    return KVCacheManager(
        config, sc.max_model_len, max_in_flight_tokens=sc.max_chunk, eviction="window_aware"
    )


class WindowAwareMachine(KVCacheManagerMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = window_aware_manager(self.SCENARIO)
        self.pool = self.mgr.block_pool
        finder = self.pool.dead_blocks
        assert isinstance(finder, DeadBlockFinder)
        verdict = finder.is_dead

        def checked_is_dead(block: KVCacheBlock) -> bool:
            dead = verdict(block)
            if dead:
                self.check_unhittable(block.block_hash)
                event("window-aware: a block was evicted as dead")
            return dead

        finder.is_dead = checked_is_dead  # type: ignore[method-assign]

    def check_unhittable(self, key: bytes) -> None:
        """No lookup of any prefix (of a request seen so far) that contains the block's tokens
        returns a block cached under `key` now."""
        block_hash, group = split_group_id(key)
        tokens = self.hash_prefix[block_hash]
        hash_of = {prefix: h for h, prefix in self.hash_prefix.items()}
        hbs = self.mgr.hash_block_size
        for prefix in self.hash_prefix.values():
            length = len(prefix)
            if length < len(tokens) or prefix[: len(tokens)] != tokens or length % self.alignment:
                continue
            hashes = [hash_of[prefix[:end]] for end in range(hbs, length + 1, hbs)]
            blocks, hit = self.mgr.coordinator.find_longest_cache_hit(hashes, length)
            assert not (hit == length and any(b.block_hash == key for b in blocks[group])), (
                f"group {group}: a block cached for {tokens} was evicted as dead, but a lookup "
                f"of {length} tokens hits it"
            )


class Lockstep:
    """Forwards the machine's manager calls to a window-aware manager and an LRU twin, and
    checks that they answer alike until the window-aware one evicts a dead block."""

    def __init__(self, sc: Scenario) -> None:
        self.wa = window_aware_manager(sc)
        config = SchedulerKVCacheConfig(sc.num_blocks, sc.block_size, sc.groups)
        self.lru: KVCacheManager | None = KVCacheManager(
            config, sc.max_model_len, max_in_flight_tokens=sc.max_chunk
        )
        self.lru_hits: dict[str, KVCacheBlocks] = {}

    def __getattr__(self, name: str):
        return getattr(self.wa, name)  # queries: the window-aware manager answers

    def same(self, name: str, wa_result, lru_result) -> None:
        finder = self.wa.block_pool.dead_blocks
        assert finder is not None
        if finder.num_dead_evicted:
            event("lockstep: diverged after a dead eviction")
            self.lru = None  # from here on the orders may differ
            return
        assert wa_result == lru_result, f"{name}: window-aware {wa_result}, LRU {lru_result}"

    def get_computed_blocks(self, request):
        hits, hit = self.wa.get_computed_blocks(request)
        if self.lru is not None:
            lru_hits, lru_hit = self.lru.get_computed_blocks(request)
            self.lru_hits[request.request_id] = lru_hits
            self.same(
                "get_computed_blocks",
                (hits.get_block_ids(), hit),
                (lru_hits.get_block_ids(), lru_hit),
            )
        return hits, hit

    def allocate_slots(self, request, num_new, num_new_computed_tokens=0, new_computed_blocks=None):
        new = self.wa.allocate_slots(request, num_new, num_new_computed_tokens, new_computed_blocks)
        if self.lru is not None:
            hits = self.lru_hits.pop(request.request_id, None) if new_computed_blocks else None
            lru_new = self.lru.allocate_slots(request, num_new, num_new_computed_tokens, hits)
            ids = None if new is None else new.get_block_ids()
            self.same("allocate_slots", ids, None if lru_new is None else lru_new.get_block_ids())
        return new

    def free(self, request) -> None:
        self.wa.free(request)
        if self.lru is not None:
            self.lru.free(request)
            self.same("free", self.free_queue(self.wa), self.free_queue(self.lru))

    def evict_blocks(self, block_ids) -> None:
        self.wa.evict_blocks(block_ids)
        if self.lru is not None:
            self.lru.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        done = self.wa.reset_prefix_cache()
        if self.lru is not None:
            self.same("reset_prefix_cache", done, self.lru.reset_prefix_cache())
        return done

    def new_step_starts(self) -> None:
        self.wa.new_step_starts()
        if self.lru is not None:
            self.lru.new_step_starts()

    def take_new_block_ids(self) -> list[int]:
        ids = self.wa.take_new_block_ids()
        if self.lru is not None:
            self.same("take_new_block_ids", ids, self.lru.take_new_block_ids())
        return ids

    @staticmethod
    def free_queue(manager: KVCacheManager) -> list[int]:
        return [b.block_id for b in manager.block_pool.free_block_queue]


class LockstepMachine(KVCacheManagerMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = Lockstep(self.SCENARIO)  # type: ignore[assignment]
        self.pool = self.mgr.wa.block_pool


def make(machine: type[KVCacheManagerMachine], scenario: Scenario, examples: int):
    return machine_test_case(machine, scenario, max_examples=examples, steps=50)


TestWindowAwareFullOnly = make(WindowAwareMachine, SCENARIOS["full"], 100)
TestWindowAwareHybridFullSliding = make(WindowAwareMachine, SCENARIOS["hybrid_full_sliding"], 150)
TestWindowAwareSmallHybrid = make(WindowAwareMachine, SMALL_HYBRID, 150)
TestWindowAwareHybridFullMamba = make(WindowAwareMachine, SCENARIOS["hybrid_full_state"], 100)
TestWindowAwareHybridMixedBlockSizes = make(
    WindowAwareMachine, SCENARIOS["hybrid_mixed_block_sizes"], 100
)
TestWindowAwareSlidingOnly = make(WindowAwareMachine, SCENARIOS["sliding"], 50)
TestLockstepFullOnly = make(LockstepMachine, SCENARIOS["full"], 100)
TestLockstepHybridFullSliding = make(LockstepMachine, SCENARIOS["hybrid_full_sliding"], 100)
TestLockstepSmallHybrid = make(LockstepMachine, SMALL_HYBRID, 100)
