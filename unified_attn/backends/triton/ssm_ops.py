"""Launchers of the Mamba-2 state-layer kernels (`kernels/ssm`): the causal convolution and the
SSD scan, for a batch of requests over pools of state blocks.

Every request r owns rows `query_start_loc[r] : query_start_loc[r + 1]` (prefill) or row r
(decode), reads its state from block `read_slots[r]` (-1: zeros) and writes the new state to
block `write_slots[r]` (-1: not written); the two may be equal, but a block one request writes
(final state or checkpoint) must not be read or written by another request of the same call
(requests run concurrently). Slots, row starts and offsets stay on the device: no launcher
synchronises with the host, and the decode launchers (`causal_conv1d_update`,
`ssd_state_update`) can be captured in a CUDA graph. The math is `backends/mamba_math.py`'s,
per request.
"""

from __future__ import annotations

import math

import attrs
import torch
import triton

from unified_attn.backends.triton.ssm_checks import (
    FLOAT_DTYPES,
    check_chunk_size,
    check_dt_limit,
    check_groups,
    check_head_params,
    check_slots,
    check_state_pool,
    check_tensor,
)
from unified_attn.kernels.launch import fast_launchers
from unified_attn.kernels.pdl import pdl_enabled
from unified_attn.kernels.ssm import conv1d as conv1d_jit
from unified_attn.kernels.ssm import ssd_chunked as ssd_chunked_jit
from unified_attn.kernels.ssm import ssd_update as ssd_update_jit

INT32 = (torch.int32,)
# Tiles from benchmarks/tune_ssm_conv.py on an H200 (bf16, 10,240 channels): 16-row prefill
# tiles beat 32-row ones by 20-25% at 2k-8k tokens.
CONV_BLOCK_T, CONV_BLOCK_C, CONV_WARPS = 16, 128, 4
# the kernels past Triton's Python dispatch (kernels/launch.py): prefill steps launch six per
# state layer
conv1d = fast_launchers(conv1d_jit)
ssd_chunked = fast_launchers(ssd_chunked_jit)
ssd_update = fast_launchers(ssd_update_jit)


def conv_update_tiles(num_requests: int) -> tuple[int, int]:
    """(BLOCK_C, num_warps) of the one-token convolution (H200, bf16, 10,240 channels, PDL):
    256-channel tiles below 64 requests (batch 1: 1.9 -> 1.6 us against 512), 512 to 127,
    narrow one-warp programs from 128 (64: 8.5 -> 5.8 us, 256: 27 -> 16 us)."""
    if num_requests >= 128:
        return 128, 1
    return (512, 4) if num_requests >= 64 else (256, 4)


def causal_conv1d_varlen(
    x: torch.Tensor,
    query_start_loc: torch.Tensor,
    conv_states: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """SiLU(depthwise causal conv) of each request's rows after its carried inputs.

    x `[T, C]`, query_start_loc `[R + 1]` int32, conv_states `[num_blocks, K - 1, C]` (x's
    dtype), read/write slots `[R]` int32, weight `[C, K]`, bias `[C]` or None -> y `[T, C]`
    in x's dtype. conv_states[write_slots[r]] := the last K - 1 inputs of request r (carried
    ones included when it has fewer than K - 1 rows). Two launches: outputs, then states."""
    op = "causal_conv1d_varlen"
    num_requests = _check_conv(op, x, conv_states, read_slots, write_slots, weight, bias,
                               query_start_loc.shape[0] - 1)  # fmt: skip
    check_tensor(op, "query_start_loc", query_start_loc, (num_requests + 1,), INT32, x.device)
    num_tokens, channels = x.shape
    width = weight.shape[1]
    y = torch.empty_like(x)
    if num_requests == 0:
        return y
    if num_tokens:
        grid = (triton.cdiv(num_tokens, CONV_BLOCK_T), triton.cdiv(channels, CONV_BLOCK_C))
        conv1d.causal_conv1d_varlen_kernel[grid](
            x, y, query_start_loc, conv_states, read_slots, weight,
            weight if bias is None else bias, num_tokens, num_requests, channels,
            x.stride(0), y.stride(0), conv_states.stride(0), conv_states.stride(1),
            weight.stride(0), weight.stride(1), KERNEL_WIDTH=width, HAS_BIAS=bias is not None,
            SEARCH_STEPS=num_requests.bit_length(), BLOCK_T=CONV_BLOCK_T, BLOCK_C=CONV_BLOCK_C,
            num_warps=CONV_WARPS,
        )  # fmt: skip
    conv1d.conv_state_write_kernel[(num_requests, triton.cdiv(channels, CONV_BLOCK_C))](
        x, query_start_loc, conv_states, read_slots, write_slots, channels, x.stride(0),
        conv_states.stride(0), conv_states.stride(1), KERNEL_WIDTH=width,
        STATE_ROWS=_state_rows(width), BLOCK_C=CONV_BLOCK_C,
    )  # fmt: skip
    return y


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Decode: one new row per request, x `[R, C]` -> y `[R, C]`; the states shift by one
    row. One launch, graph-capturable. Same contract as `causal_conv1d_varlen` with one row
    per request."""
    op = "causal_conv1d_update"
    num_requests = _check_conv(op, x, conv_states, read_slots, write_slots, weight, bias,
                               x.shape[0])  # fmt: skip
    channels, width = weight.shape
    y = torch.empty_like(x)
    if num_requests:
        block_c, num_warps = conv_update_tiles(num_requests)
        conv1d.causal_conv1d_update_kernel[(num_requests, triton.cdiv(channels, block_c))](
            x, y, conv_states, read_slots, write_slots, weight, weight if bias is None else bias,
            channels, x.stride(0), y.stride(0), conv_states.stride(0), conv_states.stride(1),
            weight.stride(0), weight.stride(1), KERNEL_WIDTH=width,
            STATE_ROWS=_state_rows(width), HAS_BIAS=bias is not None, BLOCK_C=block_c,
            num_warps=num_warps, launch_pdl=pdl_enabled(x.device),
        )  # fmt: skip
    return y


def ssd_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    ssm_states: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> torch.Tensor:
    """Decode: one token per request through the SSD recurrence.

    x `[R, H, P]`, dt `[R, H]` raw (before softplus), dt_bias / A / D `[H]` float32, B and C
    `[R, G, N]`, ssm_states `[num_blocks, H, P, N]` float32 -> y `[R, H, P]` in x's dtype
    (`S C + D x` with the new state S). One launch, graph-capturable."""
    op = "ssd_state_update"
    num_requests, num_heads, head_dim, num_groups, state_dim = _check_ssd(
        op, x, dt, dt_bias, A, B, C, D, ssm_states
    )
    check_slots(op, "read_slots", read_slots, num_requests, x.device)
    check_slots(op, "write_slots", write_slots, num_requests, x.device)
    low, high = check_dt_limit(op, dt_limit)
    y = torch.empty_like(x)
    if num_requests:
        block_p, num_warps = state_update_tiles(head_dim, state_dim)
        launch_state_update(x, dt, dt_bias, A, B, C, D, ssm_states, read_slots, write_slots,
                            y, low, high, num_heads // num_groups, block_p, num_warps)  # fmt: skip
    return y


def state_update_tiles(head_dim: int, state_dim: int) -> tuple[int, int]:
    """(BLOCK_P, num_warps) of the decode update: `[BLOCK_P, N]` float32 tiles of ~4 KiB, many
    programs in flight (a memory-bound stream; H200, Nemotron-H heads, batch 64-256: 8 x 128
    tiles 0.95-0.97 of the copy bandwidth, 16 x 128 0.92-0.94, 32 x 128 0.91-0.93)."""
    block_p = max(1, min(triton.next_power_of_2(head_dim), 1024 // _pow2(state_dim)))
    return block_p, 4


def launch_state_update(
    x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
    C: torch.Tensor, D: torch.Tensor, ssm_states: torch.Tensor, read_slots: torch.Tensor,
    write_slots: torch.Tensor, y: torch.Tensor, dt_min: float, dt_max: float,
    heads_per_group: int, block_p: int, num_warps: int,
) -> None:  # fmt: skip
    """The decode kernel with explicit tiles, unchecked (`ssd_state_update` checks; the
    benchmark sweeps tiles through this)."""
    num_requests, num_heads, head_dim = x.shape
    state_dim = B.shape[2]
    grid = (num_requests * num_heads * triton.cdiv(head_dim, block_p),)
    ssd_update.ssd_state_update_kernel[grid](
        x, dt, dt_bias, A, B, C, D, y, ssm_states, read_slots, write_slots, dt_min, dt_max,
        num_heads,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0),
        C.stride(1), y.stride(0), y.stride(1), ssm_states.stride(0), ssm_states.stride(1),
        ssm_states.stride(2), HEADS_PER_GROUP=heads_per_group, HEAD_DIM=head_dim,
        STATE_DIM=state_dim, BLOCK_P=block_p, BLOCK_N=_pow2(state_dim), num_warps=num_warps,
        launch_pdl=pdl_enabled(x.device),
    )  # fmt: skip


def ssd_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    query_start_loc: torch.Tensor,
    offsets: torch.Tensor,
    ssm_states: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    chunk_size: int,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    checkpoint_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill: each request's rows through the chunked SSD scan.

    x `[T, H, P]`, dt `[T, H]` raw, dt_bias / A / D `[H]` float32, B and C `[T, G, N]`,
    query_start_loc `[R + 1]` and offsets `[R]` int32 (tokens each request had before), the
    state pool `[num_blocks, H, P, N]` float32 -> y `[T, H, P]` in x's dtype (scan + D x).
    Chunks end at absolute multiples of `chunk_size`, as `mamba_math.ssd_scan(offset=...)`.

    checkpoint_slots `[R, M]` int32: entry j of request r receives the state after absolute
    position `(offsets[r] // chunk_size + 1 + j) * chunk_size`, the j-th multiple of
    chunk_size after its offset, if that position is within its new rows (`<= offsets[r] +
    rows`); -1 or a position past the rows: nothing written. (A block-aligned prefix cache
    fills the entries whose positions are multiples of its block size.)

    Scratch: `min(T, T // chunk_size + 2 R) + R` chunk states of `H * P * N` float32 each."""
    op = "ssd_scan_varlen"
    _check_ssd(op, x, dt, dt_bias, A, B, C, D, ssm_states)
    num_requests = query_start_loc.shape[0] - 1
    for name, t in (("query_start_loc", query_start_loc), ("offsets", offsets)):
        check_tensor(op, name, t, (num_requests + (name == "query_start_loc"),), INT32, x.device)
    check_slots(op, "read_slots", read_slots, num_requests, x.device)
    check_slots(op, "write_slots", write_slots, num_requests, x.device)
    if checkpoint_slots is not None:
        check_tensor(op, "checkpoint_slots", checkpoint_slots, (num_requests, None), INT32,
                     x.device, unit_stride=True)  # fmt: skip
    check_chunk_size(op, chunk_size)
    low, high = check_dt_limit(op, dt_limit)
    y = torch.empty_like(x)
    if num_requests:
        _launch_scan(
            x, dt, dt_bias, A, B, C, D, query_start_loc, offsets, ssm_states, read_slots,
            write_slots, checkpoint_slots, chunk_size, low, high, y,
        )  # fmt: skip
    return y


@attrs.frozen
class ScanTiles:
    """Tiles of the chunked scan's two matmul kernels: `chunk_scan_kernel` (rows x head dims
    per program, the inner K / N steps) and `chunk_state_kernel` (head dims x state dims, rows
    per step). `num_stages > 1` applies only where Triton cannot keep a register-operand wgmma
    in flight across the loop (see `_launch_chunk_scan`)."""

    scan_m: int = 64
    scan_p: int = 64
    scan_k: int = 64
    scan_n: int = 128
    scan_warps: int = 4
    scan_stages: int = 1
    state_p: int = 64
    state_n: int = 64
    state_l: int = 64
    state_warps: int = 4


def _launch_scan(
    x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
    C: torch.Tensor, D: torch.Tensor, qsl: torch.Tensor, offsets: torch.Tensor,
    ssm_states: torch.Tensor, read_slots: torch.Tensor, write_slots: torch.Tensor,
    checkpoints: torch.Tensor | None, chunk: int, dt_min: float, dt_max: float, y: torch.Tensor,
    tiles: ScanTiles = ScanTiles(),
) -> None:  # fmt: skip
    num_tokens, num_heads, head_dim = x.shape
    num_requests, num_groups, state_dim = qsl.shape[0] - 1, B.shape[1], B.shape[2]
    max_chunks = max(1, min(num_tokens, num_tokens // chunk + 2 * num_requests))
    dev, f32 = x.device, torch.float32
    dot = "ieee" if x.dtype == f32 else "tf32"  # float32 models get float32 products
    plan = torch.empty(3, max_chunks, dtype=torch.int32, device=dev)  # request, start, rows
    first_chunk = torch.empty(num_requests, dtype=torch.int32, device=dev)
    ssd_chunked.chunk_plan_kernel[(triton.cdiv(max_chunks, 64),)](
        qsl, offsets, plan[0], plan[1], plan[2], first_chunk, num_requests, max_chunks,
        CHUNK=chunk, BLOCK_R=64, BLOCK_NC=64,
    )  # fmt: skip
    dt_chunks = torch.empty(2, num_heads, max_chunks, chunk, dtype=f32, device=dev)
    dt_c, log_decay = dt_chunks[0], dt_chunks[1]  # [H, NC, CHUNK] each
    ssd_chunked.chunk_cumsum_kernel[(max_chunks, triton.cdiv(num_heads, 8))](
        dt, dt_bias, A, plan[0], plan[1], plan[2], dt_c, log_decay, dt_min, dt_max, num_heads,
        dt.stride(0), dt_c.stride(0), dt_c.stride(1), CHUNK=chunk, BLOCK_H=8,
    )  # fmt: skip
    cb = torch.empty(max_chunks, num_groups, chunk, chunk, dtype=f32, device=dev)
    bm = min(64, chunk)
    ssd_chunked.chunk_bmm_kernel[((chunk // bm) ** 2, max_chunks, num_groups)](
        B, C, plan[0], plan[1], plan[2], cb, B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        cb.stride(0), cb.stride(1), STATE_DIM=state_dim, CHUNK=chunk, BLOCK_M=bm, BLOCK_K=bm,
        BLOCK_N=min(64, _pow2(state_dim)), DOT=dot, num_warps=4,
    )  # fmt: skip
    states = torch.empty(max_chunks + num_requests, num_heads, head_dim, state_dim, dtype=f32,
                         device=dev)  # fmt: skip
    _launch_chunk_states(x, B, dt_c, log_decay, plan, states, chunk, tiles, dot)
    ckpt = checkpoints if checkpoints is not None else first_chunk[:, None]
    size = head_dim * state_dim
    block = min(1024, _pow2(size))
    ssd_chunked.state_passing_kernel[(num_requests, num_heads, triton.cdiv(size, block))](
        states, log_decay, qsl, offsets, first_chunk, ssm_states, read_slots, write_slots,
        ckpt, 0 if checkpoints is None else ckpt.shape[1], states.stride(0), states.stride(1),
        log_decay.stride(0), log_decay.stride(1), ssm_states.stride(0), ssm_states.stride(1),
        ckpt.stride(0), STATE_SIZE=size, CHUNK=chunk, BLOCK=block, num_warps=4,
    )  # fmt: skip
    _launch_chunk_scan(x, C, cb, dt_c, log_decay, states, D, plan, y, chunk, tiles, dot)


def _launch_chunk_states(
    x: torch.Tensor, B: torch.Tensor, dt_c: torch.Tensor, log_decay: torch.Tensor,
    plan: torch.Tensor, states: torch.Tensor, chunk: int, tiles: ScanTiles, dot: str,
) -> None:  # fmt: skip
    num_heads, head_dim, state_dim = x.shape[1], x.shape[2], B.shape[2]
    block_p = min(tiles.state_p, _pow2(head_dim))
    block_n = min(tiles.state_n, _pow2(state_dim))
    tiles_pn = triton.cdiv(head_dim, block_p) * triton.cdiv(state_dim, block_n)
    ssd_chunked.chunk_state_kernel[(num_heads, tiles_pn, plan.shape[1])](
        x, B, dt_c, log_decay, plan[0], plan[1], plan[2], states, x.stride(0), x.stride(1),
        B.stride(0), B.stride(1), dt_c.stride(0), dt_c.stride(1), states.stride(0),
        states.stride(1), states.stride(2), HEADS_PER_GROUP=num_heads // B.shape[1],
        HEAD_DIM=head_dim, STATE_DIM=state_dim, CHUNK=chunk, BLOCK_P=block_p,
        BLOCK_N=block_n, BLOCK_L=min(tiles.state_l, chunk), DOT=dot,
        num_warps=tiles.state_warps,
    )  # fmt: skip


def _launch_chunk_scan(
    x: torch.Tensor, C: torch.Tensor, cb: torch.Tensor, dt_c: torch.Tensor,
    log_decay: torch.Tensor, states: torch.Tensor, D: torch.Tensor, plan: torch.Tensor,
    y: torch.Tensor, chunk: int, tiles: ScanTiles, dot: str,
) -> None:  # fmt: skip
    num_heads, head_dim, state_dim = x.shape[1], x.shape[2], C.shape[2]
    block_m = min(tiles.scan_m, chunk)
    block_p = min(tiles.scan_p, _pow2(head_dim))
    grid = (num_heads, (chunk // block_m) * triton.cdiv(head_dim, block_p), plan.shape[1])
    # More than one stage only without whole warpgroups on 64-row tiles: otherwise Triton may
    # keep a wgmma on register operands in flight across the loop back-edge on sm90 (vLLM's
    # _drop_racy_wgmma_configs).
    racy = tiles.scan_warps % 4 == 0 and block_m % 64 == 0
    ssd_chunked.chunk_scan_kernel[grid](
        x, C, cb, dt_c, log_decay, states, D, plan[0], plan[1], plan[2], y, x.stride(0),
        x.stride(1), C.stride(0), C.stride(1), cb.stride(0), cb.stride(1), dt_c.stride(0),
        dt_c.stride(1), states.stride(0), states.stride(1), states.stride(2), y.stride(0),
        y.stride(1), HEADS_PER_GROUP=num_heads // C.shape[1], HEAD_DIM=head_dim,
        STATE_DIM=state_dim, CHUNK=chunk, BLOCK_M=block_m, BLOCK_P=block_p,
        BLOCK_K=min(tiles.scan_k, block_m), BLOCK_N=min(tiles.scan_n, _pow2(state_dim)),
        DOT=dot, num_warps=tiles.scan_warps, num_stages=1 if racy else tiles.scan_stages,
    )  # fmt: skip


def _check_conv(
    op: str, x: torch.Tensor, conv_states: torch.Tensor, read_slots: torch.Tensor,
    write_slots: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    num_requests: int,
) -> int:  # fmt: skip
    check_tensor(op, "x", x, (None, None), FLOAT_DTYPES, x.device, unit_stride=True)
    channels = x.shape[1]
    check_tensor(op, "weight", weight, (channels, None), FLOAT_DTYPES, x.device)
    width = weight.shape[1]
    if width < 2:
        raise ValueError(f"{op}: weight has shape {list(weight.shape)}, expected [C, K >= 2]")
    check_tensor(op, "conv_states", conv_states, (None, width - 1, channels), (x.dtype,),
                 x.device, unit_stride=True)  # fmt: skip
    if bias is not None:
        check_tensor(op, "bias", bias, (channels,), FLOAT_DTYPES, x.device)
    check_slots(op, "read_slots", read_slots, num_requests, x.device)
    check_slots(op, "write_slots", write_slots, num_requests, x.device)
    return num_requests


def _check_ssd(
    op: str, x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor,
    B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, ssm_states: torch.Tensor,
) -> tuple[int, int, int, int, int]:  # fmt: skip
    """(rows, H, P, G, N) after checking every shape against x `[rows, H, P]` and B."""
    check_tensor(op, "x", x, (None, None, None), FLOAT_DTYPES, x.device, unit_stride=True)
    rows, num_heads, head_dim = x.shape
    check_tensor(op, "dt", dt, (rows, num_heads), FLOAT_DTYPES, x.device, unit_stride=True)
    check_tensor(op, "B", B, (rows, None, None), (x.dtype,), x.device, unit_stride=True)
    num_groups, state_dim = B.shape[1], B.shape[2]
    check_tensor(op, "C", C, (rows, num_groups, state_dim), (x.dtype,), x.device,
                 unit_stride=True)  # fmt: skip
    check_groups(op, num_heads, num_groups)
    check_head_params(op, {"dt_bias": dt_bias, "A": A, "D": D}, num_heads, x.device)
    check_state_pool(op, ssm_states, num_heads, head_dim, state_dim, x.device)
    return rows, num_heads, head_dim, num_groups, state_dim


def _state_rows(width: int) -> int:
    return max(2, triton.next_power_of_2(width - 1))


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))
