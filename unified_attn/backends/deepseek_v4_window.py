"""DeepSeek-V4 attention through the unified contract: the reference (plain torch) backends.

**Cache users.** A V4 attention layer `model.layers.i.self_attn` keeps several caches, each
with its own allocation policy, so the model yields one *cache user* per cache from
`attention_layers()` (a `LayerConfig` named `...self_attn.<user>` and the backend instance that
owns that cache), exactly like ordinary layers. Each instance returns its own
`(manager_cls, config, spec)`; the worker groups and sizes them with no DeepSeek-specific code:

- `swa` (every layer): `DeepseekV4WindowBackend`, `SlidingWindowManager(sliding_window)`,
  `LatentKVSpec(head_dim)`: the roped latent of every token (key = value).
- `compressor` (CSA, HCA): `CompressorStateBackend`, `SlidingWindowManager(span)`,
  `PagedKVSpec(1, width)`: the raw rows the next compressed entries pool.
- `compressed` (CSA, HCA): `CompressedAttentionBackend`, `FullAttentionManager()`,
  `CompressedLatentSpec(head_dim, rate)`: one pooled entry per `rate` tokens.
- `indexer_compressor` (CSA): `CompressorStateBackend`, `SlidingWindowManager(2 * rate)`,
  `PagedKVSpec(1, 2 * index_head_dim)`.
- `indexer` (CSA): `LightningIndexerBackend`, `FullAttentionManager()`,
  `CompressedLatentSpec(index_head_dim, rate)`: the indexer's keys.

The compressor keeps the raw `(kv, gate)` projections of the last `span` tokens (K = kv, V =
gate, `width` features each): CSA's overlapping windows read the previous window's first half
(Ca) and the current window's second half (Cb), so `span = 2 * rate` and `width = 2 * head_dim`;
HCA's windows do not overlap (`span = rate`, `width = head_dim`). It is a sliding window, not a
recurrent state, so prefix-cache hits stay right-aligned like any window.

**One step of a CSA layer** (HCA: no indexer, every complete entry visible):

1. `compressor.forward(layer, windows, kv, kv, gate)`: write the step's raw rows, then gather
   the N windows that close in this step (`closing_windows()`: N, a host int, and their first
   positions) as `windows [N, 2, span, width]` (kv, gate; rows before position 0: kv 0, gate
   -inf).
2. The model pools each window into one entry `[N, D]` (softmax gates + position bias,
   `kv_norm`, RoPE at the window's first position).
3. `indexer.forward(layer, topk [T, index_topk] int64, q_idx, entries_idx, entries_idx,
   weights=[T, Hi])`: write the indexer entries, fill the top-k complete entries of every query
   (-1 where fewer exist).
4. `compressed.gather_rows(layer, q, entries, topk)`: write the entries, return the rows of
   the selected complete ones (`GatheredRows`: the cache view, block and slot of each row,
   visibility).
5. `swa.gather_rows(layer, q, kv)`: write the token's latent, return its window's rows.
6. `swa.attend_row_sets(layer, out, q, [window rows, compressed rows], sinks)`: one softmax over
   both sets of rows and the learned sinks (`attend_sets`, the seam a kernel backend
   replaces: the Triton backend runs both sets in one launch on sm90).

**Reading several caches.** Each user writes only its own cache and hands the layer the rows
its queries read; the `swa` backend attends over every set (it reads the `compressed` user's
view through the rows it is given, never through a registry) and folds in the sinks, which is
transformers' single softmax. `forward` still gives one user's *partial* softmax (`output` and
its log-sum-exp `lse`, -inf where a query sees no key), for callers that want one cache alone;
`deepseek_v4_steps.merge_partials` joins partials with the sinks exactly (split-KV merge). The
closing windows, their entries and their slots line up because every user enumerates them in
the same order (`deepseek_v4_steps.closing_windows`). Nothing here reads a host value of a
device tensor: no host sync.

**CUDA graphs.** In a graph step (`common.graph_step`: padded to a captured batch, q tokens
per request row, host per-request fields are placeholders) every user plans from the step's
device fields alone, with fixed shapes: `ceil(q / rate)` window slots per request row (the
ones that do not close are not live and write to the null block) and `max_seq_len // rate`
entries per request. That planning is device work only, so the users plan inside the graph
(`PlannedOnDevice`: `plans_inside_cuda_graphs()`), and a replay re-plans on the device.

**Prefix hits.** A hit is a multiple of every group's block size, and block sizes are multiples
of the rates, so the compressed caches hold every entry of the hit (entry w is written when its
last token is computed, in the step that fills its block) and the compressor's window holds the
`span - 1` raw rows before the hit that the next windows read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from unified_attn.backend import (
    AttentionBackend,
    AttentionType,
    CacheConfig,
    CommonAttentionMetadata,
    LayerConfig,
    refuse_soft_cap,
    soft_cap_reasons,
)
from unified_attn.backends.deepseek_v4_compressed import (
    CompressedAttentionBackend,
    CompressorStateBackend,
    LightningIndexerBackend,
)
from unified_attn.backends.deepseek_v4_steps import (
    GatheredRows,
    RowAttentionUser,
    attend_row_sets,
    block_size_of,
    check_tensor,
    device_lookup,
    group_ids,
    on_device,
    slot_writes,
    step_layout,
    write_rows,
)
from unified_attn.managers import SlidingWindowManager
from unified_attn.selector import SelectorConfig, register_backend
from unified_attn.tensor_specs import LatentKVSpec


@attrs.frozen
class WindowIndex:
    """One KV-cache group of the sliding-window latents (device tensors)."""

    write_blocks: torch.Tensor  # [T] int64: each token row's slot (the null block without one)
    write_offsets: torch.Tensor  # [T] int64
    key_blocks: torch.Tensor  # [T, W] int64: positions p - W + 1 .. p of each token
    key_offsets: torch.Tensor  # [T, W] int64
    key_valid: torch.Tensor  # [T, W] bool: False before position 0


@attrs.frozen
class WindowPlan:
    num_tokens: int  # host: token rows with data
    groups: dict[int, WindowIndex]


@register_backend(priority={"cpu": 100, "cuda": 10})
class DeepseekV4WindowBackend(RowAttentionUser[WindowPlan], AttentionBackend[WindowPlan]):
    """The `swa` cache user: one latent of `head_size` per token (key = value, shared by every
    head) under the sliding-window manager, and the attention over it (`RowSource`,
    `RowSetAttention`). The classes of the layer's other cache users come from
    `cache_user_classes()`, which a kernel backend overrides with its own."""

    name = "deepseek-v4-reference"
    layer_kinds = ("deepseek_v4",)
    # the layer's attention over several users' rows with the sinks (a kernel backend replaces
    # it, and `attend_rows`)
    attend_sets = staticmethod(attend_row_sets)

    def __init__(self, *, num_kv_heads: int = 1, **kwargs: Any) -> None:
        super().__init__(num_kv_heads=num_kv_heads, **kwargs)
        problems = []
        if num_kv_heads != 1:
            problems.append(f"num_kv_heads={num_kv_heads}, expected 1 (shared-KV MQA)")
        if self.sliding_window is None:
            problems.append("sliding_window is required (every V4 layer slides)")
        if self.kv_cache_dtype != self.dtype:
            problems.append(
                f"kv_cache_dtype={self.kv_cache_dtype} differs from {self.dtype} (the V4 caches "
                "hold the model dtype: use kv_cache_dtype='auto')"
            )
        if self.attn_type != AttentionType.DECODER or self.num_sink_tokens:
            problems.append("V4 layers are causal decoder layers without sink tokens")
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))

    @classmethod
    def cache_user_classes(cls) -> Mapping[str, type[AttentionBackend]]:
        return {
            "compressor": CompressorStateBackend,
            "compressed": CompressedAttentionBackend,
            "indexer": LightningIndexerBackend,
        }

    @classmethod
    def validate_configuration(cls, cfg: SelectorConfig) -> list[str]:
        reasons = []
        if cfg.kv_cache_dtype not in ("auto", cfg.dtype):
            reasons.append(f"KV-cache dtype {cfg.kv_cache_dtype} must equal the model dtype")
        if cfg.attn_type != AttentionType.DECODER:
            reasons.append(f"V4 layers are causal decoder layers, not {cfg.attn_type.value}")
        if cfg.attention_chunk_size is not None or cfg.sliding_window is None:
            reasons.append("V4 layers need a sliding window and no attention chunks")
        return reasons + soft_cap_reasons(cfg)

    def get_cache_config(self) -> CacheConfig:
        assert self.sliding_window is not None  # checked by the constructor
        spec = LatentKVSpec(self.head_size, self.kv_cache_dtype)
        return SlidingWindowManager, SlidingWindowManager.Config(self.sliding_window), spec

    def prep_forward(
        self,
        common: CommonAttentionMetadata,
        block_tables: dict[int, torch.Tensor],
        for_cudagraph_capture: bool = False,
    ) -> None:
        assert self.sliding_window is not None
        layout = step_layout(common)
        window = self.sliding_window
        offsets = torch.arange(window, device=layout.device)
        keys = layout.positions[:, None] - (window - 1) + offsets  # [T, W]
        visible = on_device((keys >= 0) & layout.live[:, None], common.positions.device)
        groups, device = {}, common.positions.device
        for gid in group_ids(self):
            bs = block_size_of(self, common, gid, 1)
            writes = slot_writes(common.slot_mappings[gid][: layout.num_tokens], bs)
            reads = device_lookup(block_tables[gid], layout.request[:, None], keys, bs, device)
            groups[gid] = WindowIndex(*writes, *reads, visible)
        self.plan = WindowPlan(layout.num_tokens, groups)

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Write `key [T, D]` (the roped latents; `value` is not read) at the group's slots,
        attend with `query [T, H, D]` over each token's window into `output [T, H * D]` and
        `lse [T, H]` (float32 keyword): this user's partial softmax."""
        return self.partial_forward(layer, output, query, key, kwargs.get("lse"))

    def gather_rows(
        self,
        layer: LayerConfig,
        query: torch.Tensor,
        key: torch.Tensor,
        selection: torch.Tensor | None = None,
    ) -> GatheredRows:
        """`RowSource`: write `key [T, D]` (this step's roped latents) at the group's slots and
        return the rows each token of `query [T, H, D]` reads: its window of latents (a window
        takes no `selection`)."""
        if selection is not None:
            raise ValueError(f"layer {layer.name}: the window user takes no selection")
        plan = self.current_plan()
        n, heads, width = plan.num_tokens, layer.num_heads, self.head_size
        check_tensor(layer, "query", query, (n, heads, width), self.dtype, query.device)
        check_tensor(layer, "key", key, (n, width), self.dtype, query.device)
        index = plan.groups[self.group_of_layer[layer.name]]
        cache = self.kv_caches[layer.name]  # [num_blocks, block_size, D]
        write_rows(cache, index.write_blocks, index.write_offsets, key)
        return GatheredRows(cache, index.key_blocks, index.key_offsets, index.key_valid)

    def attend_row_sets(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        row_sets: Sequence[GatheredRows],
        sinks: torch.Tensor,
    ) -> torch.Tensor:
        """`RowSetAttention`, the layer's attention: one softmax of `query [T, H, D]` over the
        rows of every set (this user's `gather_rows`, and the `compressed` user's on CSA/HCA
        layers) plus the learned `sinks [H]`, into `output [T, H * D]`."""
        n, heads, width = self.current_plan().num_tokens, layer.num_heads, self.head_size
        device = query.device
        check_tensor(layer, "query", query, (n, heads, width), self.dtype, device)
        check_tensor(layer, "output", output, (n, heads * width), self.dtype, device)
        check_tensor(layer, "sinks", sinks, (heads,), sinks.dtype, device)
        if not row_sets:
            raise ValueError(f"layer {layer.name}: attend_row_sets needs at least one row set")
        self.attend_sets(query, row_sets, layer.scale, sinks, output.view(n, heads, width))
        return output

    def check_layer(self, layer: LayerConfig) -> None:
        super().check_layer(layer)
        refuse_soft_cap(layer, "DeepSeek-V4 backends")


__all__ = [
    "CompressedAttentionBackend",
    "CompressorStateBackend",
    "DeepseekV4WindowBackend",
    "LightningIndexerBackend",
]
