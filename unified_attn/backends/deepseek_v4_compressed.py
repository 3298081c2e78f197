"""DeepSeek-V4's compressed cache users: the compressor's raw-projection window
(`CompressorStateBackend`), the compressed entries CSA/HCA attend to
(`CompressedAttentionBackend`) and the lightning indexer's keys (`LightningIndexerBackend`).
`backends/deepseek_v4_window.py` states what each one's `forward` takes.

All three enumerate the windows that close in a step in the same order (`closing_windows`: by
request, then window), so the rows the compressor gathers, the entries pooled from them and the
slots the compressed caches write them to line up with no exchange between the instances.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from unified_attn.backend import (
    AttentionBackend,
    AttentionType,
    CacheConfig,
    CommonAttentionMetadata,
    LayerConfig,
)
from unified_attn.backends.deepseek_v4_steps import (
    GatheredRows,
    PlannedOnDevice,
    RowAttentionUser,
    StepLayout,
    block_size_of,
    check_tensor,
    closing_windows,
    device_lookup,
    group_ids,
    index_scores,
    on_device,
    slot_writes,
    step_layout,
    top_entries,
    write_rows,
)
from unified_attn.managers import FullAttentionManager, SlidingWindowManager
from unified_attn.tensor_specs import CompressedLatentSpec, PagedKVSpec


def _check_rate(backend: AttentionBackend, compress_rate: Any) -> int:
    if not isinstance(compress_rate, int) or isinstance(compress_rate, bool) or compress_rate <= 0:
        raise ValueError(
            f"{type(backend).__name__}: compress_rate must be a positive int (tokens per "
            f"compressed entry), got {compress_rate!r}"
        )
    if backend.attn_type != AttentionType.DECODER or backend.attention_chunk_size is not None:
        raise ValueError(
            f"{type(backend).__name__}: DeepSeek-V4 caches serve causal decoder layers without "
            f"chunking; got attn_type={backend.attn_type.value}, attention_chunk_size="
            f"{backend.attention_chunk_size}"
        )
    return compress_rate


# ---- the compressor's window of raw projections ----------------------------------------------


@attrs.frozen
class WindowRows:
    """One KV-cache group of a compressor: where new rows go and which rows each closing window
    reads (device tensors)."""

    write_blocks: torch.Tensor  # [T] int64: each token row's slot (the null block without one)
    write_offsets: torch.Tensor  # [T] int64
    read_blocks: torch.Tensor  # [N, span] int64: the rows of each closing window
    read_offsets: torch.Tensor  # [N, span] int64
    read_valid: torch.Tensor  # [N, span] bool: False before position 0


@attrs.frozen
class CompressorPlan:
    num_tokens: int  # host: token rows with data
    num_windows: int  # host: windows closing in this step (N)
    window_starts: torch.Tensor  # device [N] int64: first position of each (its entry's RoPE)
    groups: dict[int, WindowRows]


class CompressorStateBackend(PlannedOnDevice, AttentionBackend[CompressorPlan]):
    """The raw `(kv, gate)` projections of the last `span` tokens of each request, under the
    sliding-window manager (`span = 2 * compress_rate` with `overlap`, else `compress_rate`),
    stored by `PagedKVSpec(1, width)` (K = kv, V = gate)."""

    name = "deepseek-v4-compressor"
    layer_kinds = ("deepseek_v4",)

    def __init__(
        self, *, compress_rate: int, overlap: bool, num_kv_heads: int = 1, **kwargs: Any
    ) -> None:
        rate = compress_rate if isinstance(compress_rate, int) else 0
        span = 2 * rate if overlap else rate
        super().__init__(num_kv_heads=num_kv_heads, sliding_window=span or None, **kwargs)
        self.compress_rate = _check_rate(self, compress_rate)
        self.overlap, self.span = bool(overlap), span
        if num_kv_heads != 1 or self.kv_cache_dtype != self.dtype:
            raise ValueError(
                f"{type(self).__name__}: num_kv_heads={num_kv_heads}, kv_cache_dtype="
                f"{self.kv_cache_dtype}; expected 1 and the model dtype {self.dtype}"
            )

    def get_cache_config(self) -> CacheConfig:
        spec = PagedKVSpec(1, self.head_size, self.kv_cache_dtype)
        return SlidingWindowManager, SlidingWindowManager.Config(self.span), spec

    def prep_forward(
        self,
        common: CommonAttentionMetadata,
        block_tables: dict[int, torch.Tensor],
        for_cudagraph_capture: bool = False,
    ) -> None:
        layout = step_layout(common)
        request, window, live = closing_windows(layout, self.compress_rate)
        first = window * self.compress_rate - (self.span - self.compress_rate)
        positions = first[:, None] + torch.arange(self.span, device=layout.device)  # [N, span]
        device, groups = common.positions.device, {}
        valid = on_device((positions >= 0) & live[:, None], device)
        for gid in group_ids(self):
            bs = common.block_sizes.get(gid) or self._bs(gid)
            writes = slot_writes(common.slot_mappings[gid][: layout.num_tokens], bs)
            reads = device_lookup(block_tables[gid], request[:, None], positions, bs, device)
            groups[gid] = WindowRows(*writes, *reads, valid)
        starts = on_device(window * self.compress_rate, device)
        self.plan = CompressorPlan(layout.num_tokens, int(request.shape[0]), starts, groups)

    def _bs(self, gid: int) -> int:
        """Tokens per block read off a bound view `[num_blocks, 2, block_size, 1, width]`."""
        name = next(n for n, g in self.group_of_layer.items() if g == gid)
        return int(self.kv_caches[name].shape[2])

    def closing_windows(self) -> tuple[int, torch.Tensor]:
        """The windows that close in the current step: their number N (host int: the rows of
        `forward`'s output) and their first positions `[N]` (device int64)."""
        plan = self.current_plan()
        return plan.num_windows, plan.window_starts

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Write `key` (kv) and `value` (gate) `[T, width]` at the group's slots, then fill
        `output [N, 2, span, width]` with each closing window's kv (index 0) and gate (1) rows,
        oldest first; rows before position 0 read kv 0 and gate -inf (softmax weight 0)."""
        plan = self.current_plan()
        index = plan.groups[self.group_of_layer[layer.name]]
        self._check(layer, output, query, key, value, plan)
        cache = self.kv_caches[layer.name]  # [num_blocks, 2, block_size, 1, width]
        n = plan.num_tokens
        cache[index.write_blocks, 0, index.write_offsets, 0] = key[:n]
        cache[index.write_blocks, 1, index.write_offsets, 0] = value[:n]
        gathered = cache[index.read_blocks, :, index.read_offsets, 0]  # [N, span, 2, width]
        kv = gathered[:, :, 0].masked_fill(~index.read_valid[:, :, None], 0.0)
        gate = gathered[:, :, 1].masked_fill(~index.read_valid[:, :, None], float("-inf"))
        output[:, 0].copy_(kv)
        output[:, 1].copy_(gate)
        return output

    def _check(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        plan: CompressorPlan,
    ) -> None:
        width, device = self.head_size, key.device
        for what, tensor in (("key (kv)", key), ("value (gate)", value), ("query", query)):
            check_tensor(layer, what, tensor, (-1, width), self.dtype, device)
            if tensor.shape[0] < plan.num_tokens:
                raise ValueError(
                    f"layer {layer.name}: {what} has {tensor.shape[0]} rows, the step has "
                    f"{plan.num_tokens} tokens; give one row per token"
                )
        shape = (plan.num_windows, 2, self.span, width)
        check_tensor(layer, "output", output, shape, self.dtype, device)


# ---- compressed entries: attention and the lightning indexer ---------------------------------


@attrs.frozen
class EntryIndex:
    """One KV-cache group of a compressed cache (device tensors)."""

    write_blocks: torch.Tensor  # [N] int64: where each closing window's entry goes
    write_offsets: torch.Tensor  # [N] int64
    read_blocks: torch.Tensor  # [B, E] int64: entry e of request b
    read_offsets: torch.Tensor  # [B, E] int64
    request: torch.Tensor  # [T] int64: the request of each token row
    visible: torch.Tensor  # [T, E] bool: entry e complete at the token (e < (p + 1) // rate)
    num_visible: torch.Tensor  # [T] int64: the token's complete entries, 0 .. n - 1 (a prefix)


@attrs.frozen
class EntryPlan:
    num_tokens: int  # host: token rows with data (T)
    num_windows: int  # host: entries written this step (N)
    num_entries: int  # host: entries read per request (E), the longest request's
    groups: dict[int, EntryIndex]


class _CompressedCacheBackend(PlannedOnDevice, AttentionBackend[EntryPlan]):
    """One compressed entry of `head_size` per `compress_rate` tokens under the full-attention
    manager (`CompressedLatentSpec`)."""

    layer_kinds = ("deepseek_v4",)

    def __init__(self, *, compress_rate: int, num_kv_heads: int = 1, **kwargs: Any) -> None:
        super().__init__(num_kv_heads=num_kv_heads, **kwargs)
        self.compress_rate = _check_rate(self, compress_rate)
        if num_kv_heads != 1 or self.sliding_window is not None:
            raise ValueError(
                f"{type(self).__name__}: num_kv_heads={num_kv_heads}, sliding_window="
                f"{self.sliding_window}; compressed caches keep one entry per window for the "
                "whole request: give num_kv_heads=1 and no window"
            )
        if self.kv_cache_dtype != self.dtype:
            raise ValueError(
                f"{type(self).__name__}: kv_cache_dtype={self.kv_cache_dtype} differs from "
                f"dtype={self.dtype}; use kv_cache_dtype='auto'"
            )

    def get_cache_config(self) -> CacheConfig:
        spec = CompressedLatentSpec(self.head_size, self.compress_rate, self.kv_cache_dtype)
        return FullAttentionManager, FullAttentionManager.Config(), spec

    def prep_forward(
        self,
        common: CommonAttentionMetadata,
        block_tables: dict[int, torch.Tensor],
        for_cudagraph_capture: bool = False,
    ) -> None:
        layout = step_layout(common)
        rate = self.compress_rate
        request, window, live = closing_windows(layout, rate)
        num_entries = _entry_count(layout, common.max_seq_len, rate)
        entries = torch.arange(num_entries, device=layout.device)
        complete = torch.where(layout.live, (layout.positions + 1) // rate, 0)  # [T]
        visible = on_device(entries < complete[:, None], common.positions.device)  # [T, E]
        num_visible = on_device(complete.clamp(max=num_entries), common.positions.device)
        device, groups = common.positions.device, {}
        reqs = torch.arange(layout.computed.shape[0], device=layout.device)[:, None]
        starts = entries[None, :] * rate
        live_on_device = on_device(live, device)
        for gid in group_ids(self):
            table, bs = block_tables[gid], block_size_of(self, common, gid, rate)
            write_blocks, write_offsets = device_lookup(table, request, window * rate, bs, device)
            read_blocks, read_offsets = device_lookup(table, reqs, starts, bs, device)
            groups[gid] = EntryIndex(
                # a window that does not close (graph steps) writes its entry to the null block
                torch.where(live_on_device, write_blocks, 0),
                torch.where(live_on_device, write_offsets // rate, 0),
                read_blocks, read_offsets // rate, on_device(layout.request, device), visible,
                num_visible,
            )  # fmt: skip
        self.plan = EntryPlan(layout.num_tokens, int(request.shape[0]), num_entries, groups)

    def _check_entries(self, layer: LayerConfig, query: torch.Tensor, key: torch.Tensor) -> None:
        plan = self.current_plan()
        device = query.device
        check_tensor(layer, "key (entries)", key, (plan.num_windows, self.head_size), self.dtype,
                     device)  # fmt: skip
        heads = layer.num_heads
        shape = (plan.num_tokens, heads, self.head_size)
        check_tensor(layer, "query", query, shape, self.dtype, device)


def _entry_count(layout: StepLayout, max_seq_len: int, rate: int) -> int:
    """Entries read per request (E, host int): the longest request's complete entries, or in a
    CUDA-graph step (whose lengths change between replays) those of `max_seq_len` (the runner's
    `max_model_len`)."""
    if layout.padded:
        return max_seq_len // rate
    return int(layout.seq_lens.max()) // rate if layout.seq_lens.numel() else 0


class CompressedAttentionBackend(_CompressedCacheBackend, RowAttentionUser[EntryPlan]):
    """CSA/HCA: the rows of the request's compressed entries each query reads (all the complete
    ones, or those a top-k selection names; `gather_rows`), which the layer's `swa` user attends
    over together with its window; `forward` attends over them alone (a partial softmax)."""

    name = "deepseek-v4-compressed"

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Write `key` (this step's entries `[N, D]`; `value` is not read), attend with `query
        [T, H, D]` into `output [T, H * D]` and `lse [T, H]` (float32 keyword); `topk [T, k]`
        int64 (keyword, optional): the only entries each query may see, -1 = none."""
        return self.partial_forward(
            layer, output, query, key, kwargs.get("lse"), kwargs.get("topk")
        )

    def gather_rows(
        self,
        layer: LayerConfig,
        query: torch.Tensor,
        key: torch.Tensor,
        selection: torch.Tensor | None = None,
    ) -> GatheredRows:
        """`RowSource`: write `key` (this step's entries `[N, D]`) and return the rows each
        token of `query [T, H, D]` reads: every complete entry of its request, or those
        `selection [T, k]` (the indexer's top-k; int64, -1 = none) names."""
        topk = selection
        plan = self.current_plan()
        self._check_entries(layer, query, key)
        index = plan.groups[self.group_of_layer[layer.name]]
        if topk is not None:
            check_tensor(layer, "topk", topk, (plan.num_tokens, -1), torch.int64, query.device)
        cache = self.kv_caches[layer.name]
        write_rows(cache, index.write_blocks, index.write_offsets, key)
        return GatheredRows(cache, *entry_rows(index, plan.num_entries, topk))


def entry_rows(
    index: EntryIndex, num_entries: int, topk: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each token's compressed rows `(blocks, offsets, visible, lengths)`, `[T, S]`: every entry
    of its request (S = E; the token sees the first `lengths [T]`), or the entries `topk [T, k]`
    names (S = k; -1 names none, a repeat is dropped; no prefix, lengths None)."""
    # read_offsets [1, E] broadcasts over requests (entry e sits at the same offset in each)
    if topk is None or num_entries == 0:
        blocks = index.read_blocks[index.request]
        offsets = index.read_offsets.expand_as(index.read_blocks)[index.request]
        return blocks, offsets, index.visible, index.num_visible
    names = topk.sort(dim=1).values  # an entry named twice is seen once: drop the repeats
    named = (names >= 0) & (names < num_entries)
    named[:, 1:] &= names[:, 1:] != names[:, :-1]
    picks = names.clamp(0, num_entries - 1)  # [T, k]: read only these, not every entry
    blocks = index.read_blocks[index.request[:, None], picks]
    visible = named & (picks < index.num_visible[:, None])  # complete entries are a prefix
    return blocks, index.read_offsets[0][picks], visible, None


class LightningIndexerBackend(_CompressedCacheBackend):
    """CSA's lightning indexer: scores `sum_h w[t, h] * relu(q[t, h] . k[e]) * scale` of every
    complete indexer entry and keeps the top `index_topk` per query."""

    name = "deepseek-v4-indexer"
    # the scores of each token's entries (a kernel backend replaces it)
    score_entries = staticmethod(index_scores)

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Write `key` (entries `[N, D]`), score with `query [T, Hi, D]` and `weights [T, Hi]`
        (float32 keyword, the model's scaled head weights), fill `output [T, index_topk]`
        int64 with the best entries of each query (-1 where fewer are complete)."""
        plan = self.current_plan()
        weights = kwargs.get("weights")
        self._check_entries(layer, query, key)
        n = plan.num_tokens
        check_tensor(layer, "output", output, (n, -1), torch.int64, query.device)
        if weights is None:
            raise ValueError(f"layer {layer.name}: forward needs weights=[T, index_n_heads]")
        check_tensor(layer, "weights", weights, (n, layer.num_heads), torch.float32, query.device)
        index = plan.groups[self.group_of_layer[layer.name]]
        cache = self.kv_caches[layer.name]  # [num_blocks, block_size // rate, head_size]
        write_rows(cache, index.write_blocks, index.write_offsets, key)
        scores = torch.empty(n, plan.num_entries, dtype=torch.float32, device=query.device)
        self.score_entries(query, weights, cache, index.read_blocks, index.read_offsets[0],
                           index.request, index.num_visible, layer.scale, scores)  # fmt: skip
        k = min(output.shape[1], plan.num_entries)
        picks = top_entries(scores, k)
        output.fill_(-1)
        output[:, :k] = torch.where(picks < index.num_visible[:, None], picks, -1)
        return output

