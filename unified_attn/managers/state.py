"""State layers (Mamba, linear attention): only the latest recurrent state matters.

Mode "none": no prefix caching. A request's table is `[state, *speculative]`, allocated once.
Mode "align" (vLLM's): the table is positional like attention's. After a step ending at token n,
the block at index `(n - 1) // block_size` holds the state after n tokens; earlier positions are
null (freed). A step ending on a block boundary leaves a checkpoint that is cached under that
block's hash, and a prefix hit is the single right-most cached checkpoint.
Mode "all": as "align", and a step also leaves a checkpoint at every block boundary it crosses
(block `b - 1` holds the state after `b * block_size` tokens), so a prompt is cached at each of
its block boundaries whatever the scheduler's chunks; the checkpoints behind the request's
position are freed (into the prefix cache) as in "align".

The backend reads a request's state from table position `(num_computed - 1) // block_size`
(zeros when nothing is computed) and writes it to `(num_computed + num_new - 1) // block_size`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs

from unified_attn.managers.base import SingleTypeKVCacheManager
from unified_attn.managers.block_pool import KVCacheBlock
from unified_attn.request import Request
from unified_attn.utils import cdiv, non_negative_int

STATE_CACHE_MODES = ("none", "align", "all")


def _check_mode(_instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in STATE_CACHE_MODES:
        raise ValueError(f"mamba_cache_mode must be one of {STATE_CACHE_MODES}, got {value!r}")


class StateManager(SingleTypeKVCacheManager):
    """Blocks that each hold one request's recurrent state (one per request in mode "none",
    checkpoints at block boundaries in modes "align" and "all"). `mamba_cache_mode` keeps vLLM's
    name for the same switch."""

    @attrs.frozen
    class Config(SingleTypeKVCacheManager.Config):
        mamba_cache_mode: Literal["none", "align", "all"] = attrs.field(
            default="none", validator=_check_mode
        )
        num_speculative_blocks: int = attrs.field(default=0, validator=non_negative_int)

        def __attrs_post_init__(self) -> None:
            if self.mamba_cache_mode != "none" and self.num_speculative_blocks:
                raise ValueError(
                    "num_speculative_blocks > 0 needs mamba_cache_mode='none' "
                    f"(got mamba_cache_mode={self.mamba_cache_mode!r}, num_speculative_blocks="
                    f"{self.num_speculative_blocks})"
                )

    config: Config
    needs_zeroed_blocks = True

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        # "align" and "all": positional tables of checkpoints; "all": at every boundary crossed
        self.align = config.mamba_cache_mode != "none"
        self.every_boundary = config.mamba_cache_mode == "all"
        self.caches_only_at_step_ends = config.mamba_cache_mode == "align"  # type: ignore[misc]
        # align mode: non-null positions of each request's table (at most a few).
        self.live_positions: dict[str, list[int]] = {}
        self.cached_this_step: set[int] = set()
        # "all": per request, the table positions below this are cached or passed
        self.checkpointed: dict[str, int] = {}

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(num_computed_tokens - 1, 0)

    def max_blocks_per_request(self) -> int:
        # align: the state read this step and the block it writes are both alive; all: and a
        # checkpoint at each boundary a step of at most max_in_flight_tokens crosses
        if self.every_boundary:
            return 2 + cdiv(self.max_in_flight_tokens, self.block_size)
        return 1 + self.config.num_speculative_blocks + (1 if self.align else 0)

    # ---- allocation ----------------------------------------------------------------------------

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        if not self.align:
            return 0 if self.req_to_blocks.get(request_id) else self.max_blocks_per_request()
        if any(b.block_id in self.cached_this_step for b in new_computed_blocks):
            # The checkpoint is written by this very step: retry the hit next step.
            return self.block_pool.num_blocks
        num_positions = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        missing = cdiv(num_tokens, self.block_size) - num_positions
        return (max(missing, 0) if self.every_boundary else int(missing > 0)) + evictable

    def add_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], num_computed: int
    ) -> None:
        super().add_computed_blocks(request_id, new_computed_blocks, num_computed)
        blocks = self.req_to_blocks[request_id]
        self.live_positions[request_id] = [i for i, b in enumerate(blocks) if not b.is_null]

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Returns every entry appended to the table: in align mode the null padding before
        the new state block too, so a runner appending them keeps positions right."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        self.num_cached_block.setdefault(request_id, len(blocks))
        if not self.align:
            if blocks:
                return []
            new_blocks = self.block_pool.get_new_blocks(self.max_blocks_per_request())
            blocks.extend(new_blocks)
            self._record_new(new_blocks)
            return new_blocks
        last = cdiv(num_tokens, self.block_size) - 1
        if last < len(blocks):
            return []
        first = len(blocks) if self.every_boundary else last
        new_blocks = self.block_pool.get_new_blocks(last + 1 - first)
        appended = [self.null_block] * (first - len(blocks)) + new_blocks
        blocks.extend(appended)
        self.live_positions.setdefault(request_id, []).extend(range(first, last + 1))
        self._record_new(new_blocks)
        return appended

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the checkpoint when this step ends exactly on an aligned block boundary
        ("align"), or every aligned checkpoint the request holds up to `num_tokens` ("all")."""
        if not self.align:
            return
        if self.every_boundary:
            rid = request.request_id
            start = self.checkpointed.get(rid, 0)
            end = min(num_tokens // self.block_size, len(self.req_to_blocks.get(rid, ())),
                      len(self.block_hashes(request)))  # fmt: skip
            for index in range(start, end):
                if (index + 1) * self.block_size % self.cache_alignment == 0:
                    self._cache_checkpoint(request, index)
            self.checkpointed[rid] = max(start, end)
        elif num_tokens and not num_tokens % self.cache_alignment:
            self._cache_checkpoint(request, num_tokens // self.block_size - 1)

    def _cache_checkpoint(self, request: Request, index: int) -> None:
        blocks = self.req_to_blocks.get(request.request_id, [])
        hashes = self.block_hashes(request)
        if index >= min(len(blocks), len(hashes)) or blocks[index].is_null:
            return
        if blocks[index].block_hash is None:
            self.block_pool.cache_full_blocks(
                blocks,
                hashes,
                index,
                index + 1,
                self.group_id,
                token_ids=request.all_token_ids,
                block_size=self.block_size,
            )
            self.cached_this_step.add(blocks[index].block_id)

    def new_step_starts(self) -> None:
        self.cached_this_step.clear()

    # ---- freeing -------------------------------------------------------------------------------

    def _stale_positions(self, request_id: str, num_computed_tokens: int) -> list[int]:
        if not self.align:
            return []
        end = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        return [i for i in self.live_positions.get(request_id, ()) if i < end]

    def num_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        blocks = self.req_to_blocks.get(request_id, [])
        stale = self._stale_positions(request_id, num_computed_tokens)
        return sum(1 for i in stale if blocks[i].ref_cnt == 1)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        stale = self._stale_positions(request_id, num_computed_tokens)
        if not stale:
            return
        blocks = self.req_to_blocks[request_id]
        freed = [blocks[i] for i in reversed(stale)]
        for i in stale:
            blocks[i] = self.null_block
        self.live_positions[request_id] = [
            i for i in self.live_positions[request_id] if i not in stale
        ]
        self.num_blocks_freed_early += len(freed)
        self.block_pool.free_blocks(freed)

    def free(self, request_id: str) -> None:
        self.live_positions.pop(request_id, None)
        self.checkpointed.pop(request_id, None)
        super().free(request_id)

    # ---- prefix hits ---------------------------------------------------------------------------

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int, alignment: int
    ) -> tuple[list[KVCacheBlock], int]:
        if not self.align:
            return [], 0
        group = (self.group_id,)
        for i in range(min(max_length // self.block_size, len(block_hashes)) - 1, -1, -1):
            if (i + 1) * self.block_size % alignment:
                continue
            cached = self.block_pool.get_cached_block(block_hashes[i], group)
            if cached is not None:
                return [self.null_block] * i + [cached[0]], (i + 1) * self.block_size
        return [], 0


# vLLM's name for this manager, kept because the public contract (and code ported from vLLM)
# uses it: the same class, not a second implementation.
MambaManager = StateManager
