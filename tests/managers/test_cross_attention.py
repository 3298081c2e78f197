"""CrossAttentionManager: a request's encoder blocks are allocated in full at admission, kept
unchanged while it decodes, never prefix-cached, freed at the end; decoder prefix hits are
keyed on the encoder input."""

from __future__ import annotations

import pytest

from tests.managers.helpers import FULL, admit, free_ids, make_manager, make_request, step
from unified_attn.managers import CrossAttentionManager

CROSS = (CrossAttentionManager, CrossAttentionManager.Config(max_encoder_len=40))
ENCODER = list(range(100, 137))  # 37 tokens: 10 blocks of 4


def make(num_blocks=40, **kwargs):
    return make_manager(num_blocks, 4, (FULL, CROSS), max_model_len=32, **kwargs)


def test_encoder_blocks_are_allocated_at_admission_and_kept():
    manager = make()
    request = make_request(manager, "a", [1, 2, 3, 4, 5, 6], encoder_token_ids=ENCODER)
    admit(manager, request)
    decoder, cross = manager.get_block_ids(request)
    assert len(decoder) == 2 and len(cross) == 10
    for _ in range(5):  # decoding adds decoder blocks only
        request.append_output_token_ids(7)
        step(manager, request)
    assert manager.get_block_ids(request)[1] == cross
    assert len(manager.get_block_ids(request)[0]) == 3
    assert manager.max_blocks_per_request() == [8, 10]


def test_cross_blocks_are_never_cached_and_are_freed():
    manager = make()
    request = make_request(manager, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9], encoder_token_ids=ENCODER)
    admit(manager, request)
    cross = manager.get_block_ids(request)[1]
    assert all(manager.block_pool.blocks[b].block_hash is None for b in cross)
    decoder = manager.get_block_ids(request)[0]
    assert manager.block_pool.blocks[decoder[0]].block_hash is not None
    manager.free(request)
    assert set(cross) <= set(free_ids(manager))
    assert manager.usage == 0


def test_decoder_prefix_hits_need_the_same_encoder_input():
    manager = make()
    tokens = list(range(1, 10))
    first = make_request(manager, "a", tokens, encoder_token_ids=ENCODER)
    admit(manager, first)
    manager.free(first)
    other = make_request(manager, "b", tokens, encoder_token_ids=ENCODER[:-1])
    assert manager.get_computed_blocks(other)[1] == 0
    same = make_request(manager, "c", tokens, encoder_token_ids=ENCODER)
    hits, num_hit, _ = admit(manager, same)
    assert num_hit == 8 and len(hits.blocks[0]) == 2 and hits.blocks[1] == []
    assert len(manager.get_block_ids(same)[1]) == 10  # fresh encoder blocks


def test_a_refused_admission_changes_nothing():
    manager = make(num_blocks=12)  # 11 usable: 2 decoder + 10 encoder blocks do not fit
    request = make_request(manager, "a", [1, 2, 3, 4, 5, 6], encoder_token_ids=ENCODER)
    before = free_ids(manager)
    assert admit(manager, request)[2] is None
    assert free_ids(manager) == before
    assert manager.get_block_ids(request) == ([], [])


@pytest.mark.parametrize("caching", [True, False])
def test_decoder_only_requests_hold_no_cross_blocks(caching):
    manager = make(enable_caching=caching)
    request = make_request(manager, "a", [1, 2, 3])
    admit(manager, request)
    assert manager.get_block_ids(request)[1] == []
