"""Routed experts run sparsely: each expert multiplies only the tokens routed to it (CUDA; the
interpreter in tests).

The dense reference (`moe.RoutedExperts` off CUDA) runs every expert on every token
with weight 0 where it was not chosen. At DeepSeek-V3's 256 experts with 8 chosen that is 32x
the matrix work, and a decode step reads every expert's weights. Here, with no host sync and
shapes that follow from the inputs' alone (so a decode step can be captured in a CUDA graph):

1. `expert_blocks` sorts the `T * k` (token, choice) pairs by expert on the device. Each
   expert's pairs are padded to a multiple of `block_m` slots, so every block of slots belongs
   to one expert. There are at most `T * k + min(E, T * k) * (block_m - 1)` slots. Blocks past
   the last expert's are marked -1 and their programs return at once.
2. `gate_up_kernel`: per block and `BLOCK_N` intermediate features, the block's token rows
   times the expert's gate rows and up rows, then `silu(gate) * up` (with V4's clamps), stored
   `[slots, I]` in the input's dtype.
3. `down_kernel`: per block and `BLOCK_N` output features, those rows times the expert's down
   rows, times each pair's routing weight, stored per pair in the input's dtype (as the
   reference rounds each expert's weighted output). The `[T, k, D]` pair outputs are summed
   over k in float32 and cast once.

Weights: `gate_up [E, 2I, D]` (gate rows, then up rows) and `down [E, D, I]`, transformers'
layout for DeepSeek's experts. The products accumulate in float32 (`ieee` for float32 inputs).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

PAIR_BYTES = 2**30  # the most one launch's pair outputs `[T * k, D]` may take


@attrs.frozen
class ExpertBlocks:
    """The (token, choice) pairs sorted by expert, in blocks of `block_m` slots of one expert.

    `slots [S]` int32: the pair `t * k + j` in each slot, `num_pairs` in a padding slot;
    `block_expert [S / block_m]` int32: each block's expert, -1 for blocks past the last one."""

    slots: torch.Tensor
    block_expert: torch.Tensor
    num_pairs: int
    block_m: int


SORT_IN_ONE_PROGRAM = 4096  # the most pairs `expert_blocks` sorts in one launch (decode)


def expert_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """`ids [T, k]` (each token's chosen experts, in `[0, num_experts)`) sorted into blocks, with
    no host sync: every shape follows from `ids.shape`. Pairs of one expert keep their order.
    Up to `SORT_IN_ONE_PROGRAM` pairs (decode) one program sorts them; more (prefill) take
    about 25 torch ops, whose launches do not matter beside the products."""
    pairs = ids.numel()
    size = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m) * block_m
    if pairs > SORT_IN_ONE_PROGRAM:
        return _sorted_by_torch(ids, num_experts, block_m, size)
    slots = torch.empty(size, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    expert_blocks_kernel[(1,)](
        ids.reshape(-1), slots, block_expert, pairs, num_experts, size,
        BLOCK_M=block_m, EXPERTS=triton.next_power_of_2(num_experts), num_warps=4,
    )  # fmt: skip
    return ExpertBlocks(slots, block_expert, pairs, block_m)


def _sorted_by_torch(ids: torch.Tensor, num_experts: int, block_m: int, size: int) -> ExpertBlocks:
    pairs, device = ids.numel(), ids.device
    flat = ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # pairs of expert 0 first, then expert 1, ...
    by_expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in `order`
    rank = torch.arange(pairs, device=device) - first[by_expert]
    slots = torch.full((size,), pairs, dtype=torch.int32, device=device)
    slots[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    starts = torch.arange(0, size, block_m, device=device)
    owner = torch.searchsorted(ends, starts, right=True)  # the expert whose slots hold `starts`
    block_expert = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return ExpertBlocks(slots, block_expert, pairs, block_m)


@triton.jit
def expert_blocks_kernel(
    ids_ptr,  # [P] integer
    slots_ptr,  # [S] int32 out
    block_expert_ptr,  # [S / BLOCK_M] int32 out
    num_pairs,
    num_experts,
    num_slots,
    BLOCK_M: tl.constexpr,
    EXPERTS: tl.constexpr,  # a power of two >= num_experts
    CHUNK: tl.constexpr = 32,
):
    """One program: counts per expert, each expert's first slot, then the pairs placed chunk by
    chunk (a pair's rank among its expert's pairs: those in earlier chunks plus a running sum
    in its chunk), then each block's expert (how many experts end at or before its start)."""
    e = tl.arange(0, EXPERTS)
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        expert = tl.load(ids_ptr + p, mask=p < num_pairs, other=EXPERTS).to(tl.int32)
        counts += tl.sum((expert[:, None] == e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    for s0 in range(0, num_slots, 1024):
        s = s0 + tl.arange(0, 1024)
        tl.store(slots_ptr + s, num_pairs, mask=s < num_slots)
    tl.debug_barrier()  # the padding is written before the pairs overwrite their slots
    seen = tl.zeros((EXPERTS,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        expert = tl.load(ids_ptr + p, mask=p < num_pairs, other=EXPERTS).to(tl.int32)
        mine = (expert[:, None] == e[None, :]).to(tl.int32)  # [CHUNK, EXPERTS]
        slot = starts[None, :] + seen[None, :] + tl.cumsum(mine, axis=0) - 1
        tl.store(slots_ptr + tl.sum(mine * slot, axis=1), p, mask=p < num_pairs)
        seen += tl.sum(mine, axis=0)
    for b0 in range(0, num_slots // BLOCK_M, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        owner = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(owner < num_experts, owner, -1),
                 mask=b < num_slots // BLOCK_M)  # fmt: skip


@attrs.frozen
class GroupedConfig:
    """Tile sizes: `block_m` slots per block (one expert's), `block_n` output features and
    `block_k` reduced features per step of a program; warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


SHARED_BYTES = 200 * 2**10  # the most shared memory the default tiles' pipeline may take


def default_config(num_pairs: int, num_experts: int, element_size: int = 2) -> GroupedConfig:
    """Blocks of 16 slots while experts get a few pairs each (decode), up to 128 (prefill);
    the H100 sweep of 16-bit data in benchmarks/README.md ("MoE experts"). Wider data halves
    `block_k`, then the stages, until the pipeline's tiles fit `SHARED_BYTES`."""
    cfg = _by_pairs_per_expert(num_pairs / num_experts)
    while _pipeline_bytes(cfg, element_size) > SHARED_BYTES and cfg.block_k > 32:
        cfg = attrs.evolve(cfg, block_k=cfg.block_k // 2)
    while _pipeline_bytes(cfg, element_size) > SHARED_BYTES and cfg.stages > 2:
        cfg = attrs.evolve(cfg, stages=cfg.stages - 1)
    return cfg


def _pipeline_bytes(cfg: GroupedConfig, element_size: int) -> int:
    """The gate-up kernel's staged tiles: the rows and two weight tiles in each of the
    `stages - 1` buffers Triton 3.6 allocates (its compile error's figure for these kernels)."""
    return (cfg.stages - 1) * (cfg.block_m + 2 * cfg.block_n) * cfg.block_k * element_size


def _by_pairs_per_expert(per_expert: float) -> GroupedConfig:
    if per_expert <= 1:
        return GroupedConfig(16, 64, 128, 4, 3)
    if per_expert <= 16:
        return GroupedConfig(16, 128, 128, 4, 3)
    if per_expert <= 48:
        return GroupedConfig(32, 64, 128, 4, 3)
    if per_expert <= 160:
        return GroupedConfig(64, 128, 64, 8, 4)
    return GroupedConfig(128, 128, 64, 8, 3)


@triton.jit
def gate_up_kernel(
    x_ptr,  # [T, D]
    w_ptr,  # [E, 2I, D]: gate rows, then up rows
    slots_ptr,  # [S] int32
    block_expert_ptr,  # [S / BLOCK_M] int32
    h_ptr,  # [S, I] out, x's dtype
    num_pairs,
    hidden,  # D
    inter,  # I
    stride_xt,
    stride_we,
    stride_wn,
    stride_hs,
    limit,
    TOP_K: tl.constexpr,
    CLAMP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(slots_ptr + rows)
    valid = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + ks[None, :]
    g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None]
    up_offset = inter * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = ks + k0 < hidden
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        gate = tl.dot(a, tl.load(g_ptrs, mask=w_ok, other=0.0), gate, input_precision=PRECISION)
        up = tl.dot(a, tl.load(g_ptrs + up_offset, mask=w_ok, other=0.0), up,
                    input_precision=PRECISION)  # fmt: skip
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate * tl.sigmoid(gate) * up
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hs + cols[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit
def down_kernel(
    h_ptr,  # [S, I]
    w_ptr,  # [E, D, I]
    slots_ptr,  # [S] int32
    block_expert_ptr,  # [S / BLOCK_M] int32
    weights_ptr,  # [T * k] float32: each pair's routing weight
    out_ptr,  # [T * k, D] out, h's dtype
    num_pairs,
    hidden,  # D
    inter,  # I
    stride_hs,
    stride_we,
    stride_wn,
    stride_op,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(slots_ptr + rows)
    valid = pair < num_pairs
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hs + ks[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = ks + k0 < inter
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc *= tl.load(weights_ptr + pair, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_op + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float | None = None,
    config: GroupedConfig | None = None,
) -> torch.Tensor:
    """`sum_j weights[t, j] * down[e] @ act(gate_up[e] @ x[t])` over each token's chosen
    experts `e = ids[t, j]`: x `[T, D]`, weights and ids `[T, k]` -> `[T, D]` in x's dtype.
    `act` is `silu(gate) * up`, with gate clamped to at most `limit` and up to `[-limit, limit]`
    when `limit` is given (V4). Every id must lie in `[0, E)` (a router's output does; it is
    not checked on the device, which would need a host sync)."""
    _check(x, weights, ids, gate_up, down)
    num_experts, top_k = gate_up.shape[0], ids.shape[1]
    tokens_per_launch = max(1, PAIR_BYTES // (top_k * x.shape[1] * x.element_size()))
    if x.shape[0] > tokens_per_launch:  # a long prefill: bounded pair outputs per launch
        config = config or default_config(tokens_per_launch * top_k, num_experts,
                                          x.element_size())  # fmt: skip
        return torch.cat([
            grouped_experts(x[i : i + tokens_per_launch], weights[i : i + tokens_per_launch],
                            ids[i : i + tokens_per_launch], gate_up, down, limit, config)
            for i in range(0, x.shape[0], tokens_per_launch)
        ])  # fmt: skip
    cfg = config or default_config(ids.numel(), num_experts, x.element_size())
    blocks = expert_blocks(ids, num_experts, cfg.block_m)
    h = _gate_up(x, gate_up, blocks, top_k, limit, cfg)
    pairs = _down(h, down, blocks, weights.reshape(-1).float().contiguous(), cfg)
    return torch.sum(pairs.view(x.shape[0], top_k, -1), dim=1, dtype=torch.float32).to(x.dtype)


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit inputs


def _gate_up(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    blocks: ExpertBlocks,
    top_k: int,
    limit: float | None,
    cfg: GroupedConfig,
) -> torch.Tensor:
    inter = gate_up.shape[1] // 2
    h = x.new_empty(blocks.slots.shape[0], inter)
    grid = (blocks.block_expert.shape[0], triton.cdiv(inter, cfg.block_n))
    gate_up_kernel[grid](
        x, gate_up, blocks.slots, blocks.block_expert, h, blocks.num_pairs, x.shape[1], inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        0.0 if limit is None else float(limit),
        TOP_K=top_k, CLAMP=limit is not None, PRECISION=_precision(x), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return h


def _down(
    h: torch.Tensor,
    down: torch.Tensor,
    blocks: ExpertBlocks,
    weights: torch.Tensor,
    cfg: GroupedConfig,
) -> torch.Tensor:
    hidden, inter = down.shape[1], down.shape[2]
    out = h.new_empty(blocks.num_pairs, hidden)
    grid = (blocks.block_expert.shape[0], triton.cdiv(hidden, cfg.block_n))
    down_kernel[grid](
        h, down, blocks.slots, blocks.block_expert, weights, out, blocks.num_pairs, hidden,
        inter, h.stride(0), down.stride(0), down.stride(1), out.stride(0),
        PRECISION=_precision(h), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out


def _check(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> None:
    """A ValueError naming the first input whose shape, dtype or layout the kernels cannot take."""
    tokens, hidden = tuple(x.shape) if x.dim() == 2 else (-1, -1)
    num, inter = (gate_up.shape[0], gate_up.shape[1] // 2) if gate_up.dim() == 3 else (-1, -1)
    unit = "with unit feature stride"
    checks = [
        ("x", x, x.dim() == 2 and x.stride(1) == 1, f"[T, D] {unit}"),
        ("ids", ids, ids.dim() == 2 and ids.shape[0] == tokens and not ids.is_floating_point(),
         f"[{tokens}, k] integer"),
        ("weights", weights, weights.shape == ids.shape, f"{tuple(ids.shape)}"),
        ("gate_up", gate_up, _stacked(gate_up, (num, 2 * inter, hidden), x.dtype),
         f"[E, 2I, {hidden}] {x.dtype} {unit}"),
        ("down", down, _stacked(down, (num, hidden, inter), x.dtype),
         f"[{num}, {hidden}, {inter}] {x.dtype} {unit}"),
    ]  # fmt: skip
    for name, tensor, ok, want in checks:
        if not ok:
            raise ValueError(
                f"grouped_experts: {name} must be {want}, got {tuple(tensor.shape)} "
                f"{tensor.dtype}; pass the experts' stacked weights and the router's outputs"
            )


def _stacked(weight: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    return tuple(weight.shape) == shape and weight.stride(-1) == 1 and weight.dtype == dtype


__all__ = ["ExpertBlocks", "GroupedConfig", "default_config", "expert_blocks", "grouped_experts"]
