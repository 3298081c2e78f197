"""The unified attention-backend contract: one class per backend.

A backend is one class with four methods. The engine calls them in this order:

1. **Construction** with the static parameters shared by every layer the instance serves
   (`num_kv_heads`, `head_size`, `dtype`, `sliding_window`, `attention_chunk_size`,
   `kv_cache_dtype`, `batch_invariant`, `num_sink_tokens`, backend-specific `**options`). The
   model builds one instance per attention kind and hands it to all layers of that kind.
2. **Planning** (before any memory exists): `get_cache_config()`, any number of times, and
   `check_layer(layer)` for every layer the instance serves.
3. **`bind_kv_caches(views, groups)`** once, after the worker has allocated the cache.
4. **Every step**: `prep_forward(common, block_tables)` exactly once, then `forward(layer, ...)`
   once per layer, in layer order, reading what `prep_forward` planned.

The rules a backend keeps:

- `get_cache_config` is pure: the same triple on every call, no side effects; layers are
  grouped by the `(manager_cls, config)` it returns.
- `prep_forward` does all host work of the step (index math, `.tolist()`, host-to-device
  copies, kernel plans) and stores it as **one typed plan object**, `self.plan`, whose type the
  backend declares (an attrs class, frozen where it can be, each field's device stated). It
  sets no other attribute. With `for_cudagraph_capture=True` the plan must read only tensors
  that later replays overwrite in place (the runner's persistent buffers, views of them, and
  scratch the backend sizes for the largest captured batch). With `plans_inside_cuda_graphs()`
  a `common.graph_step` step's `prep_forward` is captured with the forward instead (not called
  at replays, which re-plan from the persistent buffers): device work only, no host sync.
- `forward` may be captured in a CUDA graph (when `supports_cuda_graphs()` is True), so it must
  not allocate memory that outlives the call, synchronise with the host, call `.item()` /
  `.tolist()` / `.cpu()`, or read host tensors; it reads only its arguments, `self.plan` and
  the bound caches. It writes the new keys and values into the layer's cache at the group's slot
  mapping (slot -1 is padding: nothing is written) and the attention result into `output`.
- Bad input (shape, dtype, device) raises `ValueError` naming the layer, the expected and the
  found value (`check_forward_inputs`).

A minimal backend (the reference backend in `backends/reference.py` is a complete one):

```python
import attrs
import torch

from unified_attn import AttentionBackend, register_backend


@attrs.frozen
class CopyPlan:
    rows: dict[int, torch.Tensor]  # device: group id -> [W] rows of new tokens with a slot
    blocks: dict[int, torch.Tensor]  # device: group id -> [W] block id of each such row
    offsets: dict[int, torch.Tensor]  # device: group id -> [W] offset inside that block


@register_backend(priority={"cpu": 1})
class ValueCopyBackend(AttentionBackend[CopyPlan]):
    # Writes the cache, then returns each token's own value (a toy, not attention).
    name = "value-copy"

    def prep_forward(self, common, block_tables, for_cudagraph_capture=False):
        rows, blocks, offsets = {}, {}, {}
        for gid, slots in common.slot_mappings.items():
            size = common.block_sizes[gid]
            rows[gid] = torch.nonzero(slots >= 0).flatten()
            blocks[gid], offsets[gid] = slots[rows[gid]] // size, slots[rows[gid]] % size
        self.plan = CopyPlan(rows, blocks, offsets)

    def forward(self, layer, output, query, key, value, **kwargs):
        q, k, v = self.check_forward_inputs(layer, output, query, key, value)
        plan, gid = self.current_plan(), self.group_of_layer[layer.name]
        rows, blocks, offsets = plan.rows[gid], plan.blocks[gid], plan.offsets[gid]
        cache = self.kv_caches[layer.name]  # [num_blocks, 2, block_size, Hkv, D]
        cache[blocks, 0, offsets] = k[rows]
        cache[blocks, 1, offsets] = v[rows]
        output.view(q.shape)[:] = v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        return output
```
"""

from unified_attn.backend.attention_backend import (
    AttentionBackend,
    PlanT,
    check_dtype_device,
    refuse_soft_cap,
    require_cache_config,
    soft_cap_reasons,
)
from unified_attn.backend.cache_users import (
    GatheredRows,
    RowSetAttention,
    RowSource,
    WindowSource,
    as_capability,
)
from unified_attn.backend.layer_types import (
    AttentionType,
    CacheConfig,
    CommonAttentionMetadata,
    LayerConfig,
)

__all__ = [
    "AttentionBackend",
    "AttentionType",
    "CacheConfig",
    "CommonAttentionMetadata",
    "GatheredRows",
    "LayerConfig",
    "PlanT",
    "RowSetAttention",
    "RowSource",
    "WindowSource",
    "as_capability",
    "check_dtype_device",
    "refuse_soft_cap",
    "require_cache_config",
    "soft_cap_reasons",
]
