"""State (Mamba / linear attention) manager in modes "none" and "align"."""

import pytest

from tests.managers.helpers import admit, make_manager, make_request, step
from unified_attn.managers import FullAttentionManager, StateManager


def state_group(mode="none", spec=0):
    return (StateManager, StateManager.Config(mamba_cache_mode=mode, num_speculative_blocks=spec))


def test_none_mode_holds_one_state_block_plus_speculative_ones():
    m = make_manager(num_blocks=10, block_size=4, groups=[state_group("none", spec=2)])
    a = make_request(m, "A", range(30))
    admit(m, a)
    assert m.get_block_ids(a) == ([1, 2, 3],)
    for tok in range(10):
        a.append_output_token_ids(tok)
        step(m, a)
    assert m.get_block_ids(a) == ([1, 2, 3],)
    assert m.take_new_block_ids() == [1, 2, 3]  # zeroed before first use
    assert m.max_blocks_per_request() == [3]


def test_none_mode_never_hits():
    m = make_manager(num_blocks=10, block_size=4, groups=[state_group("none")])
    a = make_request(m, "A", range(12))
    admit(m, a)
    m.free(a)
    assert m.get_computed_blocks(make_request(m, "B", range(12)))[1] == 0


def test_align_mode_places_the_state_at_the_last_position_and_frees_the_old_one():
    m = make_manager(num_blocks=10, block_size=4, groups=[state_group("align")])
    a = make_request(m, "A", range(10))
    admit(m, a, num_new=8)  # chunk ends on a boundary: a checkpoint
    assert m.get_block_ids(a) == ([0, 1],)
    assert m.block_pool.blocks[1].block_hash is not None
    step(m, a, 2)  # reads the state in block 1, writes it to a new block at position 2
    assert m.get_block_ids(a) == ([0, 1, 2],)
    a.append_output_token_ids(10)
    step(m, a)  # 10 settled: the state of position 1 is no longer needed
    assert m.get_block_ids(a) == ([0, 0, 2],)
    assert m.block_pool.blocks[1].ref_cnt == 0


def test_align_hit_is_the_rightmost_checkpoint():
    m = make_manager(num_blocks=10, block_size=4, groups=[state_group("align")])
    a = make_request(m, "A", range(13))
    admit(m, a, num_new=4)
    step(m, a, 4)
    step(m, a, 5)  # ends at 13: no checkpoint at 12
    m.new_step_starts()
    m.free(a)
    b = make_request(m, "B", [*range(13), 99])
    hits, hit = m.get_computed_blocks(b)
    assert hit == 8
    assert hits.get_block_ids() == ([0, 2],)


def test_a_checkpoint_written_this_step_is_not_hit_until_the_next_step():
    m = make_manager(num_blocks=10, block_size=4, groups=[state_group("align")])
    a = make_request(m, "A", range(9))
    admit(m, a, num_new=8)
    b = make_request(m, "B", range(9))
    hits, hit = m.get_computed_blocks(b)
    assert hit == 8
    assert m.allocate_slots(b, 1, hit, hits) is None
    m.new_step_starts()
    assert m.allocate_slots(b, 1, hit, hits) is not None


def test_hybrid_attention_hit_is_limited_by_the_state_checkpoint():
    groups = [(FullAttentionManager, FullAttentionManager.Config()), state_group("align")]
    m = make_manager(num_blocks=20, block_size=4, groups=groups)
    a = make_request(m, "A", range(17))
    admit(m, a, num_new=8)
    step(m, a, 9)  # full attention caches 4 blocks, the state only the checkpoint at 8
    m.new_step_starts()
    m.free(a)
    b = make_request(m, "B", range(17))
    hits, hit = m.get_computed_blocks(b)
    assert hit == 8
    assert [len(g) for g in hits.blocks] == [2, 2]


def test_unknown_mode_and_align_with_speculative_blocks_are_rejected():
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        StateManager.Config(mamba_cache_mode="some")
    for mode in ("align", "all"):
        with pytest.raises(ValueError, match="num_speculative_blocks"):
            StateManager.Config(mamba_cache_mode=mode, num_speculative_blocks=1)
    with pytest.raises(ValueError, match="num_speculative_blocks"):
        StateManager.Config(num_speculative_blocks=-1)


def test_vllm_name_is_the_same_manager():
    from unified_attn.managers import MambaManager

    assert MambaManager is StateManager
    assert MambaManager.Config(mamba_cache_mode="align") == StateManager.Config("align")
