"""Small builders shared by the manager tests."""

from __future__ import annotations

from typing import Any

from unified_attn.managers import FullAttentionManager, KVCacheManager, SchedulerKVCacheConfig
from unified_attn.managers.block_pool import BlockPool
from unified_attn.request import Request

FULL = (FullAttentionManager, FullAttentionManager.Config())


def make_manager(num_blocks=11, block_size=16, groups=(FULL,), max_model_len=1024, **kwargs):
    config = SchedulerKVCacheConfig(num_blocks, block_size, list(groups))
    return KVCacheManager(config, max_model_len=max_model_len, **kwargs)


def make_request(manager: KVCacheManager, request_id: str, tokens, **kwargs) -> Request:
    return Request(request_id, list(tokens), block_hasher=manager.make_block_hasher(), **kwargs)


def admit(manager: KVCacheManager, request: Request, num_new: int | None = None):
    """get_computed_blocks + allocate_slots for a waiting request; marks tokens computed."""
    hits, num_hit = manager.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - num_hit
    new = manager.allocate_slots(request, num_new, num_hit, hits)
    if new is not None:
        request.num_computed_tokens += num_hit + num_new
    return hits, num_hit, new


def step(manager: KVCacheManager, request: Request, num_new: int = 1):
    new = manager.allocate_slots(request, num_new)
    if new is not None:
        request.num_computed_tokens += num_new
    return new


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def walk_free_queue(pool: BlockPool) -> list[int]:
    """Block ids of the free queue, head first, after checking every link in both directions."""
    queue, limit = pool.free_block_queue, pool.num_blocks
    forward, block = [], queue.head.next_free_block
    while block is not queue.tail:
        assert block is not None, "forward walk fell off the free queue"
        assert block.next_free_block is not None, f"{block} has no next link"
        assert block.next_free_block.prev_free_block is block, f"broken link after {block}"
        forward.append(block.block_id)
        assert len(forward) < limit, "cycle in the free queue"
        block = block.next_free_block
    backward, block = [], queue.tail.prev_free_block
    while block is not queue.head:
        assert block is not None, "backward walk fell off the free queue"
        backward.append(block.block_id)
        assert len(backward) < limit, "cycle in the free queue"
        block = block.prev_free_block
    assert forward == backward[::-1], "forward and backward walks disagree"
    assert len(forward) == len(set(forward)), "a block is in the free queue twice"
    assert len(forward) == queue.num_free_blocks == pool.get_num_free_blocks()
    return forward


def machine_test_case(machine: type, scenario: Any, max_examples: int, steps: int) -> Any:
    """The Hypothesis test case of `machine` bound to `scenario` (its class attribute
    `SCENARIO`), named after both so each layout shows up as its own test."""
    from hypothesis import HealthCheck, settings

    cls = type(f"{machine.__name__}_{scenario.name}", (machine,), {"SCENARIO": scenario})
    test_case = cls.TestCase
    test_case.settings = settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    return test_case
