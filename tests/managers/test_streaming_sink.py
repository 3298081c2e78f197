"""The StreamingLLM custom manager: keep sink blocks and the window, free the middle."""

import pytest

from tests.managers.helpers import admit, make_manager, make_request, step
from unified_attn.managers import StreamingSinkManager


def sink(num_sink_tokens=2, window=4):
    return (StreamingSinkManager, StreamingSinkManager.Config(num_sink_tokens, window))


def test_keeps_sink_blocks_and_frees_the_middle():
    m = make_manager(num_blocks=20, block_size=2, groups=[sink(2, 4)], max_model_len=64)
    a = make_request(m, "A", range(10))
    admit(m, a)
    a.append_output_token_ids(10)
    step(m, a)  # 10 settled: tokens [0, 7) are out of the window, block 0 holds the sinks
    assert m.get_block_ids(a)[0] == [1, 0, 0, 4, 5, 6]
    for tok in range(11, 20):
        a.append_output_token_ids(tok)
        step(m, a)
    live = [b for b in m.get_blocks(a).blocks[0] if not b.is_null]
    assert live[0].block_id == 1 and len(live) <= m.max_blocks_per_request()[0]


def test_hit_needs_the_sinks_and_the_window_run():
    m = make_manager(num_blocks=30, block_size=2, groups=[sink(2, 4)], max_model_len=64)
    a = make_request(m, "A", range(16))
    admit(m, a)
    m.free(a)
    b = make_request(m, "B", [*range(16), 99])
    hits, hit = m.get_computed_blocks(b)
    assert hit == 16
    ids = hits.get_block_ids()[0]
    assert ids[0] != 0 and ids[1:6] == [0] * 5 and 0 not in ids[6:]
    m.evict_blocks([ids[0]])  # without its sinks the only valid hit is none
    assert m.get_computed_blocks(make_request(m, "C", [*range(16), 99]))[1] == 0


def test_admission_cap_counts_the_sink_blocks():
    m = make_manager(
        num_blocks=30,
        block_size=2,
        groups=[sink(3, 4)],
        max_model_len=64,
        max_in_flight_tokens=4,
    )
    assert m.max_blocks_per_request() == [2 + 5]


def test_sink_tokens_must_be_non_negative():
    with pytest.raises(ValueError, match="num_sink_tokens"):
        StreamingSinkManager.Config(num_sink_tokens=-1, sliding_window=4)
