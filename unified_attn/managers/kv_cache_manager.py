"""`KVCacheManager`: the scheduler-facing API over every KV-cache group."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from unified_attn.managers.block_pool import KVCacheBlock, PrefixCacheStats
from unified_attn.managers.coordinator import make_coordinator
from unified_attn.managers.events import KVCacheEvent
from unified_attn.managers.eviction import EvictionPolicy
from unified_attn.managers.hashing import request_block_hasher
from unified_attn.managers.scheduler_config import SchedulerKVCacheConfig
from unified_attn.request import Request


@attrs.frozen
class KVCacheBlocks:
    """Blocks per group: `blocks[group_id][i]`."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(a + b for a, b in zip(self.blocks, other.blocks, strict=True)))


class KVCacheManager:
    """The scheduler's view of the KV cache: prefix hits, slot allocation and freeing for
    requests, over one shared block pool and one manager per KV-cache group.

    Per step the scheduler calls `new_step_starts()`, then for a waiting request
    `get_computed_blocks` and `allocate_slots(request, n, num_hit, hits)`, for a running one
    `allocate_slots(request, n)`, and `free(request)` when it finishes or is preempted. It
    never sees tensors: block ids go to the runner, which maps them to memory.

    `eviction` picks which cached block a new block evicts: `"lru"` (default, vLLM's order)
    or `"window_aware"` (blocks no prefix hit can use first; docs/kv-cache.md).
    """

    def __init__(
        self,
        kv_cache_config: SchedulerKVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        eviction: EvictionPolicy = "lru",
    ) -> None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.coordinator = make_coordinator(
            kv_cache_config, max_model_len, max_in_flight_tokens, enable_caching, eviction
        )
        self.block_pool = self.coordinator.block_pool
        self.managers = self.coordinator.managers
        self.num_groups = len(self.managers)
        self.prefix_cache_stats = PrefixCacheStats()
        # Returned whenever nothing is allocated (most decode steps); never mutated.
        self._empty = KVCacheBlocks(tuple([] for _ in range(self.num_groups)))

    # ---- queries -------------------------------------------------------------------------------

    @property
    def hash_block_size(self) -> int:
        return self.coordinator.hash_block_size

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_block_hasher(self):
        """The block hasher requests must carry for prefix caching with this manager."""
        return request_block_hasher(self.hash_block_size)

    @property
    def checkpoint_alignment(self) -> int | None:
        """Token multiple at which steps should end so state groups can cache checkpoints
        (Mamba "align" caches a state only when a step ends on a block boundary); None when
        no group needs it."""
        needs = any(m.caches_only_at_step_ends for m in self.managers)
        return self.coordinator.alignment if needs and self.enable_caching else None

    def group_stats(self) -> list[dict[str, object]]:
        """Per group: the policy, blocks recycled early (windows, chunks, states) and blocks
        adopted from prefix hits, since startup."""
        return [
            {
                "group_id": gid,
                "manager": type(m).__name__,
                "blocks_freed_early": m.num_blocks_freed_early,
                "hit_blocks": m.num_hit_blocks,
            }
            for gid, m in enumerate(self.managers)
        ]

    def max_blocks_per_request(self) -> list[int]:
        """Worst-case blocks of one request per group (admission caps and sizing)."""
        return [m.max_blocks_per_request() for m in self.managers]

    def get_blocks(self, request: Request | str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(_request_id(request)))

    def get_block_ids(self, request: Request | str) -> tuple[list[int], ...]:
        return self.get_blocks(request).get_block_ids()

    # ---- prefix hits ---------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of a waiting request: (hit blocks per group, tokens).

        The hit is at most `num_tokens - 1`: the last prompt token is always recomputed so the
        step produces logits.
        """
        if not self.enable_caching or not self.num_groups or request.skip_reading_prefix_cache:
            return self._empty, 0
        max_length = min(request.num_tokens - 1, len(request.block_hashes) * self.hash_block_size)
        blocks, num_hit = self.coordinator.find_longest_cache_hit(request.block_hashes, max_length)
        self.prefix_cache_stats.record(request.num_tokens, num_hit)
        if not num_hit:
            return self._empty, 0  # every group's list is empty: share the unmutated one
        return KVCacheBlocks(blocks), num_hit

    # ---- allocation ----------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> KVCacheBlocks | None:
        """Reserve KV-cache slots for the next `num_new_tokens` tokens of `request`.

        The request's tokens, as this call sees them:

            | <-- computed --> | <-- new computed --> | <--- new ---> | <-- lookahead --> |
            0     request.num_computed_tokens      total_computed        + num_new    + lookahead
                               | prefix-cache hit:    | computed this   | slots for draft |
                               | `new_computed_blocks`| step            | tokens, never   |
                               |  (waiting requests)  |                 | cached          |

        - `computed`: tokens already in the request's blocks (0 for a waiting request).
        - `new computed` = `num_new_computed_tokens`: a prefix hit from `get_computed_blocks`,
          passed with its blocks `new_computed_blocks`; only when admitting a waiting request.
        - `new` = `num_new_tokens` (> 0): tokens this step computes; their slots are reserved
          and every block they fill is cached (hashed) for later prefix hits.
        - `lookahead` = `num_lookahead_tokens`: extra slots (speculative drafts) that are
          never cached.
        - `full_sequence_must_fit`: refuse unless the request's whole known sequence fits.
        - Encoder-decoder requests (`request.num_encoder_tokens > 0`): cross-attention groups
          hold the encoder tokens, all of them from the first allocation on.

        Before allocating, each group frees the blocks its policy no longer needs (sliding
        window, chunked local, state), counting only settled tokens
        (`total_computed - request.num_in_flight_tokens`). Returns the entries appended to
        each group's block table (new blocks, null blocks where a policy skips positions), or
        None when the pool cannot hold them, in which case nothing has changed. Raises
        `ValueError` for negative counts or tokens beyond `max_model_len`."""
        total_computed = request.num_computed_tokens + num_new_computed_tokens
        if (
            num_new_tokens <= 0
            or num_new_computed_tokens < 0
            or num_lookahead_tokens < 0
            or total_computed + num_new_tokens > self.max_model_len
        ):
            self._check_counts(
                request, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens
            )
        rid = request.request_id
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else self._empty.blocks
        if len(hits) != self.num_groups:
            raise ValueError(
                f"new_computed_blocks has {len(hits)} groups, expected {self.num_groups}"
            )
        coordinator = self.coordinator
        num_free = self.block_pool.get_num_free_blocks()
        encoder = request.num_encoder_tokens
        if full_sequence_must_fit:
            whole = min(request.num_tokens, self.max_model_len)
            need = coordinator.get_num_blocks_to_allocate(
                rid, whole, hits, total_computed, True, encoder
            )
            if need > num_free:
                return None
        num_tokens = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        # Free only on the settled basis: an in-flight step may still read the window.
        settled = max(0, total_computed - request.num_in_flight_tokens)
        need = coordinator.get_num_blocks_to_allocate(
            rid, num_tokens, hits, total_computed, num_encoder_tokens=encoder
        )
        if need > num_free and need > num_free + coordinator.num_freeable_skipped_blocks(
            rid, settled
        ):
            return None
        # Admission succeeded; from here on state changes.
        coordinator.remove_skipped_blocks(rid, settled)
        if new_computed_blocks is not None or num_new_computed_tokens:
            coordinator.add_computed_blocks(rid, hits, total_computed)
        new_blocks = coordinator.allocate_new_blocks(rid, num_tokens, encoder)
        if self.enable_caching:
            # Never cache tokens that are not part of the request yet (drafts, lookahead).
            coordinator.cache_blocks(
                request, min(total_computed + num_new_tokens, request.num_tokens)
            )
        if not any(new_blocks):
            return self._empty
        return KVCacheBlocks(new_blocks)

    def _check_counts(
        self, request: Request, num_new: int, num_new_computed: int, num_lookahead: int
    ) -> None:
        if num_new < 0 or num_new_computed < 0 or num_lookahead < 0:
            raise ValueError(
                f"allocate_slots({request.request_id!r}): token counts must be >= 0, got "
                f"num_new_tokens={num_new}, num_new_computed_tokens={num_new_computed}, "
                f"num_lookahead_tokens={num_lookahead}"
            )
        if num_new == 0 and num_new_computed == 0:
            raise ValueError(
                f"allocate_slots({request.request_id!r}): nothing to schedule "
                "(num_new_tokens == 0 and num_new_computed_tokens == 0); "
                "schedule at least one token."
            )
        end = request.num_computed_tokens + num_new_computed + num_new
        if end > self.max_model_len:
            raise ValueError(
                f"allocate_slots({request.request_id!r}): the request would hold {end} tokens, "
                f"more than max_model_len={self.max_model_len}; finish or truncate it first."
            )

    # ---- freeing and cache control -------------------------------------------------------------

    def free(self, request: Request | str) -> None:
        """Free every block of the request, tail first (its hashed blocks stay cached).

        Freeing a request that holds no blocks (unknown, or already freed) is a no-op.
        """
        self.coordinator.free(_request_id(request))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop blocks from the prefix cache (external cache controllers); blocks in use stay."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; refused (False) while any request holds blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats = PrefixCacheStats()
        return True

    def new_step_starts(self) -> None:
        """Call once at the start of every scheduler step."""
        self.coordinator.new_step_starts()

    def take_new_block_ids(self) -> list[int]:
        """Ids of newly allocated blocks that must be zeroed before use (state groups)."""
        return [i for m in self.managers for i in m.take_new_block_ids()]

    # ---- KV-cache events -----------------------------------------------------------------------

    def enable_kv_cache_events(self) -> None:
        """Record what enters and leaves the prefix cache from now on (`take_events`)."""
        self.block_pool.enable_kv_cache_events = True

    def take_events(self) -> list[KVCacheEvent]:
        """The KV-cache events since the last call, in order, and forget them."""
        return self.block_pool.take_events()


def _request_id(request: Request | str) -> str:
    return request if isinstance(request, str) else request.request_id
