"""Host-side step layout and plain-torch math shared by DeepSeek-V4's cache users
(`backends/deepseek_v4_window.py` states the contract).

Everything here that takes `common` runs in `prep_forward` (host work); `partial_attention`,
`write_rows`, `attend_rows` and `attend_row_sets` only read device tensors and run in `forward`
(or the layer's one attention, `DeepseekV4WindowBackend.attend_row_sets`). `GatheredRows` is
the contract's (`backend.py`), re-exported here. `RowAttentionUser` is the base of the users
whose `forward` attends over the rows they gather.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import attrs
import torch

from unified_attn.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    GatheredRows,
    LayerConfig,
    check_dtype_device,
)


@attrs.frozen
class StepLayout:
    """The batch of one step: request i owns token rows `[qsl[i], qsl[i+1])` at positions
    `computed[i] + j`. Host tensors, except in a CUDA-graph step (`padded`), where they are
    device tensors computed from the step's device fields: every request row has
    `query_len` tokens and rows with `seq_lens` 0 are padding (`live` False)."""

    request: torch.Tensor  # [T] int64: the request of each token row
    positions: torch.Tensor  # [T] int64
    computed: torch.Tensor  # [B] int64: tokens cached before the step
    seq_lens: torch.Tensor  # [B] int64: computed + new
    padded: bool = False  # a CUDA-graph step (device tensors, fixed shapes)
    query_len: int = 0  # padded: tokens of every request row

    @property
    def num_tokens(self) -> int:
        return int(self.request.shape[0])

    @property
    def live(self) -> torch.Tensor:
        """[T] bool: the token belongs to a request (False: a padding row, of length 0)."""
        return (self.seq_lens > 0)[self.request]

    @property
    def device(self) -> torch.device:
        return self.request.device


def step_layout(common: CommonAttentionMetadata) -> StepLayout:
    if common.graph_step:
        return _padded_layout(common)
    num_reqs = common.num_reqs
    qsl = common.query_start_loc_cpu[: num_reqs + 1].long()
    request = torch.repeat_interleave(torch.arange(num_reqs), qsl[1:] - qsl[:-1])
    computed = common.num_computed_tokens_cpu[:num_reqs].long()
    rows = torch.arange(request.shape[0])
    positions = computed[request] + rows - qsl[request]
    return StepLayout(request, positions, computed, common.seq_lens_cpu[:num_reqs].long())


def _padded_layout(common: CommonAttentionMetadata) -> StepLayout:
    """A CUDA-graph step's layout from its device fields alone (no host value changes between
    replays): `num_reqs` rows of `max_query_len` tokens each."""
    num_reqs, q = common.num_reqs, common.max_query_len
    num_tokens = num_reqs * q
    device = common.positions.device
    request = torch.arange(num_tokens, device=device) // q
    seq_lens = common.seq_lens[:num_reqs].long()
    return StepLayout(request, common.positions[:num_tokens].long(), seq_lens - q, seq_lens,
                      padded=True, query_len=q)  # fmt: skip


def closing_windows(
    layout: StepLayout, rate: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(request [N], window index [N], live [N] bool) of every compression window that closes
    in this step, by request then window: window w covers tokens `[w * rate, (w + 1) * rate)`
    and closes when its last token is computed, so request i closes `[computed_i // rate,
    seq_len_i // rate)`. Every cache user of one rate enumerates windows in this order.

    Host tensors, all live, except in a CUDA-graph step: there N is fixed at `ceil(q / rate)`
    windows per request row (no more can close in q tokens), in order, and the ones that do not
    close (`live` False) have window 0: their rows read nothing and their entries go to the
    null block."""
    if layout.padded:
        per = -(-layout.query_len // rate)
        slot = torch.arange(layout.seq_lens.shape[0] * per, device=layout.device)
        request = slot // per
        window = (layout.computed // rate)[request] + slot % per
        seq_lens = layout.seq_lens[request]
        live = (seq_lens > 0) & (window < seq_lens // rate)
        return request, torch.where(live, window, 0), live
    first, end = layout.computed // rate, layout.seq_lens // rate
    counts = end - first
    request = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    starts = torch.cumsum(counts, 0) - counts
    window = first[request] + torch.arange(request.shape[0]) - starts[request]
    return request, window, torch.ones(request.shape[0], dtype=torch.bool)


class PlannedOnDevice:
    """Mixin of DeepSeek-V4's cache users: a CUDA-graph step's plan (`step_layout` of a
    `graph_step`) is device work on the step's device fields alone, so decode steps are
    captured with their planning inside the graph."""

    @classmethod
    def supports_cuda_graphs(cls) -> bool:
        return True

    @classmethod
    def plans_inside_cuda_graphs(cls) -> bool:
        return True


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor of the plan on `device`: an asynchronous copy (from pageable memory it is
    staged at once), so the host never waits for the device's queue."""
    return t.to(device, non_blocking=True)


def device_lookup(
    table: torch.Tensor,
    request: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, offset in block) device int64 of token `positions` of `request` rows (host
    int64, broadcastable) in the device block table `[B, max_blocks]`: the index math on the
    host, the table read on the device, so the table is never copied back. Negative positions
    read block column 0 (callers mask them)."""
    safe = positions.clamp(min=0)
    rows, columns = torch.broadcast_tensors(request, safe // block_size)
    blocks = table[on_device(rows, device), on_device(columns, device)].long()
    return blocks, on_device(safe % block_size, device)


def slot_writes(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) device int64 where each token row's new data goes: its slot (device
    `[T]` int64) in blocks of `block_size`, or block 0, the null block no reader takes data from,
    for a row without one (-1). Every row is written: no data-dependent shape, no host sync."""
    valid = slots >= 0
    return torch.where(valid, slots // block_size, 0), torch.where(valid, slots % block_size, 0)


def group_ids(backend: AttentionBackend) -> list[int]:
    """The KV-cache groups of a backend's layers, in first-seen order."""
    return list(dict.fromkeys(backend.group_of_layer.values()))


def block_size_of(
    backend: AttentionBackend, common: CommonAttentionMetadata, gid: int, tokens_per_row: int
) -> int:
    """Tokens per block of group `gid`: the runner's `block_sizes`, else read off a bound view
    whose dim 1 holds `block_size // tokens_per_row` rows (latent and compressed views)."""
    if gid in common.block_sizes:
        return common.block_sizes[gid]
    for name, group in backend.group_of_layer.items():
        if group == gid:
            return int(backend.kv_caches[name].shape[1]) * tokens_per_row
    raise KeyError(f"{backend.name}: no layer of this backend is in KV-cache group {gid}")


# ---- device math (forward) -------------------------------------------------------------------


def write_rows(
    cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor
) -> None:
    """`cache[blocks[i], offsets[i]] = rows[i]` for a `[num_blocks, rows_per_block, width]`
    cache (device tensors; every index is valid)."""
    cache[blocks, offsets] = rows.to(cache.dtype)


def partial_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Shared-KV attention of q `[T, H, D]` over its own keys `[T, S, D]` (the keys are the
    values) where `visible [T, S]`, in float32: `out [T, H, D]` gets the softmax-weighted keys
    and `lse [T, H]` the log-sum-exp of the visible scores (-inf and a zero output where a row
    sees no key), so partials over disjoint key sets merge exactly (`merge_partials`)."""
    keys = keys.float().masked_fill(~visible[:, :, None], 0.0)  # stale blocks may hold NaN bits
    scores = torch.einsum("thd,tsd->ths", q.float(), keys) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    row_lse = torch.logsumexp(scores, dim=-1)  # [T, H]
    probs = torch.exp(scores - row_lse[:, :, None]).masked_fill(~visible[:, None, :], 0.0)
    out.copy_(torch.einsum("ths,tsd->thd", probs, keys).to(out.dtype))
    lse.copy_(row_lse)


def attend_rows(
    q: torch.Tensor,
    cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """`partial_attention` of q `[T, H, D]` over each token's own cache rows
    `cache[blocks[t, s], offsets[t, s]]` where `visible [T, S]`: the attention the `swa` and
    `compressed` users run, and the seam a kernel backend replaces (same signature:
    `triton.v4_ops.gathered_attention`)."""
    partial_attention(q, cache[blocks, offsets], visible, scale, out, lse)


def merge_partials(
    partials: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor
) -> torch.Tensor:
    """One softmax over the union of the partials' keys plus one sink logit per head (mass
    without a value): partials `(out [T, H, D], lse [T, H])`, `sinks [H]` -> `[T, H, D]`
    float32. A partial with no key has lse -inf and weighs nothing."""
    sink = sinks.float()
    lses = torch.stack([lse for _, lse in partials])  # [P, T, H]
    top = torch.maximum(lses.amax(0), sink)  # finite: the sink is
    weights = torch.exp(lses - top)
    total = weights.sum(0) + torch.exp(sink - top)
    out = torch.zeros_like(partials[0][0], dtype=torch.float32)
    for weight, (partial, _) in zip(weights, partials, strict=True):
        out += weight[:, :, None] * partial.float()
    return out / total[:, :, None]


def attend_row_sets(
    q: torch.Tensor,
    row_sets: Sequence[GatheredRows],
    scale: float,
    sinks: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The V4 layer's attention: one softmax of q `[T, H, D]` over every set's rows plus the
    learned `sinks [H]` (a logit per head without a value), into `out [T, H, D]` (q's dtype).
    Computed as transformers does it in effect: a partial softmax per set (`attend_rows`, each
    output rounded to q's dtype), merged in float32 (`merge_partials`). The seam a kernel
    backend replaces (same signature: `triton.v4_ops.gathered_attention_sets`)."""
    partials = []
    for rows in row_sets:
        part = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        attend_rows(q, rows.cache, rows.blocks, rows.offsets, rows.visible, scale, part, lse)
        partials.append((part, lse))
    out.copy_(merge_partials(partials, sinks).to(out.dtype))


class TokenPlan(Protocol):
    @property
    def num_tokens(self) -> int:
        """Token rows with data in the step (T)."""
        ...


TokenPlanT = TypeVar("TokenPlanT", bound=TokenPlan)


class RowAttentionUser(PlannedOnDevice, AttentionBackend[TokenPlanT]):
    """A cache user whose queries attend over the rows it gathers (the `swa` and `compressed`
    users): `partial_forward` is its `forward`, the partial softmax over those rows alone.
    A subclass also names `AttentionBackend[MyPlan]` among its bases (where the contract reads
    the plan type)."""

    # the attention over each token's rows (a kernel backend replaces it)
    attend_rows = staticmethod(attend_rows)
    gather_rows: Callable[..., GatheredRows]  # the subclass's `RowSource.gather_rows`

    def partial_forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        lse: torch.Tensor | None,
        selection: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Check `output [T, H * D]` and `lse [T, H]` (float32) before anything is written, then
        `gather_rows` (which writes `key`) and attend with `query [T, H, D]` into both."""
        n, heads, width = self.current_plan().num_tokens, layer.num_heads, self.head_size
        check_tensor(layer, "output", output, (n, heads * width), self.dtype, query.device)
        if lse is None:
            raise ValueError(f"layer {layer.name}: forward needs lse=[T, H] float32")
        check_tensor(layer, "lse", lse, (n, heads), torch.float32, query.device)
        rows = self.gather_rows(layer, query, key, selection)
        out = output.view(n, heads, width)
        self.attend_rows(query, rows.cache, rows.blocks, rows.offsets, rows.visible,
                         layer.scale, out, lse)  # fmt: skip
        return output


# ---- the lightning indexer: scores and top-k (forward) -------------------------------------------


def index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    request: torch.Tensor,
    num_visible: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """The lightning indexer's scores, in float32: `out[t, e] = sum_h weights[t, h] *
    relu(q[t, h] . k[e]) * scale` for every entry e of token t's request (`k[e] =
    cache[blocks[request[t], e], offsets[e]]`) that the token sees (`e < num_visible[t]`), -inf
    for the others; q `[T, H, D]`, weights `[T, H]` float32, out `[T, E]` float32. The seam a
    kernel backend replaces (same signature: `triton.v4_ops.indexer_scores`)."""
    entries = torch.arange(out.shape[1], device=out.device)
    visible = entries < num_visible[:, None]  # [T, E]
    keys = cache[blocks, offsets][request].float()  # [T, E, D]
    keys = keys.masked_fill(~visible[:, :, None], 0.0)  # stale blocks may hold NaN bits
    scores = torch.relu(torch.einsum("thd,ted->the", q.float(), keys)) * scale
    scores = (scores * weights[:, :, None]).sum(dim=1)
    out.copy_(scores.masked_fill(~visible, float("-inf")))


def top_entries(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices `[T, k]` of the `k` best entries of each row of `scores [T, E]` (float32),
    best first, equal scores broken toward the lower entry index. `torch.topk` breaks ties by
    its own algorithm, which depends on `E` (the longest request of the step): exact ties are
    common (`relu` zeroes every head's score of an entry), so a request's picks, and its
    logits, would change with its neighbours. Each score becomes one distinct int64 key (its
    float32 order in the high word, the reversed index in the low word) and topk ranks those;
    -0.0 and 0.0 count as equal."""
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # monotone in the float
    entries = torch.arange(scores.shape[-1], device=scores.device)
    keys = ordered * (1 << 32) + ((1 << 32) - 1 - entries)
    return keys.topk(k, dim=-1).indices


def check_tensor(
    layer: LayerConfig,
    what: str,
    tensor: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """`ValueError` naming the layer, the tensor, and the expected and found shape/dtype/device
    (`shape` entries of -1 match any size)."""
    found = tuple(tensor.shape)
    if len(found) != len(shape) or any(e not in (-1, f) for e, f in zip(shape, found, strict=True)):
        raise ValueError(
            f"layer {layer.name}: {what} has shape {found}, expected {shape} (-1: any); see "
            "unified_attn.backends.deepseek_v4_window for what each DeepSeek-V4 cache user takes"
        )
    check_dtype_device(layer, what, tensor, dtype, device)
