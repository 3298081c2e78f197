"""The peers: torch SDPA (a chosen backend) and compiled FlexAttention with its block masks (dense
lengths, physical pages, causal and sliding-window prefill), and the budget guard of its
compiles."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from common import PAGE

from .config import FLEX_COMPILE_COST_S, SCALE
from .meta import Meta
from .run import Run


def sdpa_fn(
    backend_name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    gqa: bool,
) -> Callable[[], torch.Tensor]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    kwargs = {"enable_gqa": True} if gqa else {}

    def call() -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=SCALE, **kwargs)

    return call


_FLEX: dict[str, Any] = {}


def flex_compiled() -> Callable[..., torch.Tensor]:
    """`torch.compile(flex_attention, dynamic=False)`: one static compile per shape family."""
    if "fn" not in _FLEX:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        cfg = torch._dynamo.config
        for name, value in (
            ("cache_size_limit", 512),
            ("recompile_limit", 512),
            ("accumulated_cache_size_limit", 4096),
            ("accumulated_recompile_limit", 4096),
        ):
            if hasattr(cfg, name):
                with contextlib.suppress(Exception):
                    setattr(cfg, name, value)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def flex_fn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any
) -> Callable[[], torch.Tensor]:
    fn = flex_compiled()

    def call() -> torch.Tensor:
        return fn(q, k, v, block_mask=block_mask, scale=SCALE, enable_gqa=True)

    return call


def _length_block_tensors(
    lens: torch.Tensor, kv_block: int, num_cols: int
) -> tuple[torch.Tensor, ...]:
    """Block lists for a query that sees keys `[0, len)`: the complete KV blocks are "full"
    (no mask_mod), a trailing incomplete one is "partial"."""
    batch = lens.numel()
    cols = torch.arange(num_cols, dtype=torch.int32, device=lens.device)
    full = (lens // kv_block).to(torch.int32)
    part = (lens % kv_block > 0).to(torch.int32)
    full_idx = cols.expand(batch, num_cols).contiguous()
    part_idx = ((cols[None, :] + full[:, None]) % num_cols).to(torch.int32)  # first = partial
    return (
        part.view(batch, 1, 1),
        part_idx.view(batch, 1, 1, num_cols),
        full.view(batch, 1, 1),
        full_idx.view(batch, 1, 1, num_cols),
    )


def flex_dense_decode_mask(lens: torch.Tensor, kv_len: int) -> Any:
    from torch.nn.attention.flex_attention import BlockMask

    def length_mask(b, h, q_idx, kv_idx):
        return kv_idx < lens[b]

    kv_block = 128
    part_n, part_i, full_n, full_i = _length_block_tensors(lens, kv_block, -(-kv_len // kv_block))
    return BlockMask.from_kv_blocks(
        part_n,
        part_i,
        full_n,
        full_i,
        BLOCK_SIZE=(128, kv_block),
        mask_mod=length_mask,
        seq_lengths=(1, kv_len),
    )


def flex_paged_decode_mask(meta: Meta, num_pages: int) -> tuple[Any, str]:
    """Block mask over physical pages (block size = PAGE) for a `[1, HKV, num_pages * PAGE, D]`
    cache. Uses torch's experimental PagedAttention when importable, else the same construction
    here: complete pages are full blocks; a trailing partial page goes through a mask_mod that maps
    the physical key index back to its logical position through an inverse page table."""
    from torch.nn.attention.flex_attention import BlockMask

    dev = meta.bt.device
    lens = meta.seq_lens.long()
    batch, width = meta.bt.shape
    cols = torch.arange(width, device=dev)
    nblk = torch.tensor(meta.nblk, device=dev)
    valid = cols[None, :] < nblk[:, None]
    rows = torch.arange(batch, device=dev)[:, None].expand(batch, width)
    bt = meta.bt.long()

    def logical_length_mask(b, h, q_idx, kv_idx):
        return kv_idx < lens[b]

    part_n, part_i, full_n, full_i = _length_block_tensors(meta.seq_lens, PAGE, width)
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
    except ImportError:
        PagedAttention = None
    if PagedAttention is not None:
        logical = BlockMask.from_kv_blocks(
            part_n,
            part_i,
            full_n,
            full_i,
            BLOCK_SIZE=(128, PAGE),
            mask_mod=logical_length_mask,
            seq_lengths=(1, width * PAGE),
        )
        pa = PagedAttention(num_pages, PAGE, batch, device=str(dev))
        pa.page_table[:, :width] = torch.where(valid, bt, torch.full_like(bt, -1))
        pa.physical_to_logical[rows[valid], bt[valid]] = cols.expand(batch, width)[valid]
        return pa.convert_logical_block_mask(logical), "torch PagedAttention"

    p2l = torch.full((batch, num_pages), -1, dtype=torch.int64, device=dev)
    p2l[rows[valid], bt[valid]] = cols.expand(batch, width)[valid]

    def paged_mask(b, h, q_idx, kv_idx):
        logical_block = p2l[b, kv_idx // PAGE]
        pos = logical_block * PAGE + kv_idx % PAGE
        return (logical_block >= 0) & (pos < lens[b])

    def physical(idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(batch, 1, 1, num_pages, dtype=torch.int32, device=dev)
        out[..., :width] = torch.gather(bt, 1, idx.view(batch, width).long()).view(
            batch, 1, 1, width
        )
        return out

    mask = BlockMask.from_kv_blocks(
        part_n,
        physical(part_i),
        full_n,
        physical(full_i),
        BLOCK_SIZE=(128, PAGE),
        mask_mod=paged_mask,
        seq_lengths=(1, num_pages * PAGE),
    )
    return mask, "own inverse-page-table mask_mod"


def flex_prefill_mask(length: int, device: torch.device, window: int | None = None) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    if window:

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

    return create_block_mask(mask_mod, None, None, length, length, device=device)


def flex_allowed(run: Run, section: str, what: str) -> str | None:
    """None if a FlexAttention compile fits the budget, else why it is skipped."""
    if run.args.no_flex:
        return "skipped (--no-flex)"
    if run.left_for(section) < FLEX_COMPILE_COST_S:
        return f"skipped: time budget ({what})"
    return None
