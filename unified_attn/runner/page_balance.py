"""Per-group block sizes that balance page bytes, for models whose caches cost different bytes
per token (a latent per token next to raw compressor rows and one compressed entry per 4 or 128
tokens, say).

All groups draw block ids from one pool and a block is as large as the largest group's page, so
a group whose page is smaller wastes the difference in every block it holds. With one block size
for every group, layers that cost 1 KiB per token and layers that cost 8 bytes per token cannot
have similar pages. Here each bucket (the layers of one `(manager_cls, config)`) gets its own
block size, a power-of-two multiple of the base block size (so the coordinator's hit alignment,
the LCM, is the largest of them and the hash block size the smallest), and is split into parts
of about equal bytes per token (longest-processing-time packing); the choice minimises, among the
plans whose every group wastes at most `tolerance` of a block (5%, relaxed step by step when no
plan reaches it), the alignment, then the number of groups.

A spec may declare `block_size_multiple` (tokens per cache entry, e.g. `CompressedLatentSpec`'s
rate): its group's block size is a multiple of it. A layer's page is `per_token * block_size +
fixed` (`page_cost`): token-paged caches grow with the block size, a recurrent state
(`StateSpec`) is fixed, so a Mamba layer's multi-MiB state is matched by attention blocks of
many tokens (vLLM's hybrid allocator raises the attention block size the same way) rather than
every attention block padded to the state's page. `needs_balancing` says when to use this.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

import attrs

TOLERANCES = (0.05, 0.1, 0.2, 0.5, 1.0)
MAX_DOUBLINGS = 6  # block sizes up to 64x the base


def block_size_multiple(spec: Any) -> int:
    return int(getattr(spec, "block_size_multiple", 1))


def bytes_per_token(spec: Any) -> float:
    """Page bytes per token of a token-paged spec, at its smallest block size."""
    multiple = block_size_multiple(spec)
    return float(spec.page_size_bytes(multiple)) / multiple


def is_token_paged(spec: Any) -> bool:
    """Whether the page grows linearly with the block size (K/V, latents, compressed entries),
    unlike a fixed-size recurrent state."""
    multiple = block_size_multiple(spec)
    small = spec.page_size_bytes(multiple)
    return bool(small > 0 and spec.page_size_bytes(2 * multiple) == 2 * small)


Cost = tuple[float, float]  # a layer's page: (bytes per token, fixed bytes)


def page_cost(spec: Any) -> Cost:
    if is_token_paged(spec):
        return bytes_per_token(spec), 0.0
    return 0.0, float(spec.page_size_bytes(block_size_multiple(spec)))


def needs_balancing(specs: Sequence[Any]) -> bool:
    """True when the specs do not all cost the same (per token, or fixed per block)."""
    return len({page_cost(s) for s in specs}) > 1


@attrs.frozen
class BucketChoice:
    """A bucket's block size and its parts (indices into the bucket, each in bucket order)."""

    block_size: int
    parts: tuple[tuple[int, ...], ...]
    low: float  # smallest part's page bytes
    high: float  # largest part's page bytes


def pack(costs: Sequence[float], num_parts: int) -> list[list[int]]:
    """Indices of `costs` in `num_parts` parts of about equal sums: largest first, each into
    the lightest part (ties by part index)."""
    heap = [(0.0, part) for part in range(num_parts)]
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        total, part = heapq.heappop(heap)
        parts[part].append(index)
        heapq.heappush(heap, (total + costs[index], part))
    return [sorted(p) for p in parts]


def bucket_choices(
    costs: Sequence[Cost], block_sizes: Sequence[int], tolerance: float
) -> list[BucketChoice]:
    """Every (block size, part count) whose parts differ by at most `tolerance`."""
    choices = []
    for block_size in block_sizes:
        pages = [per_token * block_size + fixed for per_token, fixed in costs]
        for num_parts in range(1, len(costs) + 1):
            parts = pack(pages, num_parts)
            sums = [sum(pages[i] for i in p) for p in parts]
            if min(sums) >= (1 - tolerance) * max(sums):
                choices.append(BucketChoice(block_size, tuple(map(tuple, parts)), *_span(sums)))
    return choices


def _span(sums: list[float]) -> tuple[float, float]:
    return min(sums), max(sums)


def candidate_block_sizes(base: int, multiple: int, accepted: set[int] | None) -> list[int]:
    sizes = [base << k for k in range(MAX_DOUBLINGS + 1)]
    return [s for s in sizes if s % multiple == 0 and (accepted is None or s in accepted)]


def balance(
    costs: Sequence[Sequence[Cost]], block_sizes: Sequence[Sequence[int]]
) -> list[BucketChoice]:
    """One choice per bucket: `costs[b]` its layers' page costs, `block_sizes[b]` the
    sizes it may use (non-empty)."""
    for tolerance in TOLERANCES:
        options = [bucket_choices(c, s, tolerance) for c, s in zip(costs, block_sizes, strict=True)]
        best = _best_plan(options, tolerance)
        if best is not None:
            return best
    raise AssertionError("tolerance 1.0 always admits every single-part choice")


def _best_plan(options: list[list[BucketChoice]], tolerance: float) -> list[BucketChoice] | None:
    """Over every target page size P: per bucket the fewest parts (then smallest block) whose
    pages lie in `[(1 - tolerance) P, P]`; the plan of smallest alignment, then fewest
    groups, then least waste."""
    best: tuple[tuple[float, ...], list[BucketChoice]] | None = None
    for target in sorted({c.high for choices in options for c in choices}):
        plan = []
        for choices in options:
            fits = [c for c in choices if c.high <= target and c.low >= (1 - tolerance) * target]
            if not fits:
                break
            plan.append(min(fits, key=lambda c: (len(c.parts), c.block_size)))
        else:
            waste = max(1 - c.low / target for c in plan)
            alignment = math.lcm(*(c.block_size for c in plan))
            key = (alignment, sum(len(c.parts) for c in plan), waste)
            if best is None or key < best[0]:
                best = (key, plan)
    return None if best is None else best[1]
