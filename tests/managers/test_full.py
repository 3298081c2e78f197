"""Full attention: the 11-block example, hit direction and cap, caching as blocks fill."""

from tests.managers.helpers import admit, free_ids, make_manager, make_request, step


def test_eleven_block_example_exact_ids_and_free_order():
    m = make_manager(num_blocks=11, block_size=16)
    a = make_request(m, "A", range(55))
    _, hit, new = admit(m, a)
    assert hit == 0 and new.get_block_ids() == ([1, 2, 3, 4],)
    b = make_request(m, "B", [*range(48), 900, 901, 902, 903, 904])
    hits, hit, new = admit(m, b)
    assert hit == 48 and hits.get_block_ids() == ([1, 2, 3],)
    assert new.get_block_ids() == ([5],)
    assert m.get_block_ids(b) == ([1, 2, 3, 5],)
    m.free(a)
    m.free(b)
    assert free_ids(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]


def test_hit_is_capped_at_num_tokens_minus_one():
    m = make_manager(block_size=4)
    a = make_request(m, "A", range(12))
    admit(m, a)
    again = make_request(m, "B", range(12))
    hits, hit = m.get_computed_blocks(again)
    assert hit == 8 and len(hits.blocks[0]) == 2  # the last block is recomputed for logits
    longer = make_request(m, "C", range(13))
    assert m.get_computed_blocks(longer)[1] == 12


def test_hit_search_stops_at_the_first_miss():
    m = make_manager(block_size=4)
    a = make_request(m, "A", range(17))
    admit(m, a)
    m.free(a)
    m.evict_blocks([2])  # the second block of A
    b = make_request(m, "B", range(17))
    hits, hit = m.get_computed_blocks(b)
    assert hit == 4 and hits.get_block_ids() == ([1],)


def test_generated_tokens_are_cached_as_blocks_fill():
    m = make_manager(block_size=4)
    a = make_request(m, "A", range(6))
    admit(m, a)
    a.append_output_token_ids(100)
    step(m, a)
    assert m.block_pool.num_cached_blocks() == 1  # 7 tokens computed
    a.append_output_token_ids(101)
    step(m, a)
    assert m.block_pool.num_cached_blocks() == 2  # 8 computed: the second block is full
    b = make_request(m, "B", [*range(6), 100, 101, 102])
    assert m.get_computed_blocks(b)[1] == 8


def test_full_attention_never_frees_before_the_end():
    m = make_manager(num_blocks=20, block_size=2, max_model_len=64)
    a = make_request(m, "A", range(10))
    admit(m, a)
    for tok in range(20):
        a.append_output_token_ids(tok)
        step(m, a)
    assert all(not b.is_null for b in m.get_blocks(a).blocks[0])
    assert len(m.get_blocks(a).blocks[0]) == 15
