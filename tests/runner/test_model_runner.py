"""`ModelRunner` host work without a model: persistent `BlockTables`, `prepare_inputs` for a
mixed batch over two KV-cache groups of different block sizes, dropping finished rows, and
`backend_group_ids`.

The mixed batch is scheduled by a real `Scheduler` over a pool of 32 blocks shared by two
full-attention groups, group 0 with blocks of 4 tokens and group 1 with blocks of 8. Every block
id below is worked out by hand from the free queue (1, 2, 3, ... in order, group 0 allocating
before group 1 within a request).
"""

import pytest
import torch

from tests.runner.builders import add, make_scheduler, sample_all, summary
from unified_attn.backend import LayerConfig
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.managers import FullAttentionManager
from unified_attn.runner.model_runner import ModelRunner, backend_group_ids
from unified_attn.runner.scheduler import SchedulerOutput
from unified_attn.runner.step_inputs import BlockTables
from unified_attn.runner.worker import GroupPlan, KVCachePlan, plan_kv_cache

FULL_CONFIG = FullAttentionManager.Config()
MAX_MODEL_LEN = 32


# ---- BlockTables -------------------------------------------------------------------------------


def test_block_tables_are_int32_with_room_for_max_model_len_plus_one_block():
    tables = BlockTables([4, 8], max_num_seqs=3, max_model_len=16)
    # widths: cdiv(16, 4) + 1 = 5 and cdiv(16, 8) + 1 = 3
    assert [tuple(t.shape) for t in tables.tables] == [(3, 5), (3, 3)]
    assert all(t.dtype == torch.int32 for t in tables.tables)


def test_new_requests_get_rows_in_order_and_their_full_tables():
    tables = BlockTables([4, 8], max_num_seqs=3, max_model_len=16)
    assert tables.update("a", ([1, 2], [3]), is_new=True) == 0
    assert tables.update("b", ([4], [5]), is_new=True) == 1
    assert tables.rows == {"a": 0, "b": 1}
    assert tables.tables[0].tolist() == [[1, 2, 0, 0, 0], [4, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert tables.tables[1].tolist() == [[3, 0, 0], [5, 0, 0], [0, 0, 0]]


def test_a_running_request_writes_only_its_new_block_ids():
    tables = BlockTables([4, 8], max_num_seqs=2, max_model_len=16)
    tables.update("a", ([1, 2], [3]), is_new=True)
    tables.tables[0][0, 0] = 99  # a marker: an incremental update must not rewrite position 0
    assert tables.update("a", ([6], []), is_new=False) == 0
    assert tables.tables[0][0].tolist() == [99, 2, 6, 0, 0]  # appended after the 2 known ids
    assert tables.tables[1][0].tolist() == [3, 0, 0]  # no new ids: untouched
    tables.update("a", ([7], [8]), is_new=False)
    assert tables.tables[0][0].tolist() == [99, 2, 6, 7, 0]
    assert tables.tables[1][0].tolist() == [3, 8, 0]


def test_a_dropped_row_is_reused_and_the_new_request_starts_at_position_zero():
    tables = BlockTables([4], max_num_seqs=2, max_model_len=16)
    tables.update("a", ([1, 2, 3],), is_new=True)
    tables.update("b", ([4],), is_new=True)
    tables.drop("a")
    tables.drop("unknown")  # a no-op
    assert tables.rows == {"b": 1}
    assert tables.update("c", ([5],), is_new=True) == 0
    # a's stale ids after c's one id stay (kernels never read past a request's length)
    assert tables.tables[0][0].tolist() == [5, 2, 3, 0, 0]
    tables.update("c", ([6],), is_new=False)
    assert tables.tables[0][0].tolist() == [5, 6, 3, 0, 0]


def test_a_restarting_request_rewrites_its_table_from_position_zero():
    tables = BlockTables([4], max_num_seqs=3, max_model_len=16)
    tables.update("a", ([1, 2, 3],), is_new=True)
    tables.update("b", ([4],), is_new=True)
    # after a preemption the scheduler sends the full table again, with is_new
    assert tables.update("a", ([7, 8],), is_new=True) == 0
    assert tables.tables[0][0].tolist() == [7, 8, 3, 0, 0]
    tables.update("a", ([9],), is_new=False)
    assert tables.tables[0][0].tolist() == [7, 8, 9, 0, 0]
    assert tables.rows == {"a": 0, "b": 1}


# ---- prepare_inputs on a mixed batch -----------------------------------------------------------


def two_size_plan() -> KVCachePlan:
    groups = (
        GroupPlan(FullAttentionManager, FULL_CONFIG, (), 4),
        GroupPlan(FullAttentionManager, FULL_CONFIG, (), 8),
    )
    return KVCachePlan(4, groups)


def make_runner(max_num_seqs=4):
    return ModelRunner(
        None, two_size_plan(), device="cpu", max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN
    )


def mixed_batch():
    """Step 1: A (10 tokens) whole, B (12 tokens) its first 6. Step 2: A decodes its sampled
    token, B its last 6 prompt tokens, C (20 tokens, A's first 8 in front) hits 8 tokens and
    gets 16 - 1 - 6 = 9 tokens of budget. Returns step 2's output and inputs."""
    groups = ((FullAttentionManager, FULL_CONFIG, 4), (FullAttentionManager, FULL_CONFIG, 8))
    s = make_scheduler(
        32, 4, groups, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=16
    )
    runner = make_runner()
    add(s, "A", range(100, 110))
    add(s, "B", range(200, 212))
    first = s.schedule()
    runner.prepare_inputs(first)
    s.update_from_output(first, sample_all(first, token=50))
    add(s, "C", [*range(100, 108), *range(300, 312)])
    second = s.schedule()
    return first, second, runner.prepare_inputs(second)


def test_mixed_batch_schedule():
    first, second, _ = mixed_batch()
    assert summary(first) == [("A", 0, 10), ("B", 0, 6)]
    # A: cdiv(10, 4) = 3 and cdiv(10, 8) = 2 blocks; B: cdiv(6, 4) = 2 and cdiv(6, 8) = 1
    assert [e.block_ids for e in first.scheduled] == [([1, 2, 3], [4, 5]), ([6, 7], [8])]
    assert summary(second) == [("A", 10, 1), ("B", 6, 6), ("C", 8, 9)]
    # A: 11 tokens fit its blocks. B: 12 tokens need one more block per group.
    # C: hits A's cached [1, 2] and [4] (8 tokens, a multiple of lcm(4, 8)), then 17 tokens
    # need cdiv(17, 4) - 2 = 3 and cdiv(17, 8) - 1 = 2 new blocks.
    assert [e.block_ids for e in second.scheduled] == [
        ([], []),
        ([9], [10]),
        ([1, 2, 11, 12, 13], [4, 14, 15]),
    ]
    assert [e.is_new for e in second.scheduled] == [False, False, True]


def test_mixed_batch_packs_token_ids_and_positions_request_after_request():
    _, _, inputs = mixed_batch()
    # A: its sampled token 50 at position 10; B: prompt tokens 6..11; C: tokens 8..16
    assert inputs.input_ids.tolist() == [50, *range(206, 212), *range(300, 309)]
    assert inputs.input_ids.dtype == torch.int64
    assert inputs.common.positions.tolist() == [10, *range(6, 12), *range(8, 17)]
    assert inputs.common.positions.dtype == torch.int64


def test_mixed_batch_lengths_metadata():
    _, _, inputs = mixed_batch()
    common = inputs.common
    # query lengths 1, 6, 9
    assert common.query_start_loc_cpu.tolist() == [0, 1, 7, 16]
    assert common.query_start_loc.tolist() == [0, 1, 7, 16]
    assert common.query_start_loc_cpu.dtype == torch.int32
    assert common.query_lens_cpu.tolist() == [1, 6, 9]
    # seq lens = computed + new: 10 + 1, 6 + 6, 8 + 9
    assert common.seq_lens_cpu.tolist() == [11, 12, 17]
    assert common.seq_lens.tolist() == [11, 12, 17]
    assert common.seq_lens_cpu.dtype == torch.int32
    assert common.num_computed_tokens_cpu.tolist() == [10, 6, 8]
    assert common.num_computed_tokens_cpu.dtype == torch.int32
    assert (common.num_reqs, common.num_actual_tokens) == (3, 16)
    assert (common.max_query_len, common.max_seq_len) == (9, 17)
    assert common.block_sizes == {0: 4, 1: 8}


def test_mixed_batch_slot_mappings_are_block_id_times_block_size_plus_offset():
    _, _, inputs = mixed_batch()
    slots = inputs.common.slot_mappings
    assert sorted(slots) == [0, 1]
    # group 0 (block size 4). A pos 10: block 2 of [1, 2, 3] = 3, offset 2 -> 14.
    # B pos 6..11 over [6, 7, 9]: 7*4+2, 7*4+3, then 9*4+0..3.
    # C pos 8..16 over [1, 2, 11, 12, 13]: 11*4+0..3, 12*4+0..3, 13*4+0.
    assert slots[0].tolist() == [14, 30, 31, 36, 37, 38, 39, *range(44, 53)]
    # group 1 (block size 8). A pos 10: block 1 of [4, 5] = 5, offset 2 -> 42.
    # B pos 6..11 over [8, 10]: 8*8+6, 8*8+7, then 10*8+0..3.
    # C pos 8..16 over [4, 14, 15]: 14*8+0..7, then 15*8+0.
    assert slots[1].tolist() == [42, 70, 71, 80, 81, 82, 83, *range(112, 120), 120]
    assert all(s.dtype == torch.int64 for s in slots.values())


def test_mixed_batch_block_tables_hold_each_requests_row():
    _, _, inputs = mixed_batch()
    tables = inputs.block_tables
    # rows in batch order A, B, C; widths cdiv(32, 4) + 1 = 9 and cdiv(32, 8) + 1 = 5
    assert tables[0].tolist() == [
        [1, 2, 3, 0, 0, 0, 0, 0, 0],
        [6, 7, 9, 0, 0, 0, 0, 0, 0],
        [1, 2, 11, 12, 13, 0, 0, 0, 0],
    ]
    assert tables[1].tolist() == [[4, 5, 0, 0, 0], [8, 10, 0, 0, 0], [4, 14, 15, 0, 0]]
    assert all(t.dtype == torch.int32 for t in tables.values())


def test_mixed_batch_samples_the_last_token_of_requests_that_reach_their_end():
    _, _, inputs = mixed_batch()
    # A's only token (row 0) and B's last (row 6); C stops at 17 of its 20 tokens
    assert inputs.sample_rows == [0, 6]


def test_step_inputs_are_copies_that_later_steps_do_not_change():
    runner = make_runner()
    s = make_scheduler(
        32,
        4,
        ((FullAttentionManager, FULL_CONFIG, 4), (FullAttentionManager, FULL_CONFIG, 8)),
        max_model_len=MAX_MODEL_LEN,
    )
    add(s, "A", range(100, 104))
    first = s.schedule()
    inputs = runner.prepare_inputs(first)
    s.update_from_output(first, sample_all(first))
    # step 1 gave A block 1 (group 0) and block 2 (group 1); its 5th token adds block 3
    runner.prepare_inputs(s.schedule())
    assert runner.block_tables.tables[0][0, :2].tolist() == [1, 3]
    assert inputs.block_tables[0].tolist() == [[1, 0, 0, 0, 0, 0, 0, 0, 0]]


def test_block_table_rows_and_slots_follow_the_batch_order_when_rows_are_reused():
    runner = make_runner(max_num_seqs=2)
    groups = ((FullAttentionManager, FULL_CONFIG, 4), (FullAttentionManager, FULL_CONFIG, 8))
    s = make_scheduler(32, 4, groups, max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
    add(s, "X", range(100, 104))  # row 0, blocks [1] and [2]
    add(s, "A", range(200, 204))  # row 1, blocks [3] and [4]
    first = s.schedule()
    runner.prepare_inputs(first)
    s.update_from_output(first, sample_all(first, token=50))
    # X's blocks are not cached (4 tokens < lcm(4, 8)), so freeing them prepends group 0's
    # block 1, then group 1's block 2: the free queue starts [2, 1, 5, 6, ...]
    s.abort_request("X")
    runner.execute(SchedulerOutput([], [], ["X"]))  # drops row 0
    add(s, "B", range(300, 302))
    second = s.schedule()
    assert summary(second) == [("A", 4, 1), ("B", 0, 2)]
    inputs = runner.prepare_inputs(second)
    assert runner.block_tables.rows == {"A": 1, "B": 0}
    # A's 5th token opens block 2 in group 0; B takes block 1 (group 0) and 5 (group 1)
    assert inputs.block_tables[0][:, :3].tolist() == [[3, 2, 0], [1, 0, 0]]
    assert inputs.block_tables[1][:, :2].tolist() == [[4, 0], [5, 0]]
    # A pos 4: 2*4+0; B pos 0, 1: 1*4+0, 1*4+1. Group 1: 4*8+4; 5*8+0, 5*8+1.
    assert inputs.common.slot_mappings[0].tolist() == [8, 4, 5]
    assert inputs.common.slot_mappings[1].tolist() == [36, 40, 41]


def test_execute_drops_the_rows_of_finished_and_preempted_requests():
    runner = make_runner(max_num_seqs=2)
    runner.block_tables.update("A", ([1], [2]), is_new=True)
    runner.block_tables.update("B", ([3], [4]), is_new=True)
    runner.sampler.generators["A"] = torch.Generator()
    runner.sampler.generators["B"] = torch.Generator()
    s = make_scheduler()
    preempted = add(s, "B", range(200, 203))
    result = runner.execute(SchedulerOutput([], [preempted], ["A", "B"]))
    assert result.sampled == {}
    assert runner.block_tables.rows == {}
    # a preempted request keeps its seeded random stream for when it resumes
    assert list(runner.sampler.generators) == ["B"]


# ---- backend_group_ids -------------------------------------------------------------------------


def backend(window=None):
    return ReferenceAttentionBackend(
        num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=window
    )


def layer(i, window=None):
    return LayerConfig(f"layers.{i}", 4, 2, 8, scale=1.0, sliding_window=window)


def test_backend_group_ids_lists_distinct_instances_in_group_order():
    full_a, full_b, swa = backend(), backend(), backend(window=8)
    layers = [
        (layer(0), full_a),
        (layer(1, 8), swa),
        (layer(2), full_b),  # another instance with full_a's config: same group
        (layer(3, 8), swa),
        (layer(4, 8), swa),
        (layer(5, 8), swa),
    ]
    plan = plan_kv_cache(layers)
    # groups: 0 = full [0, 2]; the 4 window layers split into 1 = [1, 3] and 2 = [4, 5]
    assert [[lp.layer.name[-1] for lp in g.layers] for g in plan.groups] == [
        ["0", "2"],
        ["1", "3"],
        ["4", "5"],
    ]
    found = backend_group_ids(plan)
    # first seen in group order (full_b in group 0 before swa in group 1), each group once
    assert all(b is want for (b, _), want in zip(found, [full_a, full_b, swa], strict=True))
    assert [gids for _, gids in found] == [[0], [0], [1, 2]]


def test_backend_group_ids_of_a_model_without_kv_cache_is_empty():
    assert backend_group_ids(KVCachePlan(16, ())) == []


@pytest.fixture(scope="module")
def tiny_hybrid():
    from unified_attn import LLMEngine

    return LLMEngine("tiny-hybrid", kv_cache_memory="4MiB", max_model_len=256)


def test_backend_group_ids_on_the_tiny_hybrid_model(tiny_hybrid):
    # layers: 0 full, 1 and 3 sliding 32 (one instance), 2 chunked 64. Buckets full [0],
    # window [1, 3], chunked [2]; groups have the smallest bucket's size, 1: the window bucket
    # splits, so groups are 0 = [0], 1 = [1], 2 = [3], 3 = [2].
    backends = [b for _, b in tiny_hybrid.model.attention_layers()]
    full, window, chunked = backends[0], backends[1], backends[2]
    assert backends[3] is window
    found = tiny_hybrid.runner.backend_groups
    assert len(found) == 3
    assert all(b is want for (b, _), want in zip(found, [full, window, chunked], strict=True))
    assert [gids for _, gids in found] == [[0], [1, 2], [3]]
    assert tiny_hybrid.runner.block_sizes == [16, 16, 16, 16]
