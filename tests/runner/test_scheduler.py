"""`Scheduler` over a real `KVCacheManager` (no model): FCFS admission under the sequence, token
and pool budgets, prefix hits, chunked prefill, preemption, stop conditions, aborts and chunk
alignment for state groups.

Pools are small (block size 4 unless said otherwise); block 0 is the null block, so fresh blocks
come from the free queue 1, 2, 3, ... in order. Requests use disjoint token ranges (100.., 200..,
300..) unless a test wants a shared prefix.
"""

import pytest

from tests.managers.helpers import FULL, make_request
from tests.runner.builders import add, make_scheduler, run_step, sample_all, summary
from unified_attn.managers import FullAttentionManager, StateManager
from unified_attn.request import RequestStatus
from unified_attn.runner.scheduler import Scheduler

STATE_ALIGN = (StateManager, StateManager.Config(mamba_cache_mode="align"))


def block_ids(output):
    return [s.block_ids for s in output.scheduled]


def num_free(scheduler):
    return scheduler.kv.block_pool.get_num_free_blocks()


# ---- admission ---------------------------------------------------------------------------------


def test_admits_waiting_requests_first_come_first_served():
    s = make_scheduler()
    a = add(s, "A", range(100, 105))
    b = add(s, "B", range(200, 203))
    c = add(s, "C", range(300, 306))
    out = s.schedule()
    assert summary(out) == [("A", 0, 5), ("B", 0, 3), ("C", 0, 6)]
    # cdiv(5, 4) = 2, cdiv(3, 4) = 1, cdiv(6, 4) = 2 blocks, taken in admission order
    assert block_ids(out) == [([1, 2],), ([3],), ([4, 5],)]
    assert all(e.is_new and e.will_sample for e in out.scheduled)
    assert out.num_tokens == 5 + 3 + 6
    assert out.preempted == [] and out.finished_ids == []
    assert s.running == [a, b, c] and not s.waiting
    assert [r.status for r in (a, b, c)] == [RequestStatus.RUNNING] * 3
    assert [r.num_computed_tokens for r in (a, b, c)] == [5, 3, 6]


def test_max_num_seqs_caps_the_running_requests():
    s = make_scheduler(max_num_seqs=2)
    a = add(s, "A", range(100, 103))
    b = add(s, "B", range(200, 203))
    c = add(s, "C", range(300, 303))
    out = s.schedule()
    assert summary(out) == [("A", 0, 3), ("B", 0, 3)]
    assert list(s.waiting) == [c] and c.status == RequestStatus.WAITING
    s.update_from_output(out, sample_all(out))
    assert summary(run_step(s)) == [("A", 3, 1), ("B", 3, 1)]  # C still waits: 2 running
    s.abort_request("A")
    # B: 3 prompt + 2 sampled = 5 tokens, 4 computed; C takes A's seat
    assert summary(s.schedule()) == [("B", 4, 1), ("C", 0, 3)]
    assert s.running == [b, c]
    assert a.status == RequestStatus.FINISHED_ABORTED


def test_token_budget_goes_to_running_requests_first_then_to_waiting_ones_in_order():
    s = make_scheduler(max_num_batched_tokens=10)
    add(s, "A", range(100, 104))
    add(s, "B", range(200, 208))
    c = add(s, "C", range(300, 309))
    out = s.schedule()
    assert summary(out) == [("A", 0, 4), ("B", 0, 6)]  # 4 + 6 = 10: nothing left for C
    assert [e.will_sample for e in out.scheduled] == [True, False]
    assert list(s.waiting) == [c]
    s.update_from_output(out, sample_all(out))
    # A decodes 1, B finishes its prompt with 8 - 6 = 2, C gets 10 - 1 - 2 = 7 of its 9
    assert summary(s.schedule()) == [("A", 4, 1), ("B", 6, 2), ("C", 0, 7)]


def test_a_request_that_does_not_fit_the_pool_waits_and_later_ones_wait_behind_it():
    s = make_scheduler(num_blocks=5)  # 4 usable blocks
    add(s, "A", range(100, 112))  # 3 blocks: [1, 2, 3]
    b = add(s, "B", range(200, 208))  # needs 2 blocks, 1 is free
    c = add(s, "C", range(300, 302))  # needs 1 block: it would fit, but FCFS keeps it behind B
    out = s.schedule()
    assert summary(out) == [("A", 0, 12)]
    assert list(s.waiting) == [b, c]
    assert b.status == c.status == RequestStatus.WAITING
    assert num_free(s) == 1
    s.abort_request("A")
    out = s.schedule()
    assert summary(out) == [("B", 0, 8), ("C", 0, 2)]
    # A's blocks 3, 2, 1 (all full, hashed) are appended after the free block 4: [4, 3, 2, 1]
    assert block_ids(out) == [([4, 3],), ([2],)]
    assert out.finished_ids == ["A"]


def test_a_prefix_hit_counts_as_computed_and_only_the_rest_is_scheduled():
    s = make_scheduler()
    add(s, "A", range(100, 110))  # blocks [1, 2, 3]; 1 and 2 are full and cached
    run_step(s)
    b = add(s, "B", [*range(100, 108), 50, 51, 52])  # shares A's first 8 tokens
    out = s.schedule()
    assert summary(out) == [("A", 10, 1), ("B", 8, 3)]  # 11 - 8 = 3 tokens left for B
    # B adopts A's blocks 1, 2 and gets the next free block for tokens 8..10
    assert out.scheduled[1].block_ids == ([1, 2, 4],)
    assert out.scheduled[1].is_new and out.scheduled[1].will_sample
    assert b.num_computed_tokens == 11


def test_a_fully_cached_prompt_still_recomputes_its_last_block():
    s = make_scheduler()
    add(s, "A", range(100, 108))  # blocks [1, 2], both cached
    run_step(s)
    add(s, "B", range(100, 108))  # the same 8 tokens
    out = s.schedule()
    # the hit is capped at 8 - 1 = 7 tokens, rounded down to whole blocks: 4
    assert summary(out) == [("A", 8, 1), ("B", 4, 4)]
    # A's 9th token opens block 3; B keeps block 1 and gets block 4
    assert block_ids(out) == [([3],), ([1, 4],)]


# ---- chunked prefill ---------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget():
    s = make_scheduler(max_num_batched_tokens=6)
    a = add(s, "A", range(100, 115))  # 15 tokens
    entries = []
    for _ in range(4):
        out = s.schedule()
        (e,) = out.scheduled
        done = a.num_computed_tokens
        entries.append(
            (e.num_computed_before, e.num_new_tokens, e.will_sample, e.is_new, e.block_ids, done)
        )
        s.update_from_output(out, sample_all(out, token=9))
    assert entries == [
        (0, 6, False, True, ([1, 2],), 6),  # cdiv(6, 4) = 2 blocks, the full table
        (6, 6, False, False, ([3],), 12),  # cdiv(12, 4) = 3: only the new block
        (12, 3, True, False, ([4],), 15),  # reaches the prompt's end: samples
        (15, 1, True, False, ([],), 16),  # 16 tokens still fit 4 blocks
    ]
    assert a.output_token_ids == [9, 9]


def test_a_chunk_that_does_not_reach_the_end_appends_no_token():
    s = make_scheduler(max_num_batched_tokens=6)
    a = add(s, "A", range(100, 115))
    out = s.schedule()
    assert s.update_from_output(out, {}) == []
    assert a.output_token_ids == [] and a.num_tokens == 15


# ---- preemption --------------------------------------------------------------------------------


def test_the_most_recently_added_running_request_is_preempted_first():
    s = make_scheduler(num_blocks=7)  # 6 usable blocks
    a = add(s, "A", range(100, 107))  # [1, 2]
    b = add(s, "B", range(200, 206))  # [3, 4]
    c = add(s, "C", range(300, 307))  # [5, 6]
    run_step(s)
    run_step(s)  # A 9 tokens, B 8, C 9
    d = add(s, "D", range(400, 402))
    out = s.schedule()
    # A's 9th token needs a third block and none is free: C, the newest, is preempted, not B.
    # C's blocks are full and hashed: freed tail first and appended, [6, 5]; A takes 6.
    assert summary(out) == [("A", 8, 1), ("B", 7, 1)]
    assert block_ids(out) == [([6],), ([],)]
    assert out.preempted == [c]
    assert out.finished_ids == ["C"]
    assert s.running == [a, b]
    # C goes to the front of the queue; D, though block 5 is free, is not admitted this step
    assert list(s.waiting) == [c, d]
    assert num_free(s) == 1
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert s.num_preemptions == 1
    assert s.kv.get_block_ids(c) == ([],)
    assert b.num_preemptions == 0


def test_the_newest_request_preempts_itself_when_it_cannot_grow():
    s = make_scheduler(num_blocks=5)  # 4 usable blocks
    a = add(s, "A", range(100, 106))  # [1, 2]
    b = add(s, "B", range(200, 208))  # [3, 4]
    run_step(s)  # A 7 tokens, B 9
    out = s.schedule()
    # A's 7th token fits its 2 blocks; B's 9th needs a third, none is free, B is the newest
    assert summary(out) == [("A", 6, 1)]
    assert out.preempted == [b] and out.finished_ids == ["B"]
    assert s.running == [a] and list(s.waiting) == [b]
    assert b.num_computed_tokens == 0 and b.status == RequestStatus.PREEMPTED
    assert num_free(s) == 2 and s.kv.get_block_ids(b) == ([],)


def test_nothing_is_admitted_in_a_step_that_preempted_even_when_it_would_fit():
    s = make_scheduler(num_blocks=5, max_num_batched_tokens=4)  # 4 usable blocks
    add(s, "A", range(100, 108))
    run_step(s)
    run_step(s)  # A: 8 prompt tokens in two chunks ([1], [2]), then samples: 9 tokens
    v = add(s, "V", [*range(100, 108), *range(200, 208)])  # A's 8 tokens + 8 more
    out = run_step(s)
    # A's 9th token takes block 3; V hits [1, 2] and gets 4 - 1 = 3 tokens: block 4
    assert summary(out) == [("A", 8, 1), ("V", 8, 3)]
    assert block_ids(out) == [([3],), ([1, 2, 4],)]
    out = s.schedule()
    # V's next 3 tokens (to 14) need a 4th block: none is free, V is the newest. Its block 4
    # goes back (1 and 2 stay with A), and V (hit 8 + 3 tokens = 1 new block) would fit again,
    # but a step that preempted admits nothing.
    assert summary(out) == [("A", 9, 1)]
    assert out.preempted == [v] and list(s.waiting) == [v]
    assert num_free(s) == 1
    s.update_from_output(out, sample_all(out))
    out = s.schedule()
    assert summary(out) == [("A", 10, 1), ("V", 8, 3)]
    assert block_ids(out) == [([],), ([1, 2, 4],)]


def test_a_preempted_request_resumes_from_its_own_cached_prefix():
    s = make_scheduler(num_blocks=6)  # 5 usable blocks
    add(s, "A", range(100, 108))  # [1, 2]
    b = add(s, "B", range(200, 210))  # [3, 4, 5]; 3 and 4 full and cached
    run_step(s)  # A 9 tokens, B 11
    out = s.schedule()
    # B is preempted; freed tail first: 5 (partial, unhashed) prepended, 4, 3 appended:
    # [5, 4, 3]; A takes 5 for its 9th token
    assert summary(out) == [("A", 8, 1)] and block_ids(out) == [([5],)]
    assert out.preempted == [b]
    s.abort_request("A")  # frees 5 (unhashed, prepended), then 2, 1 (appended): [5, 4, 3, 2, 1]
    out = s.schedule()
    # B has 11 tokens: its 2 cached blocks (8 tokens) hit, 3 are recomputed into block 5
    assert summary(out) == [("B", 8, 3)]
    assert block_ids(out) == [([3, 4, 5],)]
    assert out.scheduled[0].is_new and out.scheduled[0].will_sample
    assert out.finished_ids == ["A"]
    assert b.status == RequestStatus.RUNNING and b.num_preemptions == 1


# ---- stop conditions ---------------------------------------------------------------------------


def test_eos_finishes_the_request_frees_its_blocks_and_reports_it_next_step():
    s = make_scheduler(eos_token_ids=(99,))
    a = add(s, "A", range(100, 105))
    out = s.schedule()
    assert num_free(s) == 31 - 2
    assert s.update_from_output(out, {"A": 99}) == [a]
    assert a.status == RequestStatus.FINISHED_STOPPED and a.output_token_ids == [99]
    assert s.running == [] and not s.has_unfinished()
    assert num_free(s) == 31 and s.kv.get_block_ids(a) == ([],)
    assert out.finished_ids == []  # not in the output of the step that finished it
    assert s.schedule().finished_ids == ["A"]


def test_ignore_eos_keeps_the_request_running():
    s = make_scheduler(eos_token_ids=(99,))
    a = add(s, "A", range(100, 105), ignore_eos=True)
    out = s.schedule()
    assert s.update_from_output(out, {"A": 99}) == []
    assert a.status == RequestStatus.RUNNING and s.running == [a]
    assert a.output_token_ids == [99]


def test_a_stop_token_finishes_the_request():
    s = make_scheduler(eos_token_ids=(99,))
    a = add(s, "A", range(100, 105), stop_token_ids=[42])
    out = s.schedule()
    assert s.update_from_output(out, {"A": 41}) == []
    out = s.schedule()
    assert s.update_from_output(out, {"A": 42}) == [a]
    assert a.status == RequestStatus.FINISHED_STOPPED and a.output_token_ids == [41, 42]
    assert s.running == []


def test_max_tokens_finishes_the_request_with_length():
    s = make_scheduler()
    a = add(s, "A", range(100, 105), max_tokens=2)
    out = s.schedule()
    assert s.update_from_output(out, {"A": 5}) == []
    out = s.schedule()
    assert s.update_from_output(out, {"A": 6}) == [a]
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [5, 6]


def test_max_model_len_finishes_the_request_with_length():
    s = make_scheduler(max_model_len=8)
    a = add(s, "A", range(100, 106), max_tokens=16)
    out = s.schedule()
    assert s.update_from_output(out, {"A": 5}) == []  # 7 tokens < 8
    out = s.schedule()
    assert s.update_from_output(out, {"A": 6}) == [a]  # 8 tokens: no room for another
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_tokens == 8
    assert s.kv.get_block_ids(a) == ([],)


def test_a_stop_token_becomes_the_stop_reason_eos_does_not():
    s = make_scheduler(eos_token_ids=(99,))
    a = add(s, "A", range(100, 105), stop_token_ids=[42])
    b = add(s, "B", range(200, 205))
    out = s.schedule()
    assert s.update_from_output(out, {"A": 42, "B": 99}) == [a, b]
    assert (a.stop_reason, b.stop_reason) == (42, None)


def test_eos_or_a_stop_token_as_the_last_allowed_token_is_stop_not_length():
    """vLLM 0.33's `check_stop` tests EOS and stop tokens before the length caps."""
    s = make_scheduler(eos_token_ids=(99,), max_model_len=7)
    a = add(s, "A", range(100, 105), max_tokens=1)
    b = add(s, "B", range(200, 205), max_tokens=1, stop_token_ids=[42])
    c = add(s, "C", range(300, 306), max_tokens=8)  # its token reaches max_model_len
    out = s.schedule()
    assert s.update_from_output(out, {"A": 99, "B": 42, "C": 99}) == [a, b, c]
    assert [r.status for r in (a, b, c)] == [RequestStatus.FINISHED_STOPPED] * 3
    assert [r.stop_reason for r in (a, b, c)] == [None, 42, None]


def test_a_further_eos_id_stops_with_its_id_as_the_stop_reason():
    """vLLM adds a generation config's other EOS ids to the stop tokens."""
    s = make_scheduler(eos_token_ids=(99, 98))
    a = add(s, "A", range(100, 105))
    add(s, "B", range(200, 205), ignore_eos=True)
    out = s.schedule()
    assert s.update_from_output(out, {"A": 98, "B": 98}) == [a]
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == 98


def test_min_tokens_never_outlasts_the_length_caps():
    s = make_scheduler(max_model_len=8)
    a = add(s, "A", range(100, 106), max_tokens=None, min_tokens=50)
    for token in (5, 6):
        out = s.schedule()
        finished = s.update_from_output(out, {"A": token})
    assert finished == [a] and a.status == RequestStatus.FINISHED_LENGTH and a.num_tokens == 8


def test_max_tokens_none_runs_to_max_model_len():
    s = make_scheduler(max_model_len=12)
    a = add(s, "A", range(100, 104), max_tokens=None)
    steps = 0
    while s.has_unfinished():
        run_step(s)
        steps += 1
    assert (steps, a.num_output_tokens, a.status) == (8, 8, RequestStatus.FINISHED_LENGTH)


def test_finish_request_ends_a_running_request_with_the_given_status():
    s = make_scheduler()
    a = add(s, "A", range(100, 105))
    run_step(s)
    assert s.finish_request("A", RequestStatus.FINISHED_STOPPED) is a
    assert a.status == RequestStatus.FINISHED_STOPPED and not s.has_unfinished()
    assert num_free(s) == 31 and s.schedule().finished_ids == ["A"]
    assert s.finish_request("A", RequestStatus.FINISHED_STOPPED) is None  # gone: ignored
    with pytest.raises(ValueError, match=r"must be a finished one, got RequestStatus\.RUNNING"):
        s.finish_request("A", RequestStatus.RUNNING)


# ---- aborts and request ids --------------------------------------------------------------------


def test_abort_of_a_running_request_frees_its_blocks_and_reports_it_next_step():
    s = make_scheduler()
    a = add(s, "A", range(100, 105))
    b = add(s, "B", range(200, 203))
    run_step(s)
    assert s.abort_request("A") is a
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert s.running == [b]
    assert s.kv.get_block_ids(a) == ([],) and num_free(s) == 31 - 1  # B keeps its one block
    out = s.schedule()
    assert out.finished_ids == ["A"]
    assert summary(out) == [("B", 3, 1)]


def test_abort_of_a_waiting_request_removes_it_from_the_queue():
    s = make_scheduler(max_num_seqs=1)
    add(s, "A", range(100, 105))
    b = add(s, "B", range(200, 203))
    out = s.schedule()
    assert s.abort_request("B") is b
    assert b.status == RequestStatus.FINISHED_ABORTED and not s.waiting
    s.update_from_output(out, sample_all(out))
    out = s.schedule()
    assert out.finished_ids == ["B"]
    assert summary(out) == [("A", 5, 1)]


def test_abort_of_an_unknown_id_is_ignored():
    s = make_scheduler()
    a = add(s, "A", range(100, 105))
    assert s.abort_request("nope") is None
    out = s.schedule()
    assert out.finished_ids == [] and summary(out) == [("A", 0, 5)]
    s.abort_request("A")
    assert s.abort_request("A") is None  # already gone
    assert a.status == RequestStatus.FINISHED_ABORTED


def test_a_request_aborted_during_its_step_gets_no_token():
    s = make_scheduler()
    a = add(s, "A", range(100, 105))
    out = s.schedule()
    s.abort_request("A")
    assert s.update_from_output(out, {}) == []
    assert a.output_token_ids == [] and a.status == RequestStatus.FINISHED_ABORTED


def test_a_duplicate_request_id_is_refused_while_the_first_is_known():
    s = make_scheduler()
    a = add(s, "A", range(100, 105))
    with pytest.raises(ValueError, match="'A' is already in use"):
        s.add_request(make_request(s.kv, "A", range(200, 203)))
    assert list(s.waiting) == [a] and s.requests == {"A": a}
    s.schedule()
    s.abort_request("A")
    again = make_request(s.kv, "A", range(200, 203))
    s.add_request(again)  # the id is free once its request is gone
    assert list(s.waiting) == [again]


def test_budgets_must_be_positive():
    kv = make_scheduler().kv
    with pytest.raises(ValueError, match="must be positive"):
        Scheduler(kv, max_num_seqs=0, max_num_batched_tokens=8, max_model_len=64)
    with pytest.raises(ValueError, match="must be positive"):
        Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=0, max_model_len=64)


# ---- checkpoint alignment (state groups) -------------------------------------------------------


def chunks(scheduler, num_steps):
    out = []
    for _ in range(num_steps):
        step = scheduler.schedule()
        (entry,) = step.scheduled
        out.append((entry.num_computed_before, entry.num_new_tokens, entry.will_sample))
        scheduler.update_from_output(step, sample_all(step))
    return out


def test_without_a_state_group_or_without_caching_chunks_are_not_aligned():
    assert make_scheduler().checkpoint_alignment is None
    s = make_scheduler(groups=(FULL, STATE_ALIGN), max_num_batched_tokens=10, enable_caching=False)
    assert s.checkpoint_alignment is None
    add(s, "A", range(100, 115))
    assert chunks(s, 2) == [(0, 10, False), (10, 5, True)]


def test_with_a_state_group_chunks_end_on_the_last_block_boundary_they_cross():
    s = make_scheduler(groups=(FULL, STATE_ALIGN), max_num_batched_tokens=10)
    assert s.checkpoint_alignment == 4
    add(s, "A", range(100, 123))  # 23 tokens
    assert chunks(s, 4) == [
        (0, 8, False),  # 0 + 10 = 10 -> the boundary 8
        (8, 8, False),  # 8 + 10 = 18 -> 16
        (16, 4, False),  # the prompt's end 23 is within budget, but the chunk stops at 20
        (20, 3, True),  # 20..23 crosses no boundary
    ]


def test_the_alignment_is_the_lcm_of_the_group_block_sizes():
    groups = ((FullAttentionManager, FullAttentionManager.Config(), 4), (*STATE_ALIGN, 6))
    s = make_scheduler(groups=groups, max_num_batched_tokens=16)
    assert s.checkpoint_alignment == 12  # lcm(4, 6)
    add(s, "A", range(100, 130))  # 30 tokens
    # 0 + 16 -> 12; 12 + 16 = 28 -> 24; 24 + 6 = 30 crosses no multiple of 12
    assert chunks(s, 3) == [(0, 12, False), (12, 12, False), (24, 6, True)]


def test_an_aligned_chunk_leaves_a_checkpoint_that_a_later_request_hits():
    s = make_scheduler(groups=(FULL, STATE_ALIGN))
    add(s, "A", range(100, 110))
    assert chunks(s, 2) == [(0, 8, False), (8, 2, True)]  # stops at 8: a state checkpoint
    add(s, "B", [*range(100, 108), 50, 51, 52, 53])  # shares A's first 8 tokens
    out = s.schedule()
    # both groups hit 8 tokens (blocks of A's prefix and the checkpoint after 8)
    assert summary(out) == [("A", 10, 1), ("B", 8, 4)]
