"""Chunked local attention: skipped tokens, freeing per chunk, hits inside the current chunk."""

import pytest

from tests.managers.helpers import admit, make_manager, make_request, step
from unified_attn.managers import ChunkedLocalAttentionManager
from unified_attn.managers.block_pool import BlockPool


def chunked(chunk):
    return (ChunkedLocalAttentionManager, ChunkedLocalAttentionManager.Config(chunk))


def direct_manager(chunk=8, block_size=4):
    pool = BlockPool(20)
    manager = ChunkedLocalAttentionManager(
        ChunkedLocalAttentionManager.Config(attention_chunk_size=chunk),
        block_size=block_size,
        block_pool=pool,
        group_id=0,
        enable_caching=True,
        max_model_len=64,
    )
    return pool, manager


def test_skipped_tokens():
    _, m = direct_manager(chunk=8)
    assert [m.get_num_skipped_tokens(n) for n in (7, 8, 13, 16)] == [0, 8, 8, 16]


@pytest.mark.parametrize("block_three_cached, expected", [(True, 12), (False, 8)])
def test_hit_inside_the_current_chunk(block_three_cached, expected):
    pool, m = direct_manager(chunk=8, block_size=4)
    hashes = [bytes([i + 1]) * 32 for i in range(4)]
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, hashes, 0, 4, group_id=0)
    if not block_three_cached:
        pool.evict_blocks([blocks[2].block_id])
    hit_blocks, hit = m.find_longest_cache_hit(hashes, 15, alignment=4)
    assert hit == expected
    assert hit_blocks[:2] == [pool.null_block, pool.null_block]
    assert hit_blocks[2:] == ([blocks[2]] if block_three_cached else [])
    four_nulls, hit16 = m.find_longest_cache_hit(hashes, 16, alignment=4)
    assert hit16 == 16 and four_nulls == [pool.null_block] * 4


def test_blocks_of_finished_chunks_are_freed():
    m = make_manager(num_blocks=12, block_size=4, groups=[chunked(8)], max_model_len=64)
    a = make_request(m, "A", range(8))
    admit(m, a)
    a.append_output_token_ids(8)
    step(m, a)  # 8 settled tokens: chunk 0 is finished
    assert m.get_block_ids(a) == ([0, 0, 3],)
    for tok in range(9, 17):
        a.append_output_token_ids(tok)
        step(m, a)
    assert m.get_block_ids(a)[0][:4] == [0, 0, 0, 0]


def test_chunk_must_be_positive():
    with pytest.raises(ValueError, match="attention_chunk_size"):
        ChunkedLocalAttentionManager.Config(attention_chunk_size=0)


def test_chunk_not_a_multiple_of_the_block_size_never_hits_into_a_null_block():
    # chunk 3, block 2: block 1 holds token 2 (chunk 0) and token 3 (chunk 1).
    pool, m = direct_manager(chunk=3, block_size=2)
    hashes = [bytes([i + 1]) * 32 for i in range(2)]
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hashes, 0, 2, group_id=0)
    pool.evict_blocks([blocks[1].block_id])
    # A hit of 2 would recompute token 2, which needs tokens 0 and 1 (block 0 is not kept).
    assert m.find_longest_cache_hit(hashes, 3, alignment=2) == ([blocks[0]], 2)
    pool.evict_blocks([blocks[0].block_id])
    assert m.find_longest_cache_hit(hashes, 3, alignment=2) == ([], 0)
    pool.cache_full_blocks(blocks, hashes, 1, 2, group_id=0)  # only block 1 cached
    assert m.find_longest_cache_hit(hashes, 4, alignment=2) == ([pool.null_block, blocks[1]], 4)
