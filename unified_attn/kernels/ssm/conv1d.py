"""Mamba-2's depthwise causal convolution (then SiLU) over a pool of conv-state blocks.

A request's window is `[carried (K - 1 rows), its new rows]`; window row `j` of a request whose
rows start at `start` is `carried[j]` for `j < K - 1`, else `x[start + j - (K - 1)]`. A block
holds the last `K - 1` inputs of one request; slot -1 reads zeros / writes nothing.
"""

import triton
import triton.language as tl

from unified_attn.kernels.pdl_jit import pdl_start


@triton.jit
def find_request(query_start_loc_ptr, rows, num_requests, SEARCH_STEPS: tl.constexpr):
    """The request owning each row: the largest r < num_requests with qsl[r] <= row (so an
    empty request never owns a row). Bisection with a fixed step count: extra steps are no-ops."""
    lo = tl.zeros_like(rows)
    hi = lo + num_requests
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid)
        lo = tl.where(start <= rows, mid, lo)
        hi = tl.where(start <= rows, hi, mid)
    return lo


@triton.jit
def causal_conv1d_varlen_kernel(
    x_ptr,  # [T, C]
    y_ptr,  # [T, C]
    query_start_loc_ptr,  # [R + 1] int32
    conv_states_ptr,  # [num_blocks, K - 1, C]
    read_slots_ptr,  # [R] int32
    weight_ptr,  # [C, K]
    bias_ptr,  # [C] (or a dummy without HAS_BIAS)
    num_tokens,
    num_requests,
    num_channels,
    stride_xt,
    stride_yt,
    stride_sb,
    stride_ss,
    stride_wc,
    stride_wk,
    KERNEL_WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """y rows of a `[BLOCK_T, BLOCK_C]` tile (rows of any requests). Reads conv states only:
    `conv_state_write_kernel` runs after it, so a block may be read and written in one step."""
    first = tl.program_id(0) * BLOCK_T
    rows = first + tl.arange(0, BLOCK_T)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < num_tokens
    channel_ok = channels < num_channels
    x_ok = row_ok[:, None] & channel_ok[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)[None, :]
    # Most tiles lie inside one request, past its first K - 1 rows: x only, no carried rows.
    ends = tl.minimum(first + tl.arange(0, 2) * (BLOCK_T - 1), num_tokens - 1)
    owners = find_request(query_start_loc_ptr, ends, num_requests, SEARCH_STEPS)
    window_start = tl.load(query_start_loc_ptr + tl.max(owners, axis=0)) + KERNEL_WIDTH - 1
    if (tl.min(owners, axis=0) == tl.max(owners, axis=0)) & (first >= window_start):
        for k in tl.static_range(KERNEL_WIDTH):
            new = tl.load(
                x_ptr + (rows - (KERNEL_WIDTH - 1) + k)[:, None] * stride_xt + channels[None, :],
                mask=x_ok, other=0.0,
            )  # fmt: skip
            tap = tl.load(weight_ptr + channels * stride_wc + k * stride_wk, mask=channel_ok)
            acc += new.to(tl.float32) * tap.to(tl.float32)[None, :]
    else:
        acc += _window_sum(x_ptr, query_start_loc_ptr, conv_states_ptr, read_slots_ptr,
                           weight_ptr, rows, channels, row_ok, channel_ok, num_requests,
                           stride_xt, stride_sb, stride_ss, stride_wc, stride_wk, KERNEL_WIDTH,
                           SEARCH_STEPS, BLOCK_T, BLOCK_C)  # fmt: skip
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + rows[:, None] * stride_yt + channels[None, :],
             y.to(y_ptr.dtype.element_ty), mask=x_ok)  # fmt: skip


@triton.jit
def _window_sum(
    x_ptr, query_start_loc_ptr, conv_states_ptr, read_slots_ptr, weight_ptr, rows, channels,
    row_ok, channel_ok, num_requests, stride_xt, stride_sb, stride_ss, stride_wc, stride_wk,
    KERNEL_WIDTH: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """`sum_k window[row + k] * w[k]` of rows of any requests, carried rows included."""
    request = find_request(query_start_loc_ptr, rows, num_requests, SEARCH_STEPS)
    start = tl.load(query_start_loc_ptr + request, mask=row_ok, other=0)
    slot = tl.load(read_slots_ptr + request, mask=row_ok, other=-1).to(tl.int64)
    state_ptr = conv_states_ptr + slot[:, None] * stride_sb
    carried_ok = (slot >= 0)[:, None] & channel_ok[None, :]
    x_ok = row_ok[:, None] & channel_ok[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(KERNEL_WIDTH):
        window_row = rows - start + k
        from_state = (window_row < KERNEL_WIDTH - 1)[:, None]
        carried = tl.load(
            state_ptr + window_row[:, None] * stride_ss + channels[None, :],
            mask=carried_ok & from_state, other=0.0,
        )  # fmt: skip
        new = tl.load(
            x_ptr + (rows - (KERNEL_WIDTH - 1) + k)[:, None] * stride_xt + channels[None, :],
            mask=x_ok & ~from_state, other=0.0,
        )  # fmt: skip
        tap = tl.load(weight_ptr + channels * stride_wc + k * stride_wk, mask=channel_ok)
        value = tl.where(from_state, carried.to(tl.float32), new.to(tl.float32))
        acc += value * tap.to(tl.float32)[None, :]
    return acc


@triton.jit
def conv_state_write_kernel(
    x_ptr,  # [T, C]
    query_start_loc_ptr,  # [R + 1] int32
    conv_states_ptr,  # [num_blocks, K - 1, C]
    read_slots_ptr,  # [R] int32
    write_slots_ptr,  # [R] int32
    num_channels,
    stride_xt,
    stride_sb,
    stride_ss,
    KERNEL_WIDTH: tl.constexpr,
    STATE_ROWS: tl.constexpr,  # next power of two >= K - 1
    BLOCK_C: tl.constexpr,
):
    """conv_states[write] := window rows `[L, L + K - 1)` of request `program_id(0)` (L its
    new rows). One program loads a whole tile before storing it, so write == read is safe."""
    request = tl.program_id(0)
    write_slot = tl.load(write_slots_ptr + request).to(tl.int64)
    if write_slot < 0:
        return
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_ok = (channels < num_channels)[None, :]
    start = tl.load(query_start_loc_ptr + request)
    length = tl.load(query_start_loc_ptr + request + 1) - start
    read_slot = tl.load(read_slots_ptr + request).to(tl.int64)
    i = tl.arange(0, STATE_ROWS)
    row_ok = (i < KERNEL_WIDTH - 1)[:, None]
    window_row = length + i
    from_state = (window_row < KERNEL_WIDTH - 1)[:, None]
    carried = tl.load(
        conv_states_ptr + read_slot * stride_sb + window_row[:, None] * stride_ss
        + channels[None, :],
        mask=row_ok & channel_ok & from_state & (read_slot >= 0), other=0.0,
    )  # fmt: skip
    new = tl.load(
        x_ptr + (start + window_row - (KERNEL_WIDTH - 1))[:, None] * stride_xt
        + channels[None, :],
        mask=row_ok & channel_ok & ~from_state, other=0.0,
    )  # fmt: skip
    value = tl.where(from_state, carried, new)
    tl.store(conv_states_ptr + write_slot * stride_sb + i[:, None] * stride_ss
             + channels[None, :], value.to(conv_states_ptr.dtype.element_ty),
             mask=row_ok & channel_ok)  # fmt: skip


@triton.jit
def causal_conv1d_update_kernel(
    x_ptr,  # [R, C]: one new row per request
    y_ptr,  # [R, C]
    conv_states_ptr,  # [num_blocks, K - 1, C]
    read_slots_ptr,  # [R] int32
    write_slots_ptr,  # [R] int32
    weight_ptr,  # [C, K]
    bias_ptr,  # [C] (or a dummy without HAS_BIAS)
    num_channels,
    stride_xt,
    stride_yt,
    stride_sb,
    stride_ss,
    stride_wc,
    stride_wk,
    KERNEL_WIDTH: tl.constexpr,
    STATE_ROWS: tl.constexpr,  # next power of two >= K - 1
    HAS_BIAS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    launch_pdl: tl.constexpr,  # kernels/pdl.py
):
    """Decode: one program per (request, channel tile) owns its whole state tile, so one
    launch both reads and writes it (write == read is safe)."""
    pdl_start(launch_pdl)
    request = tl.program_id(0).to(tl.int64)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_ok = channels < num_channels
    read_slot = tl.load(read_slots_ptr + request).to(tl.int64)
    write_slot = tl.load(write_slots_ptr + request).to(tl.int64)
    state = conv_states_ptr + read_slot * stride_sb + channels[None, :]
    i = tl.arange(0, STATE_ROWS)[:, None]
    # window row 0, and the new state: window rows 1 .. K - 2 then x (one load of the block)
    oldest = tl.load(state, mask=channel_ok[None, :] & (read_slot >= 0), other=0.0)
    later = tl.load(state + (i + 1) * stride_ss,
                    mask=(i < KERNEL_WIDTH - 2) & channel_ok[None, :] & (read_slot >= 0),
                    other=0.0)  # fmt: skip
    x = tl.load(x_ptr + request * stride_xt + channels, mask=channel_ok, other=0.0)
    new = tl.where(i == KERNEL_WIDTH - 2, x[None, :], later)
    taps = weight_ptr + channels[None, :] * stride_wc
    first_tap = tl.load(taps, mask=channel_ok[None, :], other=0.0).to(tl.float32)
    later_taps = tl.load(taps + (i + 1) * stride_wk,
                         mask=(i < KERNEL_WIDTH - 1) & channel_ok[None, :],
                         other=0.0).to(tl.float32)  # fmt: skip
    acc = tl.sum(new.to(tl.float32) * later_taps, axis=0)
    acc += tl.sum(oldest.to(tl.float32) * first_tap, axis=0)  # one row
    if HAS_BIAS:
        acc += tl.load(bias_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + request * stride_yt + channels, y.to(y_ptr.dtype.element_ty),
             mask=channel_ok)  # fmt: skip
    if write_slot >= 0:
        tl.store(conv_states_ptr + write_slot * stride_sb + i * stride_ss + channels[None, :],
                 new.to(conv_states_ptr.dtype.element_ty),
                 mask=(i < KERNEL_WIDTH - 1) & channel_ok[None, :])  # fmt: skip
