"""Coordinators: hybrid hits as a fixed point, alignment to the LCM, custom managers."""

import attrs

from tests.managers.helpers import FULL, admit, make_manager, make_request
from unified_attn.managers import (
    FullAttentionManager,
    KVCacheGroup,
    SlidingWindowManager,
    StateManager,
)
from unified_attn.managers.coordinator import (
    HybridCoordinator,
    NoPrefixCacheCoordinator,
    UnitaryCoordinator,
)

SWA8 = (SlidingWindowManager, SlidingWindowManager.Config(sliding_window=8))


def test_coordinator_kind_follows_groups_and_caching():
    assert isinstance(make_manager().coordinator, UnitaryCoordinator)
    assert isinstance(make_manager(groups=[FULL, SWA8]).coordinator, HybridCoordinator)
    assert isinstance(make_manager(enable_caching=False).coordinator, NoPrefixCacheCoordinator)
    assert isinstance(make_manager(groups=[]).coordinator, NoPrefixCacheCoordinator)


def test_hybrid_hit_shrinks_to_a_length_every_group_can_serve():
    m = make_manager(num_blocks=30, block_size=4, groups=[FULL, SWA8], max_model_len=64)
    a = make_request(m, "A", range(24))
    admit(m, a)
    swa_blocks = m.get_block_ids(a)[1]
    m.free(a)
    m.evict_blocks([swa_blocks[4]])  # the window group lost tokens [16, 20)
    b = make_request(m, "B", [*range(24), 7])
    hits, hit = m.get_computed_blocks(b)
    assert hit == 16
    assert len(hits.blocks[0]) == 4  # full attention trimmed to the common length
    assert hits.get_block_ids()[1][2:] == swa_blocks[2:4]


def test_same_content_in_two_groups_is_two_cache_entries():
    m = make_manager(num_blocks=30, block_size=4, groups=[FULL, SWA8], max_model_len=64)
    a = make_request(m, "A", range(9))
    admit(m, a)
    assert m.block_pool.num_cached_blocks() == 4  # 2 full blocks x 2 groups


def test_hit_is_aligned_to_the_lcm_of_group_block_sizes():
    groups = [FULL, KVCacheGroup(*SWA8, block_size=8)]
    m = make_manager(num_blocks=40, block_size=4, groups=groups, max_model_len=64)
    assert m.hash_block_size == 4 and m.coordinator.alignment == 8
    a = make_request(m, "A", range(20))
    admit(m, a)
    m.free(a)
    hits, hit = m.get_computed_blocks(make_request(m, "B", range(21)))
    assert hit == 16  # full attention alone could serve 20
    assert [len(g) for g in hits.blocks] == [4, 2]


def test_cached_length_is_rounded_down_to_the_lcm():
    groups = [FULL, KVCacheGroup(*SWA8, block_size=8)]
    m = make_manager(num_blocks=40, block_size=4, groups=groups, max_model_len=64)
    a = make_request(m, "A", range(13))
    admit(m, a)
    full_blocks = m.get_blocks(a).blocks[0]
    assert [b.block_hash is not None for b in full_blocks] == [True, True, False, False]


def test_a_state_group_without_caching_blocks_every_hit():
    groups = [FULL, (StateManager, StateManager.Config(mamba_cache_mode="none"))]
    m = make_manager(num_blocks=30, block_size=4, groups=groups)
    a = make_request(m, "A", range(20))
    admit(m, a)
    m.free(a)
    assert m.get_computed_blocks(make_request(m, "B", range(21)))[1] == 0


class KeepFirstBlockManager(FullAttentionManager):
    """A model author's policy: full attention that only ever hits the first `n` blocks."""

    @attrs.frozen
    class Config(FullAttentionManager.Config):
        max_hit_blocks: int = 1

    def find_longest_cache_hit(self, block_hashes, max_length, alignment):
        limit = min(max_length, self.config.max_hit_blocks * self.block_size)
        return super().find_longest_cache_hit(block_hashes, limit, alignment)


def test_custom_manager_gets_its_own_group_without_any_registry():
    custom = (KeepFirstBlockManager, KeepFirstBlockManager.Config(max_hit_blocks=2))
    m = make_manager(num_blocks=30, block_size=4, groups=[FULL, custom])
    assert type(m.managers[1]) is KeepFirstBlockManager
    a = make_request(m, "A", range(20))
    admit(m, a)
    m.free(a)
    assert m.get_computed_blocks(make_request(m, "B", range(21)))[1] == 8
