"""Launchers of the gathered shared-KV attention kernels (DeepSeek-V4's window and compressed
caches): `gathered_attention` (one set of rows, a partial softmax) and
`gathered_attention_sets` (the layer's one softmax over several sets and the sinks)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
import triton

from unified_attn.backends.deepseek_v4_steps import GatheredRows, merge_partials
from unified_attn.backends.triton.ops import (
    SM90_SHARED_BYTES,
    SUPPORTED_DTYPES,
    is_sm90,
    num_multiprocessors,
    rows_16_byte_aligned,
)
from unified_attn.kernels.attention.merge_partials import merge_partials_kernel
from unified_attn.kernels.sparse.gathered_attention import gathered_attention_kernel
from unified_attn.kernels.sparse.gathered_attention_sm90 import (
    gathered_attention_sm90_kernel,
)
from unified_attn.utils import int_in, power_of_two

INDEX_DTYPES = (torch.int32, torch.int64)
SM90_WIDTHS = (128, 256, 512)  # the widths its GPU tests cover


@attrs.frozen
class GatherConfig:
    # query heads per program; the programs of one token share its rows through L2
    heads: int = attrs.field(validator=power_of_two(16))
    tile: int = attrs.field(validator=power_of_two(16))  # rows per loop iteration
    num_warps: int = attrs.field(validator=power_of_two(1))
    num_stages: int = attrs.field(validator=int_in(1))
    index_ahead: bool = True  # load the next tile's list entries while this tile is used
    max_registers: int | None = None  # per thread (Triton's `maxnreg`): more programs per SM
    # parts of each token's list on their own programs, merged after; 0: auto
    splits: int = attrs.field(default=1, validator=int_in(0))


@attrs.frozen
class Sm90GatherConfig:
    """The Hopper kernel (`kernels/gathered_attention_sm90.py`): 64 heads and 8 warps per
    program; rows per tile, buffers in the ring, splits of each list (0: auto) and programs per
    token and head group, each computing the scores and half the outputs (0: auto, 2 when the
    tokens' head groups fill at most half the SMs). The defaults are the fastest
    `benchmarks/v4_decode.py --sweep` measured on an H100 at the V4 decode shape: halves fill
    the idle SMs for the price of computing the scores twice, where splitting a list (and
    merging) cost more than it saved."""

    tile: int = attrs.field(default=64, validator=power_of_two(16))
    num_stages: int = attrs.field(default=2, validator=int_in(2))  # one loads, one is used
    splits: int = attrs.field(default=1, validator=int_in(0))
    halves: int = attrs.field(default=0, validator=int_in(0, 2))

    def shared_bytes(self, width: int, itemsize: int = 2) -> int:
        """Shared memory of one program: the query, the ring of row tiles and the
        probabilities."""
        return itemsize * (64 * width + self.num_stages * self.tile * width + 64 * self.tile)


def sm90_eligible(q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor) -> bool:
    """The Hopper kernel serves 16-bit queries on an sm90 device whose rows, query and output
    rows start on 16-byte boundaries (its copies move 16 bytes)."""
    if not is_sm90(q.device):
        return False
    sixteen_bit = q.dtype in (torch.float16, torch.bfloat16)
    contiguous = q.stride(2) == out.stride(2) == 1
    return (
        sixteen_bit
        and q.shape[2] in SM90_WIDTHS
        and contiguous
        and rows_16_byte_aligned(q, cache, out)
    )


def gather_config(width: int, num_heads: int) -> GatherConfig:
    """Wide rows (V4's 512) take 32 heads per program, 64-row tiles, 8 warps and 3 stages: the
    fastest of the configurations `benchmarks/v4_decode.py --sweep` times on an H100 at the V4
    decode shape (64 heads: two programs per token share its rows through L2; 64 heads per
    program hold the whole query and accumulator in registers, one program per token). Narrow
    rows keep every head (up to 32) in one program with 32-row tiles."""
    heads = min(32, max(16, triton.next_power_of_2(num_heads)))
    if width > 128:
        return GatherConfig(heads, 64, 8, 3)
    return GatherConfig(heads, 32, 4, 2)


def gathered_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    config: GatherConfig | Sm90GatherConfig | None = None,
) -> None:
    """Attention of `q [T, H, D]` over the cache rows `cache[blocks[t, s], offsets[t, s]]`
    (`[num_blocks, block_size, D]`; key = value) where `visible [T, S]` (bool): the normalised
    output into `out [T, H, D]` (q's dtype) and the log-sum-exp of the visible scores into
    `lse [T, H]` (float32; -inf and a zero output for a token that sees no row). Same result as
    `deepseek_v4_steps.partial_attention` over the gathered rows. On an sm90 GPU with 16-bit
    data the Hopper kernel runs (`sm90_eligible`), elsewhere the portable one; `config` picks
    one and its configuration (benchmarks/v4_decode.py --sweep)."""
    num_tokens, num_heads, width = q.shape
    blocks, offsets, valid = checked_rows(q, cache, blocks, offsets, visible, out)
    if out.shape != q.shape or lse.shape != (num_tokens, num_heads) or lse.dtype != torch.float32:
        raise ValueError(
            f"gathered attention: out must be {tuple(q.shape)} and lse [{num_tokens}, "
            f"{num_heads}] float32, got {tuple(out.shape)} and {tuple(lse.shape)} {lse.dtype}"
        )
    if num_tokens == 0:
        return
    q = q if q.stride(-1) == 1 else q.contiguous()
    if blocks.shape[1] == 0:  # no row for any token
        out.zero_()
        lse.fill_(float("-inf"))
        return
    hopper = sm90_eligible(q, cache, out)
    if isinstance(config, Sm90GatherConfig) and not hopper:
        raise ValueError(
            "gathered attention: Sm90GatherConfig needs an sm90 GPU, 16-bit data, a head size "
            f"of {SM90_WIDTHS} and 16-byte aligned rows; got {q.dtype} {tuple(q.shape)} on "
            f"{q.device}; pass a GatherConfig or none"
        )
    cfg = config or (Sm90GatherConfig() if hopper else gather_config(width, num_heads))
    if isinstance(cfg, Sm90GatherConfig) and cfg.shared_bytes(width) + 1024 > SM90_SHARED_BYTES:
        raise ValueError(
            f"gathered attention: {cfg} needs {cfg.shared_bytes(width)} bytes of shared memory "
            f"(plus about 1 KiB of scratch) at head size {width}, more than the "
            f"{SM90_SHARED_BYTES} an sm90 program has; use fewer stages or a smaller tile"
        )
    heads = 64 if isinstance(cfg, Sm90GatherConfig) else cfg.heads
    groups, num_rows = triton.cdiv(num_heads, heads), blocks.shape[1]
    splits = cfg.splits or auto_splits(num_tokens * groups, num_rows, cfg.tile, q.device)
    segment = triton.cdiv(triton.cdiv(num_rows, splits), cfg.tile) * cfg.tile
    splits = triton.cdiv(num_rows, segment)  # none empty
    part_out = part_lse = lse  # placeholders, not written without a split
    if splits > 1:
        part_out = q.new_empty(num_tokens, num_heads, splits, width, dtype=torch.float32)
        part_lse = q.new_empty(num_tokens, num_heads, splits, dtype=torch.float32)
    halves = 1
    if isinstance(cfg, Sm90GatherConfig):
        fits = 2 * num_tokens * groups * splits <= num_multiprocessors(q.device)
        halves = cfg.halves or (2 if fits else 1)
    grid = (groups * halves, splits, num_tokens)  # a token's programs adjacent
    args = (out, lse, q, cache, blocks, offsets, valid, part_out, part_lse, scale, num_heads,
            num_rows, segment, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            cache.stride(0), cache.stride(1), blocks.stride(0))  # fmt: skip
    if isinstance(cfg, Sm90GatherConfig):
        no_list_b = (0, blocks, offsets, valid, 0, 0, 0, 0, lse, lse)  # TWO_LISTS / SINKS only
        gathered_attention_sm90_kernel[grid](
            *args, *no_list_b, D=width, TILE=cfg.tile, STAGES=cfg.num_stages,
            SPLIT=splits > 1, HALVES=halves, num_warps=8,
        )  # fmt: skip
    else:
        gathered_attention_kernel[grid](
            *args, BH=cfg.heads, D=width, TILE=cfg.tile,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            INDEX_AHEAD=cfg.index_ahead, SPLIT=splits > 1,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.max_registers,
        )  # fmt: skip
    if splits > 1:
        merge_partials_kernel[(num_tokens, num_heads)](
            out, lse, part_out, part_lse, num_heads, splits, out.stride(0), out.stride(1),
            D=width, PARTS_PAD=triton.next_power_of_2(splits), WRITE_LSE=True,
        )  # fmt: skip


def checked_rows(
    q: torch.Tensor,
    cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    visible: torch.Tensor,
    out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lists of one set of rows as the kernels read them (contiguous blocks and offsets,
    visibility as uint8), after checking them against `q [T, H, D]`, the cache and `out`;
    ValueError naming what is wrong."""
    num_tokens, _, width = q.shape
    if q.dtype not in SUPPORTED_DTYPES or cache.dtype != q.dtype or out.dtype != q.dtype:
        raise ValueError(
            f"gathered attention: q, cache and out must share one dtype of {SUPPORTED_DTYPES}, "
            f"got {q.dtype}, {cache.dtype}, {out.dtype}"
        )
    check_row_cache("gathered attention", cache, width)
    lists = (blocks, offsets, visible)
    if any(t.shape != blocks.shape or t.dim() != 2 or t.shape[0] != num_tokens for t in lists):
        raise ValueError(
            f"gathered attention: blocks, offsets and visible must be [{num_tokens}, S], got "
            f"{[tuple(t.shape) for t in lists]}"
        )
    kinds = (blocks.dtype, offsets.dtype, visible.dtype)
    if kinds[0] not in INDEX_DTYPES or kinds[1] != kinds[0] or kinds[2] != torch.bool:
        raise ValueError(
            f"gathered attention: blocks and offsets must share one dtype of {INDEX_DTYPES} and "
            f"visible must be torch.bool, got {kinds}"
        )
    # no copy when they are contiguous already
    return blocks.contiguous(), offsets.contiguous(), visible.contiguous().view(torch.uint8)


def check_row_cache(what: str, cache: torch.Tensor, width: int) -> None:
    """A paged cache of rows `[num_blocks, rows_per_block, width]` (contiguous features, a
    power-of-two width >= 16), as the gathering kernels read it; ValueError otherwise."""
    if cache.dim() != 3 or cache.shape[2] != width or cache.stride(2) != 1:
        raise ValueError(
            f"{what}: cache must be [num_blocks, rows_per_block, {width}] with contiguous "
            f"features, got {tuple(cache.shape)} strides {cache.stride()}"
        )
    if width < 16 or width & (width - 1):
        raise ValueError(f"{what}: head size {width} is not a power of two >= 16")


def gathered_attention_sets(
    q: torch.Tensor,
    row_sets: Sequence[GatheredRows],
    scale: float,
    sinks: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """One softmax of `q [T, H, D]` over every set's rows plus the learned `sinks [H]` (a logit
    per head without a value), into `out [T, H, D]` (q's dtype): DeepSeek-V4's layer attention,
    the same result as `deepseek_v4_steps.attend_row_sets`. On an sm90 GPU with 16-bit data,
    one or two sets run as one launch of the Hopper kernel (list A's tiles, then list B's, one
    online softmax, the sinks folded into its denominator: no partials, no merge); otherwise
    each set runs `gathered_attention` and the partials are merged with the sinks."""
    num_tokens, num_heads, width = q.shape
    if not row_sets:
        raise ValueError("gathered attention: at least one set of rows is needed")
    if out.shape != q.shape or sinks.shape != (num_heads,) or sinks.device != q.device:
        raise ValueError(
            f"gathered attention: out must be {tuple(q.shape)} and sinks [{num_heads}] on "
            f"{q.device}, got {tuple(out.shape)} and {tuple(sinks.shape)} on {sinks.device}"
        )
    lists = [checked_rows(q, r.cache, r.blocks, r.offsets, r.visible, out) for r in row_sets]
    for r in row_sets:
        lengths = r.lengths
        if lengths is not None and (lengths.shape != (num_tokens,) or lengths.dtype not in
                                    INDEX_DTYPES or lengths.device != q.device):  # fmt: skip
            raise ValueError(
                f"gathered attention: a set's lengths must be [{num_tokens}] of {INDEX_DTYPES} "
                f"on {q.device}, got {tuple(lengths.shape)} {lengths.dtype} on {lengths.device}"
            )
    if num_tokens == 0:
        return
    q = q if q.stride(-1) == 1 else q.contiguous()
    one_launch = (
        len(row_sets) <= 2
        and all(sm90_eligible(q, r.cache, out) for r in row_sets)
        and len({blocks.dtype for blocks, _, _ in lists}) == 1
    )
    if not one_launch:
        partials = []
        for r in row_sets:
            part = torch.empty_like(q)
            lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
            gathered_attention(q, r.cache, r.blocks, r.offsets, r.visible, scale, part, lse)
            partials.append((part, lse))
        out.copy_(merge_partials(partials, sinks).to(out.dtype))
        return
    sinks = sinks.contiguous()  # read as [H] with stride 1 (no copy when it is)
    cfg = Sm90GatherConfig()
    groups = triton.cdiv(num_heads, 64)
    halves = 2 if 2 * num_tokens * groups <= num_multiprocessors(q.device) else 1
    (blocks, offsets, valid), cache = lists[0], row_sets[0].cache
    b_blocks, b_offsets, b_valid = lists[-1]
    b_cache, b_lengths = row_sets[-1].cache, row_sets[-1].lengths
    b_cache_off = (b_cache.data_ptr() - cache.data_ptr()) // cache.element_size()
    two_lists = len(row_sets) == 2
    gathered_attention_sm90_kernel[(groups * halves, 1, num_tokens)](
        out, sinks, q, cache, blocks, offsets, valid, out, sinks, scale, num_heads,
        blocks.shape[1], blocks.shape[1], q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), cache.stride(0), cache.stride(1), blocks.stride(0),
        b_cache_off, b_blocks, b_offsets, b_valid, b_blocks.shape[1], b_cache.stride(0),
        b_cache.stride(1), b_blocks.stride(0), sinks,
        sinks if b_lengths is None else b_lengths.contiguous(),
        D=width, TILE=cfg.tile, STAGES=cfg.num_stages, SPLIT=False, HALVES=halves,
        TWO_LISTS=two_lists, SINKS=True, B_LENGTHS=two_lists and b_lengths is not None,
        num_warps=8,
    )  # fmt: skip


def auto_splits(programs: int, num_rows: int, tile: int, device: torch.device) -> int:
    """Parts per list so that the launch fills the SMs about once: 1 when the tokens' head groups
    already do (prefill), never a part under one tile."""
    fill = num_multiprocessors(device) // max(programs, 1)
    return max(1, min(fill, triton.cdiv(num_rows, tile)))
