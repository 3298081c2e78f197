"""Launchers of the gated delta rule kernels (`kernels/ssm/gated_delta_*.py`), Qwen3-Next's
linear attention, for a batch of requests over a pool of float32 state blocks
`[num_blocks, Hv, Dk, Dv]`. The convolution before the rule is Mamba-2's
(`ssm_ops.causal_conv1d_varlen` / `causal_conv1d_update`).

Request r reads its state from block `read_slots[r]` (-1: zeros) and writes the new one to
block `write_slots[r]` (-1: not written); the two may be equal, but a block one request writes
must not be read or written by another request of the same call. q and k `[rows, Hk, Dk]` are
L2-normalised (`gated_delta_math.prepare_qk` without the repeat and the scale), or normalised
here with `l2norm=True`; each key head serves `Hv / Hk` value heads; the kernels multiply q by
`scale`. No launcher synchronises with the host; `gated_delta_update` is graph-capturable.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from unified_attn.backends.gated_delta_math import L2_EPS
from unified_attn.backends.triton.ssm_checks import FLOAT_DTYPES, check_slots, check_tensor
from unified_attn.kernels.launch import fast_launchers
from unified_attn.kernels.ssm import gated_delta_chunked as chunked_jit
from unified_attn.kernels.ssm import gated_delta_update as update_jit
from unified_attn.kernels.ssm import gated_delta_varlen as varlen_jit
from unified_attn.kernels.ssm import gated_delta_wy as wy_jit
from unified_attn.kernels.ssm import ssd_chunked as ssd_chunked_jit

INT32, FLOAT32 = (torch.int32,), (torch.float32,)
# float32 elements of a decode program's state tile: 32 KiB from 64 requests, 16 KiB below
UPDATE_TILE, UPDATE_TILE_LARGE, LARGE_TILE_FROM = 4096, 8192, 64
VARLEN_BLOCK_V = 16  # state columns a token-by-token prefill program keeps in registers
CHUNK: int = wy_jit.CHUNK.value  # rows of a chunk of the WY form (64)
CHUNKED_BLOCK_V = 32  # state columns a chunked-form program keeps in registers (16-bit)
VARLEN_KERNELS = ("auto", "chunked", "tokens")
# the kernels past Triton's Python dispatch (kernels/launch.py)
chunked_kernels, update_kernels = fast_launchers(chunked_jit), fast_launchers(update_jit)
varlen_kernels, wy_kernels = fast_launchers(varlen_jit), fast_launchers(wy_jit)
ssd_chunked = fast_launchers(ssd_chunked_jit)


def gated_delta_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    scale: float,
    *,
    l2norm: bool = False,
) -> torch.Tensor:
    """Decode: one token per request. q, k `[R, Hk, Dk]`, v `[R, Hv, Dv]`, g (log decay) and
    beta `[R, Hv]` float32 -> o `[R, Hv, Dv]` in v's dtype (`gated_delta_math.gated_delta_step`
    with q scaled by `scale`); states[write_slots[r]] := the new state. One launch."""
    op = "gated_delta_update"
    rows = _check_rule(op, q, k, v, g, beta, states)
    check_slots(op, "read_slots", read_slots, rows, v.device)
    check_slots(op, "write_slots", write_slots, rows, v.device)
    o = torch.empty_like(v)
    if rows:
        block_v, num_warps = update_tiles(k.shape[2], v.shape[2], rows)
        launch_update(q, k, v, g, beta, states, read_slots, write_slots, o, scale, l2norm,
                      block_v, num_warps)  # fmt: skip
    return o


def update_tiles(k_dim: int, v_dim: int, num_requests: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the decode kernel: `[Dk, BLOCK_V]` tiles of UPDATE_TILE
    elements with 4 warps, or UPDATE_TILE_LARGE with 2 warps from LARGE_TILE_FROM requests (a
    memory-bound stream). H200 at Qwen3-Next's heads, CUDA graphs, tile-major programs
    (2026-11-29, a sweep of 2-8 warps x 32-64 columns and cache hints): 128 x 64 with 2 warps 71.8 /
    137.4 / 267.4 us at batch 64 / 128 / 256 (0.92-0.95 of the copy bandwidth), 128 x 32 with 4
    warps 73.6 / 146.0 / 293.2, 8 warps always slower; below 64 requests both tiles are within
    1% (batch 32: 38 us)."""
    large = num_requests >= LARGE_TILE_FROM
    elements = UPDATE_TILE_LARGE if large else UPDATE_TILE
    block_v = max(1, min(triton.next_power_of_2(v_dim), elements // _pow2(k_dim)))
    return block_v, 2 if large else 4


def launch_update(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, read_slots: torch.Tensor, write_slots: torch.Tensor, o: torch.Tensor,
    scale: float, l2norm: bool, block_v: int, num_warps: int,
) -> None:  # fmt: skip
    """The decode kernel with explicit tiles, unchecked (`gated_delta_update` checks; a
    benchmark sweeps tiles through this)."""
    rows, num_heads, v_dim = v.shape
    k_dim = k.shape[2]
    grid = (rows * num_heads * triton.cdiv(v_dim, block_v),)
    update_kernels.gated_delta_update_kernel[grid](
        q, k, v, g, beta, o, states, read_slots, write_slots, float(scale), L2_EPS, num_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), o.stride(0), o.stride(1), states.stride(0),
        states.stride(1), states.stride(2), HEADS_PER_KEY=num_heads // k.shape[1],
        K_DIM=k_dim, V_DIM=v_dim, BLOCK_K=_pow2(k_dim), BLOCK_V=block_v, L2NORM=l2norm,
        num_warps=num_warps,
    )  # fmt: skip


def gated_delta_chunked_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    query_start_loc: torch.Tensor,
    offsets: torch.Tensor,
    states: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    scale: float,
    chunk_size: int,
    checkpoint_slots: torch.Tensor | None = None,
    *,
    l2norm: bool = False,
    kernel: str = "auto",
) -> torch.Tensor:
    """Prefill: each request's rows through the rule. q, k `[T, Hk, Dk]`, v `[T, Hv, Dv]`, g and
    beta `[T, Hv]` float32, query_start_loc `[R + 1]` and offsets `[R]` int32 (tokens each
    request had before) -> o `[T, Hv, Dv]` in v's dtype (`gated_delta_math.gated_delta_chunked`
    per request).

    checkpoint_slots `[R, M]` int32: entry j of request r receives the state after absolute
    position `(offsets[r] // chunk_size + 1 + j) * chunk_size` if that is within its new rows
    (`<= offsets[r] + rows`); -1 or a position past the rows: nothing written.

    `kernel` picks the path: "chunked", the WY form over chunks of CHUNK = 64 rows that end at
    absolute multiples of 64 (`kernels/ssm/gated_delta_chunked.py`, three launches), which
    needs q, k and v of one dtype and, with checkpoints, chunk_size a multiple of 64; "tokens",
    the recurrence token by token (one launch; any `chunk_size >= 1`, 1: entry j is the state
    after the request's first j + 1 rows); "auto" (the default): "chunked" where it applies
    and the step has at least CHUNK rows, else "tokens" (a decision from shapes alone: no
    host sync). On an H200 the chunked form is 7x the token-by-token kernel and 1.8x vLLM's fla
    kernel at 2k tokens (benchmarks/README.md). Scratch of the chunked form: `min(T, T // 64 +
    2 R)` chunks of `Hv * 64 * (Dk + Dv + 64)` elements in v's dtype (w, u, P) and
    `Hv * 3 * 64` float32."""
    op = "gated_delta_chunked_varlen"
    _check_rule(op, q, k, v, g, beta, states)
    num_requests = query_start_loc.shape[0] - 1
    check_tensor(op, "query_start_loc", query_start_loc, (num_requests + 1,), INT32, v.device)
    check_tensor(op, "offsets", offsets, (num_requests,), INT32, v.device)
    check_slots(op, "read_slots", read_slots, num_requests, v.device)
    check_slots(op, "write_slots", write_slots, num_requests, v.device)
    if checkpoint_slots is not None:
        check_tensor(op, "checkpoint_slots", checkpoint_slots, (num_requests, None), INT32,
                     v.device, unit_stride=True)  # fmt: skip
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size is {chunk_size!r}, expected a positive int")
    path = varlen_kernel(op, kernel, q, k, v, chunk_size, checkpoint_slots is not None)
    o = torch.empty_like(v)
    if num_requests and path == "chunked":
        launch_chunked(q, k, v, g, beta, query_start_loc, offsets, states, read_slots,
                       write_slots, checkpoint_slots, o, scale, chunk_size, l2norm)  # fmt: skip
    elif num_requests:
        ckpt = read_slots[:, None] if checkpoint_slots is None else checkpoint_slots
        _launch_varlen(q, k, v, g, beta, query_start_loc, offsets, states, read_slots,
                       write_slots, ckpt, checkpoint_slots is not None, o, scale, chunk_size,
                       l2norm)  # fmt: skip
    return o


def varlen_kernel(
    op: str, kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int,
    has_checkpoints: bool,
) -> str:  # fmt: skip
    """The prefill path `kernel` ("auto", "chunked" or "tokens") resolves to."""
    if kernel not in VARLEN_KERNELS:
        raise ValueError(f"{op}: kernel is {kernel!r}, expected one of {VARLEN_KERNELS}")
    dtypes = [str(t.dtype).removeprefix("torch.") for t in (q, k, v)]
    one_dtype = len(set(dtypes)) == 1
    aligned = not has_checkpoints or chunk_size % CHUNK == 0
    if kernel == "chunked" and not one_dtype:
        raise ValueError(
            f"{op}: kernel='chunked' needs q, k and v of one dtype, found {dtypes}; pass "
            "kernel='tokens' or 'auto'"
        )
    if kernel == "chunked" and not aligned:
        raise ValueError(
            f"{op}: kernel='chunked' with checkpoints needs chunk_size a multiple of {CHUNK}, "
            f"found {chunk_size}; pass kernel='tokens' or 'auto'"
        )
    if kernel == "auto":
        return "chunked" if one_dtype and aligned and q.shape[0] >= CHUNK else "tokens"
    return kernel


class WYForm(NamedTuple):
    """The chunked form's plan and per-chunk scratch (`kernels/ssm/gated_delta_wy.py`)."""

    plan: torch.Tensor  # [3, NC] int32: each chunk's request (-1: none), first row, rows
    first_chunk: torch.Tensor  # [R] int32
    w: torch.Tensor  # [NC, Hv, CHUNK, Dk]
    u: torch.Tensor  # [NC, Hv, CHUNK, Dv]
    scores: torch.Tensor  # [NC, Hv, CHUNK, CHUNK]
    factors: torch.Tensor  # [NC, Hv, 3, CHUNK] float32


def chunked_tiles(
    dtype: torch.dtype, num_requests: int, num_heads: int, v_dim: int, device: torch.device
) -> tuple[int, int, int]:
    """(BLOCK_V, num_warps, num_stages) of `chunk_state_kernel`, whose programs (one per
    request, head and column tile) each walk their request's chunks in order: `[Dk, 64]` tiles
    when that still gives 1.5 programs per SM, else `[Dk, 32]`, the next chunk's loads in flight
    (3 stages); float32's FMA products: 16 columns, 8 warps. H200, Qwen3-Next's heads
    (`benchmarks/gated_delta_kernels.py` sweep, 2026-11-29): 4 x 2,048 tokens 0.702 ms at
    (32, 4, 2) -> 0.520 at (64, 4, 3); one request of 8,192 0.651 -> 0.620 at (32, 4, 3), where
    64 columns leave SMs idle (0.661)."""
    if dtype == torch.float32:
        return 16, 8, 2
    wide = num_requests * num_heads * triton.cdiv(v_dim, 2 * CHUNKED_BLOCK_V)
    fills = device.type == "cuda" and wide >= 1.5 * _sm_count(device)
    return (2 * CHUNKED_BLOCK_V if fills else CHUNKED_BLOCK_V), 4, 3


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    qsl: torch.Tensor, offsets: torch.Tensor, states: torch.Tensor, read_slots: torch.Tensor,
    write_slots: torch.Tensor, checkpoints: torch.Tensor | None, o: torch.Tensor, scale: float,
    chunk_size: int, l2norm: bool, tiles: tuple[int, int, int] | None = None,
) -> None:  # fmt: skip
    """The chunked form's three launches, unchecked (`gated_delta_chunked_varlen` checks; a
    benchmark sweeps `tiles` through this)."""
    form = wy_form(q, k, v, g, beta, qsl, offsets, scale, l2norm)
    tiles = tiles or chunked_tiles(v.dtype, qsl.shape[0] - 1, v.shape[1], v.shape[2], v.device)
    launch_chunk_states(form, q, k, o, qsl, offsets, states, read_slots, write_slots,
                        checkpoints, chunk_size, tiles)  # fmt: skip


def wy_form(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    qsl: torch.Tensor, offsets: torch.Tensor, scale: float, l2norm: bool,
) -> WYForm:  # fmt: skip
    """The chunk plan and every chunk's WY form (two launches, all chunks in parallel). Scratch
    sizes come from the shapes alone (`min(T, T // 64 + 2 R)` chunks): no host sync."""
    num_tokens, num_heads, v_dim = v.shape
    num_requests, k_dim = qsl.shape[0] - 1, k.shape[2]
    max_chunks = max(1, min(num_tokens, num_tokens // CHUNK + 2 * num_requests))
    dev, dtype = v.device, v.dtype
    plan = torch.empty(3, max_chunks, dtype=torch.int32, device=dev)
    first_chunk = torch.empty(num_requests, dtype=torch.int32, device=dev)
    ssd_chunked.chunk_plan_kernel[(triton.cdiv(max_chunks, 64),)](
        qsl, offsets, plan[0], plan[1], plan[2], first_chunk, num_requests, max_chunks,
        CHUNK=CHUNK, BLOCK_R=64, BLOCK_NC=64,
    )  # fmt: skip
    per_chunk = (max_chunks, num_heads)
    form = WYForm(
        plan, first_chunk, torch.empty(*per_chunk, CHUNK, k_dim, dtype=dtype, device=dev),
        torch.empty(*per_chunk, CHUNK, v_dim, dtype=dtype, device=dev),
        torch.empty(*per_chunk, CHUNK, CHUNK, dtype=dtype, device=dev),
        torch.empty(*per_chunk, 3, CHUNK, dtype=torch.float32, device=dev),
    )  # fmt: skip
    fp32 = dtype == torch.float32  # float32 models get float32 products
    w, u, scores, factors = form.w, form.u, form.scores, form.factors
    wy_kernels.chunk_wy_kernel[(max_chunks, num_heads)](
        q, k, v, g, beta, plan[0], plan[1], plan[2], w, u, scores, factors, float(scale),
        L2_EPS, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        scores.stride(0), scores.stride(1), factors.stride(0), factors.stride(1),
        HEADS_PER_KEY=num_heads // k.shape[1], K_DIM=k_dim, V_DIM=v_dim, BLOCK_K=_pow2(k_dim),
        BLOCK_V=min(64, _pow2(v_dim)), L2NORM=l2norm, DOT="ieee" if fp32 else "tf32",
        INV=inverse_precision(dtype, k_dim), num_warps=4, num_stages=1,
    )  # fmt: skip
    return form


def inverse_precision(dtype: torch.dtype, k_dim: int) -> str:
    """The precision of the float32 products that assemble T in `chunk_wy_kernel`: "ieee"
    for float32 models and for key heads under 32 (Triton 3.6 on an H200 gave NaN rows with
    "tf32x3" and illegal memory accesses with "tf32" at Dk = 16 in this kernel; "ieee" is
    exact there), else "tf32x3" (three tf32 products: float32's accuracy on tensor cores)."""
    return "ieee" if dtype == torch.float32 or k_dim < 32 else "tf32x3"


def launch_chunk_states(
    form: WYForm, q: torch.Tensor, k: torch.Tensor, o: torch.Tensor, qsl: torch.Tensor,
    offsets: torch.Tensor, states: torch.Tensor, read_slots: torch.Tensor,
    write_slots: torch.Tensor, checkpoints: torch.Tensor | None, chunk_size: int,
    tiles: tuple[int, int, int],
) -> None:  # fmt: skip
    """Each request's chunks in order: outputs, checkpoints and final state (one launch)."""
    num_heads, v_dim = o.shape[1], o.shape[2]
    block_v, num_warps, num_stages = tiles
    ckpt = read_slots[:, None] if checkpoints is None else checkpoints
    w, u, scores, factors = form.w, form.u, form.scores, form.factors
    grid = (qsl.shape[0] - 1, num_heads, triton.cdiv(v_dim, block_v))
    chunked_kernels.chunk_state_kernel[grid](
        q, k, w, u, scores, factors, o, form.plan[1], form.plan[2], form.first_chunk, qsl,
        offsets, states, read_slots, write_slots, ckpt,
        0 if checkpoints is None else ckpt.shape[1], chunk_size, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        scores.stride(0), scores.stride(1), factors.stride(0), factors.stride(1), o.stride(0),
        o.stride(1), states.stride(0), states.stride(1), states.stride(2), ckpt.stride(0),
        HEADS_PER_KEY=num_heads // k.shape[1], K_DIM=k.shape[2], V_DIM=v_dim,
        BLOCK_K=_pow2(k.shape[2]), BLOCK_V=block_v, HAS_CHECKPOINTS=checkpoints is not None,
        DOT="ieee" if o.dtype == torch.float32 else "tf32", num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip


def _launch_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    qsl: torch.Tensor, offsets: torch.Tensor, states: torch.Tensor, read_slots: torch.Tensor,
    write_slots: torch.Tensor, ckpt: torch.Tensor, has_checkpoints: bool, o: torch.Tensor,
    scale: float, chunk_size: int, l2norm: bool,
) -> None:  # fmt: skip
    _, num_heads, v_dim = v.shape
    k_dim = k.shape[2]
    block_v = min(VARLEN_BLOCK_V, triton.next_power_of_2(v_dim))
    grid = (qsl.shape[0] - 1, num_heads, triton.cdiv(v_dim, block_v))
    varlen_kernels.gated_delta_varlen_kernel[grid](
        q, k, v, g, beta, o, qsl, offsets, states, read_slots, write_slots, ckpt,
        ckpt.shape[1] if has_checkpoints else 0, chunk_size, float(scale), L2_EPS,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), o.stride(0), o.stride(1), states.stride(0),
        states.stride(1), states.stride(2), ckpt.stride(0),
        HEADS_PER_KEY=num_heads // k.shape[1], K_DIM=k_dim, V_DIM=v_dim,
        BLOCK_K=_pow2(k_dim), BLOCK_V=block_v, L2NORM=l2norm,
        HAS_CHECKPOINTS=has_checkpoints, num_warps=4,
    )  # fmt: skip


def _check_rule(
    op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, states: torch.Tensor,
) -> int:  # fmt: skip
    """The rows after checking every shape against v `[rows, Hv, Dv]` and q `[rows, Hk, Dk]`."""
    device = v.device
    check_tensor(op, "v", v, (None, None, None), FLOAT_DTYPES, device, unit_stride=True)
    rows, num_heads, v_dim = v.shape
    check_tensor(op, "q", q, (rows, None, None), FLOAT_DTYPES, device, unit_stride=True)
    check_tensor(op, "k", k, q.shape, FLOAT_DTYPES, device, unit_stride=True)
    key_heads, k_dim = q.shape[1], q.shape[2]
    if key_heads <= 0 or num_heads % key_heads:
        raise ValueError(
            f"{op}: q and k have {key_heads} heads, expected a divisor of v's {num_heads} heads"
        )
    for name, t in (("g", g), ("beta", beta)):
        check_tensor(op, name, t, (rows, num_heads), FLOAT32, device, unit_stride=True)
    check_tensor(op, "states", states, (None, num_heads, k_dim, v_dim), FLOAT32, device)
    if states.numel() and (states.stride(-1), states.stride(-2)) != (1, v_dim):
        raise ValueError(
            f"{op}: states has stride {states.stride()}, expected each head's [Dk, Dv] state "
            f"contiguous (strides (..., {v_dim}, 1))"
        )
    return rows


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))
