"""KV-cache events: their contents, and a Hypothesis state machine per group layout that replays
the event stream into a mirror `{(hash, group): cached blocks}` and checks after every operation
that it equals the pool's cached set (what a KV-aware router relies on)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.managers.helpers import (
    FULL,
    admit,
    machine_test_case,
    make_manager,
    make_request,
    step,
)
from unified_attn.managers import (
    ChunkedLocalAttentionManager,
    KVCacheGroup,
    KVCacheManager,
    SchedulerKVCacheConfig,
    SlidingWindowManager,
    StateManager,
    StreamingSinkManager,
)
from unified_attn.managers.block_pool import BlockPool
from unified_attn.managers.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from unified_attn.managers.hashing import hash_block_tokens, hashes_at_block_size
from unified_attn.request import Request

SLIDING = (SlidingWindowManager, SlidingWindowManager.Config(4))


def cached_set(pool: BlockPool) -> Counter[tuple[bytes, int]]:
    """What the pool caches: (plain hash, group) -> number of blocks."""
    keys = (b.block_hash for b in pool.blocks if b.block_hash is not None)
    return Counter((key[:-4], int.from_bytes(key[-4:], "big")) for key in keys)


def replay(mirror: Counter[tuple[bytes, int]], events: list[KVCacheEvent]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            mirror.update((h, event.group_id) for h in event.block_hashes)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                assert mirror[(h, event.group_id)] > 0, "removed a block the mirror never saw"
                mirror[(h, event.group_id)] -= 1
        else:
            assert isinstance(event, AllBlocksCleared)
            mirror.clear()


def check_chain(event: BlockStored, hash_block_size: int) -> None:
    """The hashes chain from the parent over the event's own tokens."""
    bs = event.block_size
    assert len(event.token_ids) == len(event.block_hashes) * bs
    parent = event.parent_block_hash
    for k, block_hash in enumerate(event.block_hashes):
        for j in range(k * bs, (k + 1) * bs, hash_block_size):
            parent = hash_block_tokens(parent, event.token_ids[j : j + hash_block_size])
        assert parent == block_hash, f"block {k} of {event} does not chain"


# ---- event contents ----------------------------------------------------------------------------


def test_events_are_off_by_default():
    m = make_manager(block_size=4)
    admit(m, make_request(m, "A", range(10)))
    assert m.take_events() == [] and m.block_pool.kv_event_queue == []


def test_block_stored_carries_hashes_parent_tokens_and_block_size():
    m = make_manager(block_size=4)
    m.enable_kv_cache_events()
    tokens = list(range(100, 110))
    a = make_request(m, "A", tokens)
    admit(m, a)
    h = a.block_hashes
    assert m.take_events() == [BlockStored(h[:2], None, tokens[:8], 4, 0)]
    assert all(len(x) == 32 for x in h)  # plain sha256 hashes, no group id
    a.append_output_token_ids([110, 111])
    step(m, a, 2)
    assert m.take_events() == [BlockStored([h[2]], h[1], [*tokens[8:], 110, 111], 4, 0)]
    assert m.take_events() == []


def test_a_prefix_hit_stores_only_the_new_blocks_chained_to_the_hit():
    m = make_manager(block_size=4)
    m.enable_kv_cache_events()
    admit(m, make_request(m, "A", range(8)))
    m.take_events()
    b = make_request(m, "B", [*range(8), 50, 51, 52, 53, 54])
    _, hit, _ = admit(m, b)
    assert hit == 8
    (event,) = m.take_events()
    assert event == BlockStored([b.block_hashes[2]], b.block_hashes[1], [50, 51, 52, 53], 4, 0)


def test_eviction_on_reuse_and_evict_blocks_emit_block_removed():
    m = make_manager(num_blocks=4, block_size=4)  # three usable blocks
    m.enable_kv_cache_events()
    a = make_request(m, "A", range(11))
    admit(m, a)
    m.free(a)  # 1 and 2 cached, 3 (the partial tail) not: the free queue is [3, 2, 1]
    m.take_events()
    m.evict_blocks([2, 3])  # 3 holds no hash: no event
    assert m.take_events() == [BlockRemoved([a.block_hashes[1]], 0)]
    admit(m, make_request(m, "B", range(200, 209)))  # pops 3, 2, then 1 (evicted)
    events = m.take_events()
    assert events[0] == BlockRemoved([a.block_hashes[0]], 0)
    assert isinstance(events[1], BlockStored)


def test_reset_prefix_cache_emits_all_blocks_cleared_only_when_it_succeeds():
    m = make_manager(block_size=4)
    m.enable_kv_cache_events()
    a = make_request(m, "A", range(9))
    admit(m, a)
    m.take_events()
    assert not m.reset_prefix_cache()
    assert m.take_events() == []
    m.free(a)
    assert m.reset_prefix_cache()
    assert m.take_events() == [AllBlocksCleared()]


def test_hybrid_groups_store_the_same_plain_hash_under_their_own_group_id():
    m = make_manager(num_blocks=20, block_size=2, groups=(FULL, SLIDING))
    m.enable_kv_cache_events()
    a = make_request(m, "A", range(5))
    admit(m, a)
    h = a.block_hashes
    assert m.take_events() == [
        BlockStored(h[:2], None, [0, 1, 2, 3], 2, 0),
        BlockStored(h[:2], None, [0, 1, 2, 3], 2, 1),
    ]


def test_a_coarser_group_reports_its_own_block_hashes_and_tokens():
    groups = (KVCacheGroup(*FULL, 4), KVCacheGroup(*SLIDING, 2))
    m = make_manager(num_blocks=20, block_size=2, groups=groups)
    m.enable_kv_cache_events()
    a = make_request(m, "A", range(9))
    admit(m, a)
    coarse = hashes_at_block_size(a.block_hashes, 2, 4)
    stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert stored[0] == BlockStored(coarse, None, list(range(8)), 4, 0)
    for event in stored:
        check_chain(event, m.hash_block_size)


def test_skipped_positions_split_the_event_into_contiguous_runs():
    pool = BlockPool(8, enable_kv_cache_events=True)
    a, b, c = pool.get_new_blocks(3)
    blocks = [a, pool.null_block, b, c]
    tokens = list(range(8))
    hashes = [bytes([i]) * 32 for i in range(4)]
    pool.cache_full_blocks(blocks, hashes, 0, 4, 0, token_ids=tokens, block_size=2)
    assert pool.take_events() == [
        BlockStored(hashes[:1], None, [0, 1], 2, 0),
        BlockStored(hashes[2:], hashes[1], [4, 5, 6, 7], 2, 0),
    ]


def test_caching_without_token_ids_while_events_are_on_is_an_error_and_changes_nothing():
    pool = BlockPool(4, enable_kv_cache_events=True)
    (a,) = pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="token_ids"):
        pool.cache_full_blocks([a], [b"h" * 32], 0, 1, group_id=0)
    assert a.block_hash is None and pool.take_events() == []


def test_adopted_external_blocks_are_hits_and_stored_events():
    pool = BlockPool(4, enable_kv_cache_events=True)
    h = b"x" * 32
    block = pool.adopt_external_block(
        h, 1, block_size=2, parent_block_hash=b"p" * 32, token_ids=[7, 8]
    )
    assert block.ref_cnt == 1 and pool.get_cached_block(h, [1]) == [block]
    assert pool.take_events() == [BlockStored([h], b"p" * 32, [7, 8], 2, 1)]
    pool.free_blocks([block])
    assert list(pool.free_block_queue)[-1] is block  # cached: evicted last
    with pytest.raises(ValueError, match="one block of 2 tokens"):
        pool.adopt_external_block(h, 1, block_size=2, token_ids=[1])


# ---- the mirror state machine ------------------------------------------------------------------

VOCAB = 4
NUM_PREFIXES = 3


@dataclass(frozen=True)
class Scenario:
    name: str
    groups: tuple
    num_blocks: int
    block_size: int
    max_model_len: int
    max_chunk: int


def full(bs: int | None = None) -> KVCacheGroup:
    return KVCacheGroup(*FULL, bs)


def sliding(window: int, bs: int | None = None) -> KVCacheGroup:
    return KVCacheGroup(SlidingWindowManager, SlidingWindowManager.Config(window), bs)


def chunked(chunk: int) -> KVCacheGroup:
    config = ChunkedLocalAttentionManager.Config(attention_chunk_size=chunk)
    return KVCacheGroup(ChunkedLocalAttentionManager, config)


def sink(num_sink_tokens: int, window: int) -> KVCacheGroup:
    config = StreamingSinkManager.Config(num_sink_tokens=num_sink_tokens, sliding_window=window)
    return KVCacheGroup(StreamingSinkManager, config)


def state(mode: str) -> KVCacheGroup:
    return KVCacheGroup(StateManager, StateManager.Config(mamba_cache_mode=mode))


SCENARIOS = {
    s.name: s
    for s in [
        Scenario("full", (full(),), 14, 2, 20, 5),
        Scenario("sliding", (sliding(4),), 10, 2, 24, 4),
        Scenario("chunked", (chunked(4),), 10, 2, 24, 4),
        Scenario("sink", (sink(3, 4),), 12, 2, 24, 4),
        Scenario("state_align", (state("align"),), 10, 2, 24, 5),
        Scenario("state_none", (state("none"),), 10, 2, 24, 5),
        Scenario("hybrid_full_sliding", (full(), sliding(4)), 30, 2, 20, 4),
        Scenario("hybrid_mixed_block_sizes", (full(4), sliding(5, 2)), 24, 4, 20, 4),
    ]
}


class KVEventsMachine(RuleBasedStateMachine):
    """A scheduler over a `KVCacheManager` with events on, and a router mirroring its cache."""

    SCENARIO: Scenario

    def __init__(self) -> None:
        super().__init__()
        sc = self.SCENARIO
        config = SchedulerKVCacheConfig(sc.num_blocks, sc.block_size, sc.groups)
        self.mgr = KVCacheManager(config, sc.max_model_len, max_in_flight_tokens=sc.max_chunk)
        self.mgr.enable_kv_cache_events()
        self.pool = self.mgr.block_pool
        self.bs = [m.block_size for m in self.mgr.managers]
        self.mirror: Counter[tuple[bytes, int]] = Counter()
        self.prefixes = [
            random.Random(k).choices(range(VOCAB + 3), k=sc.max_model_len)
            for k in range(NUM_PREFIXES)
        ]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_requests = 0

    # ---- scheduling ----------------------------------------------------------------------------

    def new_request(self, data: st.DataObject) -> Request:
        prefix = self.prefixes[data.draw(st.integers(0, NUM_PREFIXES - 1), label="prefix")]
        length = data.draw(st.integers(0, len(prefix)), label="prefix length")
        suffix = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=6), label="suffix")
        tokens = [*prefix[:length], *suffix][: self.SCENARIO.max_model_len] or [0]
        self.num_requests += 1
        return Request(f"r{self.num_requests}", tokens, block_hasher=self.mgr.make_block_hasher())

    def chunk(self, data: st.DataObject, remaining: int) -> int:
        return min(data.draw(st.integers(1, self.SCENARIO.max_chunk), label="chunk"), remaining)

    def computed(self, req: Request, num_tokens: int, data: st.DataObject) -> None:
        """The step ran: mark tokens computed, sample a token when the sequence is caught up."""
        req.num_computed_tokens += num_tokens
        if req.num_computed_tokens < req.num_tokens:
            return
        if req.num_tokens >= self.SCENARIO.max_model_len:
            self.mgr.free(req)
            self.running.remove(req)
        else:
            req.append_output_token_ids(data.draw(st.integers(0, VOCAB - 1), label="token"))

    def try_admit(self, req: Request, data: st.DataObject) -> bool:
        self.mgr.new_step_starts()
        hits, hit = self.mgr.get_computed_blocks(req)
        k = self.chunk(data, req.num_tokens - hit)
        if self.mgr.allocate_slots(req, k, hit, hits) is None:
            return False
        self.running.append(req)
        req.num_computed_tokens += hit
        self.computed(req, k, data)
        return True

    def preempt(self, req: Request) -> None:
        self.mgr.free(req)
        self.running.remove(req)
        req.num_computed_tokens = 0
        self.waiting.insert(0, req)

    # ---- rules ---------------------------------------------------------------------------------

    @rule(data=st.data())
    def admit_new_request(self, data: st.DataObject) -> None:
        req = self.new_request(data)
        if not self.try_admit(req, data):
            self.waiting.append(req)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit_waiting_request(self, data: st.DataObject) -> None:
        if self.try_admit(self.waiting[0], data):
            self.waiting.pop(0)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step_running_request(self, data: st.DataObject) -> None:
        """Continue a chunked prefill or decode; preempt the newest request while it fails."""
        req = data.draw(st.sampled_from(self.running), label="request")
        self.mgr.new_step_starts()
        k = self.chunk(data, req.num_tokens - req.num_computed_tokens)
        while self.mgr.allocate_slots(req, k) is None:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is req:
                return
        self.computed(req, k, data)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.running), label="request")
        self.mgr.free(req)
        self.running.remove(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt_request(self, data: st.DataObject) -> None:
        self.preempt(data.draw(st.sampled_from(self.running), label="request"))

    @rule(data=st.data())
    def evict_blocks(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.integers(0, self.pool.num_blocks - 1), max_size=3))
        self.mgr.evict_blocks(ids)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.mgr.reset_prefix_cache()

    @precondition(lambda self: self.pool.get_num_free_blocks() > 0)
    @rule(data=st.data())
    def import_external_block(self, data: st.DataObject) -> None:
        """Another engine's block of some prefix arrives: cache it, release it."""
        req = self.new_request(data)
        g = data.draw(st.integers(0, len(self.bs) - 1), label="group")
        hashes = hashes_at_block_size(req.block_hashes, self.mgr.hash_block_size, self.bs[g])
        if not hashes:
            return
        i = data.draw(st.integers(0, len(hashes) - 1), label="block")
        bs = self.bs[g]
        block = self.pool.adopt_external_block(
            hashes[i],
            g,
            block_size=bs,
            parent_block_hash=hashes[i - 1] if i else None,
            token_ids=req.all_token_ids[i * bs : (i + 1) * bs],
        )
        self.pool.free_blocks([block])

    # ---- invariant -----------------------------------------------------------------------------

    @invariant()
    def mirror_equals_the_cached_set(self) -> None:
        events = self.mgr.take_events()
        for event in events:
            if isinstance(event, BlockStored):
                assert event.block_size == self.bs[event.group_id]
                check_chain(event, self.mgr.hash_block_size)
        replay(self.mirror, events)
        assert +self.mirror == cached_set(self.pool)

    def teardown(self) -> None:
        for req in [*self.running, *self.waiting]:
            self.mgr.free(req)
        assert self.mgr.reset_prefix_cache()
        self.mirror_equals_the_cached_set()
        assert not +self.mirror


def make_machine(scenario: Scenario):
    return machine_test_case(KVEventsMachine, scenario, max_examples=40, steps=25)


TestEventsFull = make_machine(SCENARIOS["full"])
TestEventsSlidingWindow = make_machine(SCENARIOS["sliding"])
TestEventsChunkedLocal = make_machine(SCENARIOS["chunked"])
TestEventsStreamingSink = make_machine(SCENARIOS["sink"])
TestEventsMambaAlign = make_machine(SCENARIOS["state_align"])
TestEventsMambaNone = make_machine(SCENARIOS["state_none"])
TestEventsHybridFullSliding = make_machine(SCENARIOS["hybrid_full_sliding"])
TestEventsHybridMixedBlockSizes = make_machine(SCENARIOS["hybrid_mixed_block_sizes"])
