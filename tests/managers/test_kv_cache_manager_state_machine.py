"""Hypothesis state machines over `KVCacheManager`, one per KV-cache group layout.

The machine plays a scheduler (admit, chunked prefill, decode, finish, preempt, whole batch
steps) and a model runner that "writes" tokens: for every physical block it records which token
prefix each slot holds (attention) or which prefix a state block summarises (Mamba). The checks
after every step follow KV_CACHE_RULES.md: ref counts equal table entries, the free queue is a
consistent linked list of exactly the unowned blocks, the null block is untouched, a prefix hit
only returns blocks holding the request's own tokens, a hashed block holds the content its hash
names, every position a query attends to is backed by a real block with the right content, and a
refused `allocate_slots` changes nothing.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.managers.helpers import machine_test_case, walk_free_queue
from unified_attn.managers import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    KVCacheBlocks,
    KVCacheGroup,
    KVCacheManager,
    SchedulerKVCacheConfig,
    SlidingWindowManager,
    StateManager,
    StreamingSinkManager,
)
from unified_attn.managers.hashing import hashes_at_block_size, with_group_id
from unified_attn.request import Request
from unified_attn.utils import cdiv

VOCAB = 4  # small, so generated tokens and suffixes often coincide and prefix hits happen
NUM_PREFIXES = 3


@dataclass(frozen=True)
class Scenario:
    name: str
    groups: tuple
    num_blocks: int
    block_size: int
    max_model_len: int
    max_chunk: int  # tokens scheduled per request per step (also max_in_flight_tokens)


def full(bs: int | None = None) -> KVCacheGroup:
    return KVCacheGroup(FullAttentionManager, FullAttentionManager.Config(), bs)


def sliding(window: int, bs: int | None = None) -> KVCacheGroup:
    return KVCacheGroup(SlidingWindowManager, SlidingWindowManager.Config(window), bs)


def chunked(chunk: int) -> KVCacheGroup:
    return KVCacheGroup(
        ChunkedLocalAttentionManager,
        ChunkedLocalAttentionManager.Config(attention_chunk_size=chunk),
    )


def state(mode: str, bs: int | None = None) -> KVCacheGroup:
    return KVCacheGroup(StateManager, StateManager.Config(mamba_cache_mode=mode), bs)


def sink(num_sink_tokens: int, window: int) -> KVCacheGroup:
    config = StreamingSinkManager.Config(num_sink_tokens=num_sink_tokens, sliding_window=window)
    return KVCacheGroup(StreamingSinkManager, config)


SCENARIOS = {
    "full": Scenario("full", (full(),), 14, 2, 20, 5),
    "full_bs4": Scenario("full_bs4", (full(),), 10, 4, 32, 6),
    "sliding": Scenario("sliding", (sliding(4),), 10, 2, 24, 4),
    "sliding_bs3": Scenario("sliding_bs3", (sliding(5),), 10, 3, 24, 4),
    "chunked": Scenario("chunked", (chunked(4),), 10, 2, 24, 4),
    "chunked_straddle": Scenario("chunked_straddle", (chunked(3),), 10, 2, 24, 4),
    "state_align": Scenario("state_align", (state("align"),), 10, 2, 24, 5),
    "state_none": Scenario("state_none", (state("none"),), 10, 2, 24, 5),
    "sink": Scenario("sink", (sink(3, 4),), 12, 2, 24, 4),
    "hybrid_full_sliding": Scenario("hybrid_full_sliding", (full(), sliding(4)), 30, 2, 20, 4),
    "hybrid_full_state": Scenario("hybrid_full_state", (full(2), state("align", 4)), 30, 2, 20, 5),
    # Two groups that are not downward closed: the hybrid hit needs the fixed-point loop.
    "hybrid_sliding_state": Scenario(
        "hybrid_sliding_state", (sliding(4), state("align")), 16, 2, 20, 4
    ),
    "hybrid_mixed_block_sizes": Scenario(
        "hybrid_mixed_block_sizes", (full(4), sliding(5, 2)), 24, 4, 20, 4
    ),
}


def kind_of(manager) -> str:
    if isinstance(manager, StreamingSinkManager):
        return "sink"
    if isinstance(manager, SlidingWindowManager):
        return "sliding"
    if isinstance(manager, ChunkedLocalAttentionManager):
        return "chunked"
    if isinstance(manager, StateManager):
        return "state_align" if manager.align else "state_none"
    assert isinstance(manager, FullAttentionManager)
    return "full"


class KVCacheManagerMachine(RuleBasedStateMachine):
    SCENARIO: Scenario

    def __init__(self) -> None:
        super().__init__()
        sc = self.SCENARIO
        config = SchedulerKVCacheConfig(sc.num_blocks, sc.block_size, sc.groups)
        self.mgr = KVCacheManager(config, sc.max_model_len, max_in_flight_tokens=sc.max_chunk)
        self.pool = self.mgr.block_pool
        self.mml = sc.max_model_len
        self.kinds = [kind_of(m) for m in self.mgr.managers]
        self.bs = [m.block_size for m in self.mgr.managers]
        self.alignment = math.lcm(*self.bs)
        self.prefixes = [
            tuple(random.Random(k).choices(range(VOCAB + 3), k=self.mml))
            for k in range(NUM_PREFIXES)
        ]
        self.waiting: list[Request] = []  # front = next to admit
        self.running: list[Request] = []  # admission order
        self.requests: list[Request] = []  # every request ever created
        # Model of device memory: attention slots and state blocks, by physical block id.
        self.kv: dict[int, dict[int, tuple[int, ...]]] = {}
        self.state: dict[int, tuple[int, ...]] = {}
        self.hash_prefix: dict[bytes, tuple[int, ...]] = {}
        # Per scheduler step.
        self.hashed_at_step_start: set[tuple[int, bytes]] = set()
        self.pending_state: list[tuple[int, tuple[int, ...]]] = []
        self.scheduled: list[tuple[Request, int, int]] = []  # (request, end, sampled token)
        self.num_preempted = 0

    # ---- requests and hashes -------------------------------------------------------------------

    def new_request(self, data: st.DataObject) -> Request:
        prefix = data.draw(st.integers(0, NUM_PREFIXES - 1), label="prefix")
        length = data.draw(st.integers(0, self.mml), label="prefix length")
        suffix = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=6), label="suffix")
        tokens = [*self.prefixes[prefix][:length], *suffix][: self.mml] or [0]
        req = Request(f"r{len(self.requests)}", tokens, block_hasher=self.mgr.make_block_hasher())
        self.requests.append(req)
        self.register_hashes(req)
        return req

    def register_hashes(self, req: Request) -> None:
        hbs = self.mgr.hash_block_size
        for i, block_hash in enumerate(req.block_hashes):
            prefix = tuple(req.all_token_ids[: (i + 1) * hbs])
            assert self.hash_prefix.setdefault(block_hash, prefix) == prefix, "hash collision"

    def group_hashes(self, req: Request, g: int) -> list[bytes]:
        return hashes_at_block_size(req.block_hashes, self.mgr.hash_block_size, self.bs[g])

    def table(self, req: Request, g: int) -> list:
        return self.mgr.get_blocks(req).blocks[g]

    def is_cached(self, block_hash: bytes, g: int) -> bool:
        key = with_group_id(block_hash, g)
        return self.pool.cached_block_hash_to_block.get_one_block(key) is not None

    # ---- snapshots -----------------------------------------------------------------------------

    def snapshot(self, req: Request) -> tuple:
        reqs = [*self.running, *self.waiting, req]
        return (
            self.pool.get_num_free_blocks(),
            tuple((b.ref_cnt, b.block_hash) for b in self.pool.blocks),
            tuple(walk_free_queue(self.pool)),
            tuple(self.mgr.get_block_ids(r) for r in reqs),
            tuple(req.request_id in m.num_cached_block for m in self.mgr.managers),
            self.pool.num_cached_blocks(),
        )

    def holds_blocks(self, req: Request) -> bool:
        return any(not b.is_null for group in self.mgr.get_blocks(req).blocks for b in group)

    # ---- scheduler steps -----------------------------------------------------------------------

    def begin_step(self) -> None:
        self.mgr.new_step_starts()
        self.hashed_at_step_start = {
            (b.block_id, b.block_hash) for b in self.pool.blocks if b.block_hash is not None
        }
        self.pending_state = []
        self.scheduled = []

    def end_step(self) -> None:
        """The forward pass ends: states are written, outputs sampled, finished requests freed."""
        for bid, prefix in self.pending_state:
            self.state[bid] = prefix
        for req, end, token in self.scheduled:
            assert req in self.running, f"{req} was preempted after being scheduled"
            req.num_computed_tokens = end
            if end < req.num_tokens:
                continue
            if req.num_tokens >= self.mml:
                event("reached max_model_len")
                self.finish(req)
            else:
                req.append_output_token_ids(token)
                self.register_hashes(req)

    def finish(self, req: Request) -> None:
        self.mgr.free(req)
        self.running.remove(req)
        self.check_forgotten(req)

    def preempt(self, req: Request) -> None:
        self.mgr.free(req)
        self.running.remove(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.insert(0, req)
        self.num_preempted += 1
        self.check_forgotten(req)

    def check_forgotten(self, req: Request) -> None:
        for m in self.mgr.managers:
            assert req.request_id not in m.req_to_blocks
            assert req.request_id not in m.num_cached_block

    def draw_chunk(self, data: st.DataObject, remaining: int) -> int:
        return min(data.draw(st.integers(1, self.SCENARIO.max_chunk), label="chunk"), remaining)

    def try_admit(self, req: Request, data: st.DataObject) -> bool:
        """get_computed_blocks + allocate_slots for a waiting request."""
        assert req.num_computed_tokens == 0 and not self.holds_blocks(req)
        hit_blocks, hit = self.mgr.get_computed_blocks(req)
        self.check_hit(req, hit_blocks, hit)
        if hit:
            event("prefix hit")
        if req.num_preemptions:
            event("resumed after preemption")
        k = self.draw_chunk(data, req.num_tokens - hit)
        token = data.draw(st.integers(0, VOCAB - 1), label="sampled token")
        if self.allocate(req, k, token, hit, hit_blocks) is None:
            return False
        self.running.append(req)
        return True

    def schedule_running(self, req: Request, data: st.DataObject) -> bool:
        """One step of a running request, preempting the newest running request on failure."""
        k = self.draw_chunk(data, req.num_tokens - req.num_computed_tokens)
        token = data.draw(st.integers(0, VOCAB - 1), label="sampled token")
        while self.allocate(req, k, token) is None:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def allocate(
        self,
        req: Request,
        k: int,
        token: int,
        hit: int = 0,
        hit_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        before = self.snapshot(req)
        tables_before = [len(self.table(req, g)) for g in range(len(self.bs))]
        new = self.mgr.allocate_slots(
            req, k, num_new_computed_tokens=hit, new_computed_blocks=hit_blocks
        )
        if new is None:
            assert self.snapshot(req) == before, "a refused allocate_slots changed state"
            event("allocate_slots refused")
            self.check_refusal_is_justified(req)
            return None
        start = req.num_computed_tokens + hit
        end = start + k
        self.check_new_blocks(req, new, hit_blocks, tables_before, end)
        for g, kind in enumerate(self.kinds):
            if kind.startswith("state"):
                self.run_state_layer(req, g, start, end)
            else:
                self.write_attention(req, g, start, end)
                self.check_attention_reads(req, g, start, end)
        self.scheduled.append((req, end, token))
        return new

    def check_refusal_is_justified(self, req: Request) -> None:
        """Alone in the pool, a request whose worst case fits must be scheduled (rules 13, 18)."""
        others = [r for r in self.running if r is not req]
        fits = sum(self.mgr.max_blocks_per_request()) <= self.pool.num_blocks - 1
        if fits and not any(self.holds_blocks(r) for r in others):
            raise AssertionError(
                f"allocate_slots refused {req} although no other request holds blocks and "
                f"its worst case {self.mgr.max_blocks_per_request()} fits the pool"
            )

    def check_new_blocks(
        self,
        req: Request,
        new: KVCacheBlocks,
        hit_blocks: KVCacheBlocks | None,
        tables_before: list[int],
        end: int,
    ) -> None:
        """allocate_slots returns exactly the entries appended to each table: fresh blocks, and
        null padding only where a state group skips positions."""
        zeroed = self.mgr.take_new_block_ids()
        expected_zeroed = []
        num_hits = [len(g) for g in hit_blocks.blocks] if hit_blocks else [0] * len(self.bs)
        for g, kind in enumerate(self.kinds):
            appended, table = new.blocks[g], self.table(req, g)
            expected_len = 1 if kind == "state_none" else cdiv(end, self.bs[g])
            assert len(table) == expected_len, f"group {g}: table {table} for {end} tokens"
            assert table[tables_before[g] + num_hits[g] :] == appended, (
                f"group {g}: returned {appended}, but the table grew to {table}"
            )
            fresh = [b for b in appended if not b.is_null]
            assert kind == "state_align" or fresh == appended, f"group {g}: null in {appended}"
            for block in fresh:
                assert block.ref_cnt == 1, f"group {g}: new block {block} is shared"
            if kind.startswith("state"):
                expected_zeroed += [b.block_id for b in fresh]
        assert sorted(zeroed) == sorted(expected_zeroed), "new state blocks must be zeroed"
        for bid in zeroed:
            self.state[bid] = ()
        # A block evicted and re-cached under the same hash in this step holds no checkpoint
        # yet: it no longer counts as hashed at the step's start.
        self.hashed_at_step_start = {
            (bid, h) for bid, h in self.hashed_at_step_start if bid not in zeroed
        }

    # ---- the model runner ----------------------------------------------------------------------

    def write_attention(self, req: Request, g: int, start: int, end: int) -> None:
        bs, table, tokens = self.bs[g], self.table(req, g), tuple(req.all_token_ids)
        for pos in range(start, end):
            block = table[pos // bs]
            assert not block.is_null, f"group {g}: token {pos} of {req} lands in the null block"
            self.kv.setdefault(block.block_id, {})[pos % bs] = tokens[: pos + 1]

    def attended_positions(self, g: int, start: int, end: int) -> set[int]:
        """Key positions the queries at [start, end) read (and the rules keep alive)."""
        config = self.mgr.managers[g].config
        kind = self.kinds[g]
        if kind == "full":
            return set(range(end))
        if kind == "chunked":
            return set(
                range(start // config.attention_chunk_size * config.attention_chunk_size, end)
            )
        window = set(range(max(0, start - config.sliding_window + 1), end))
        if kind == "sink":
            window |= set(range(min(config.num_sink_tokens, end)))
        return window

    def check_attention_reads(self, req: Request, g: int, start: int, end: int) -> None:
        bs, table, tokens = self.bs[g], self.table(req, g), tuple(req.all_token_ids)
        for pos in sorted(self.attended_positions(g, start, end)):
            block = table[pos // bs]
            assert not block.is_null, (
                f"group {g} ({self.kinds[g]}): {req} computing [{start}, {end}) attends to "
                f"token {pos}, but table[{pos // bs}] is the null block; table {table}"
            )
            held = self.kv.get(block.block_id, {}).get(pos % bs)
            assert held == tokens[: pos + 1], (
                f"group {g}: {block} slot {pos % bs} holds {held}, "
                f"expected the prefix {tokens[: pos + 1]}"
            )

    def state_index(self, g: int, num_tokens: int) -> int:
        return 0 if self.kinds[g] == "state_none" else (num_tokens - 1) // self.bs[g]

    def run_state_layer(self, req: Request, g: int, start: int, end: int) -> None:
        table, tokens = self.table(req, g), tuple(req.all_token_ids)
        if start:
            read = table[self.state_index(g, start)]
            assert not read.is_null, f"group {g}: the state of {req} at {start} was freed"
            assert self.state.get(read.block_id) == tokens[:start], (
                f"group {g}: {req} restarts from {read} holding the state of "
                f"{self.state.get(read.block_id)}, expected the state of {tokens[:start]}"
            )
        write = table[self.state_index(g, end)]
        assert not write.is_null, f"group {g}: {req} writes its state to the null block"
        self.pending_state.append((write.block_id, tokens[:end]))

    # ---- prefix hits ---------------------------------------------------------------------------

    def check_hit(self, req: Request, hit_blocks: KVCacheBlocks, hit: int) -> None:
        tokens = tuple(req.all_token_ids)
        assert 0 <= hit <= req.num_tokens - 1, f"hit {hit} for {req.num_tokens} tokens"
        assert hit % self.alignment == 0, f"hit {hit} not aligned to {self.alignment}"
        for g, kind in enumerate(self.kinds):
            bs, blocks = self.bs[g], hit_blocks.blocks[g]
            assert len(blocks) == hit // bs, f"group {g}: {len(blocks)} blocks for hit {hit}"
            hashes = self.group_hashes(req, g)
            for i, block in enumerate(blocks):
                if block.is_null:
                    continue
                assert block.block_hash == with_group_id(hashes[i], g), (
                    f"group {g}: hit block {block} at {i} is not cached under the request's hash"
                )
                if kind.startswith("state"):
                    continue
                held = [self.kv.get(block.block_id, {}).get(j) for j in range(bs)]
                assert held == [tokens[: i * bs + j + 1] for j in range(bs)], (
                    f"group {g}: hit block {block} at index {i} holds other tokens"
                )
            if kind == "state_none":
                assert hit == 0, "mode 'none' never reports a hit"
            elif kind == "state_align" and hit:
                *pad, last = blocks
                assert all(b.is_null for b in pad) and not last.is_null, blocks
                if (last.block_id, last.block_hash) in self.hashed_at_step_start:
                    assert self.state.get(last.block_id) == tokens[:hit]
        if len(self.kinds) == 1:
            expected = self.longest_valid_hit(req)
            assert hit == expected, f"{self.kinds[0]}: hit {hit}, longest valid hit {expected}"

    def longest_valid_hit(self, req: Request) -> int:
        """The longest hit a single group's policy allows, from the cache map (rules 12-15)."""
        kind, bs, config = self.kinds[0], self.bs[0], self.mgr.managers[0].config
        hashes = self.group_hashes(req, 0)
        max_blocks = min(req.num_tokens - 1, len(hashes) * bs) // bs
        cached = [self.is_cached(h, 0) for h in hashes[:max_blocks]]

        def all_cached(lo: int, hi: int) -> bool:
            return all(cached[max(lo, 0) : hi])

        if kind == "state_none":
            return 0
        if kind == "state_align":
            return max((i + 1 for i in range(max_blocks) if cached[i]), default=0) * bs
        if kind == "full":
            return next((i for i, c in enumerate(cached) if not c), max_blocks) * bs
        if kind == "chunked":
            chunk = config.attention_chunk_size
            valid = [
                n for n in range(max_blocks + 1) if all_cached(n * bs // chunk * chunk // bs, n)
            ]
            return max(valid) * bs
        need = cdiv(config.sliding_window - 1, bs)
        sinks = cdiv(config.num_sink_tokens, bs) if kind == "sink" else 0
        valid = [
            n
            for n in range(max_blocks + 1)
            if all_cached(0, min(sinks, n)) and all_cached(n - need, n)
        ]
        return max(valid) * bs

    # ---- rules ---------------------------------------------------------------------------------

    @rule(data=st.data())
    def admit_new_request(self, data: st.DataObject) -> None:
        req = self.new_request(data)
        self.begin_step()
        if not self.try_admit(req, data):
            self.waiting.append(req)
        self.end_step()

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit_waiting_request(self, data: st.DataObject) -> None:
        self.begin_step()
        if self.try_admit(self.waiting[0], data):
            self.waiting.pop(0)
        self.end_step()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step_running_request(self, data: st.DataObject) -> None:
        """Continue a chunked prefill or decode one token of a running request."""
        req = data.draw(st.sampled_from(self.running), label="request")
        self.begin_step()
        self.schedule_running(req, data)
        self.end_step()

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def batch_step(self, data: st.DataObject) -> None:
        """A whole scheduler step: every running request, then waiting ones while they fit."""
        self.begin_step()
        preempted_before = self.num_preempted
        i = 0
        while i < len(self.running):
            if self.schedule_running(self.running[i], data):
                i += 1
        preempted = self.num_preempted > preempted_before
        while not preempted and self.waiting and self.try_admit(self.waiting[0], data):
            self.waiting.pop(0)
        self.end_step()

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from([*self.running, *self.waiting]), label="request")
        if req in self.running:
            self.finish(req)
            return
        before = self.snapshot(req)
        self.mgr.free(req)  # a waiting request holds nothing: freeing it is a no-op
        assert self.snapshot(req) == before
        self.waiting.remove(req)

    @precondition(lambda self: self.running)
    @rule()
    def finish_all_requests(self) -> None:
        for req in list(self.running):
            self.finish(req)
        assert self.mgr.usage == 0.0, "freeing every request must empty the pool"
        assert self.pool.get_num_free_blocks() == self.pool.num_blocks - 1

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
        holding = any(self.holds_blocks(r) for r in self.running)
        assert self.mgr.reset_prefix_cache() is not holding
        if not holding:
            assert self.pool.num_cached_blocks() == 0
            assert all(b.block_hash is None for b in self.pool.blocks)

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def ref_counts_equal_table_entries(self) -> None:
        owners: Counter[int] = Counter()
        for req in self.running:
            for group in self.mgr.get_blocks(req).blocks:
                owners.update(b.block_id for b in group if not b.is_null)
        for req in self.waiting:
            assert not self.holds_blocks(req), f"waiting {req} holds blocks"
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            assert block.ref_cnt == owners[block.block_id], (
                f"{block}: ref_cnt {block.ref_cnt} but {owners[block.block_id]} table entries"
            )

    @invariant()
    def free_queue_is_consistent(self) -> None:
        forward = walk_free_queue(self.pool)
        free_ids = {b.block_id for b in self.pool.blocks[1:] if b.ref_cnt == 0}
        assert set(forward) == free_ids, "free queue != blocks nobody owns"

    @invariant()
    def null_block_untouched(self) -> None:
        null = self.pool.null_block
        assert null is self.pool.blocks[0] and null.is_null
        assert null.ref_cnt == 0 and null.block_hash is None
        assert null.prev_free_block is None and null.next_free_block is None

    @invariant()
    def hashed_blocks_hold_their_content(self) -> None:
        entries = self.pool.cached_block_hash_to_block._cache
        in_map = {}
        for key, entry in entries.items():
            for block in entry.values() if isinstance(entry, dict) else [entry]:
                assert block.block_hash == key
                in_map[block.block_id] = key
        for block in self.pool.blocks:
            key = block.block_hash
            assert in_map.get(block.block_id) == key, f"{block} hashed but not in the cache map"
            if key is None:
                continue
            prefix = self.hash_prefix[key[:-4]]
            g = int.from_bytes(key[-4:], "big")
            if self.kinds[g].startswith("state"):
                held = self.state.get(block.block_id)
                assert held == prefix, f"state {block} cached for {prefix}, holds {held}"
                continue
            bs = self.bs[g]
            held = [self.kv.get(block.block_id, {}).get(j) for j in range(bs)]
            expected = [prefix[: len(prefix) - bs + j + 1] for j in range(bs)]
            assert held == expected, f"{block} cached for {prefix} holds {held}"

    @invariant()
    def tables_hold_the_request_tokens(self) -> None:
        max_blocks = self.mgr.max_blocks_per_request()
        for req in self.running:
            n, tokens = req.num_computed_tokens, tuple(req.all_token_ids)
            assert 0 < n < req.num_tokens
            for g, kind in enumerate(self.kinds):
                table, bs = self.table(req, g), self.bs[g]
                live = [b for b in table if not b.is_null]
                assert len(live) <= max_blocks[g], f"group {g}: {req} holds {live}"
                if kind.startswith("state"):
                    self.check_state_table(req, g, table)
                    continue
                for i, block in enumerate(table):
                    for pos in range(i * bs, min((i + 1) * bs, n)):
                        if not block.is_null:
                            held = self.kv.get(block.block_id, {}).get(pos % bs)
                            assert held == tokens[: pos + 1], f"{block} lost token {pos}"
                for pos in self.attended_positions(g, n, n + 1) - {n}:
                    assert not table[pos // bs].is_null, f"group {g}: {req} lost token {pos}"

    def check_state_table(self, req: Request, g: int, table: list) -> None:
        n, tokens, bs = req.num_computed_tokens, tuple(req.all_token_ids), self.bs[g]
        current = table[self.state_index(g, n)]
        assert not current.is_null and self.state.get(current.block_id) == tokens[:n]
        if self.kinds[g] == "state_none":
            assert len(table) == 1
            return
        for i, block in enumerate(table):
            if not block.is_null:
                held = self.state.get(block.block_id)
                assert held is not None and i * bs < len(held) <= min((i + 1) * bs, n)
                assert held == tokens[: len(held)], f"{block} holds another request's state"

    @invariant()
    def usage_is_a_fraction(self) -> None:
        usage = self.mgr.usage
        assert 0.0 <= usage <= 1.0
        in_use = self.pool.num_blocks - 1 - self.pool.get_num_free_blocks()
        assert math.isclose(usage, in_use / (self.pool.num_blocks - 1))

    def teardown(self) -> None:
        for req in self.requests:  # also one a failed check left half admitted
            self.mgr.free(req)
            self.check_forgotten(req)
        assert self.mgr.usage == 0.0, "freeing every request must empty the pool"
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)
        self.free_queue_is_consistent()
        self.hashed_blocks_hold_their_content()
        assert self.mgr.reset_prefix_cache()
        assert self.pool.num_cached_blocks() == 0


def make_machine(scenario: Scenario):
    """One machine class per group layout, so each shows up as its own test."""
    return machine_test_case(KVCacheManagerMachine, scenario, max_examples=150, steps=50)


TestFullOnly = make_machine(SCENARIOS["full"])
TestFullOnlyBlockSize4 = make_machine(SCENARIOS["full_bs4"])
TestSlidingWindow = make_machine(SCENARIOS["sliding"])
TestSlidingWindowBlockSize3 = make_machine(SCENARIOS["sliding_bs3"])
TestChunkedLocal = make_machine(SCENARIOS["chunked"])
TestChunkedLocalStraddlingBlocks = make_machine(SCENARIOS["chunked_straddle"])
TestMambaAlign = make_machine(SCENARIOS["state_align"])
TestMambaNone = make_machine(SCENARIOS["state_none"])
TestStreamingSink = make_machine(SCENARIOS["sink"])
TestHybridFullSliding = make_machine(SCENARIOS["hybrid_full_sliding"])
TestHybridFullMamba = make_machine(SCENARIOS["hybrid_full_state"])
TestHybridSlidingMamba = make_machine(SCENARIOS["hybrid_sliding_state"])
TestHybridMixedBlockSizes = make_machine(SCENARIOS["hybrid_mixed_block_sizes"])
