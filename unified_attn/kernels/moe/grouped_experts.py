"""Routed experts run sparsely: each expert multiplies only the tokens routed to it (CUDA; the
interpreter in tests).

The dense reference (`moe.RoutedExperts` off CUDA) runs every expert on every token
with weight 0 where it was not chosen. At DeepSeek-V3's 256 experts with 8 chosen that is 32x
the matrix work, and a decode step reads every expert's weights. Here, with no host sync and
shapes that follow from the inputs' alone (so a decode step can be captured in a CUDA graph):

1. `expert_blocks` (`kernels/moe/expert_blocks.py`) sorts the `T * k` (token, choice) pairs by
   expert on the device, in blocks of `block_m` slots of one expert. Blocks past the last
   expert's are marked -1 and their programs return at once.
2. `gate_up_kernel`: per block and `BLOCK_N` intermediate features, the block's token rows
   times the expert's gate and up weights (up alone when ungated), then the activation
   (`Activation`: SwiGLU, V4's clamped SwiGLU, GPT-OSS's, Nemotron-H's ungated `relu(up)**2`),
   stored `[slots, I]` in the input's dtype.
3. `down_kernel`: per block and `BLOCK_N` output features, those rows times the expert's down
   rows, times each pair's routing weight, stored per pair in the input's dtype (as the
   reference rounds each expert's weighted output). `sum_pairs_kernel` adds each token's k
   pair outputs in choice order in float32 and casts once.

Batch invariance: a pair's output row is computed by one program whose instructions do not
depend on the other rows, and the k-sum is in a fixed order, so with one tile configuration for
every batch (`invariant_config`) a token's output does not depend on the batch. The default
configuration follows the pairs per expert (`default_config`), so its rounding may.

Weights (`ExpertWeights`): stacked as transformers holds them, gate and up either as row
blocks (Mixtral, Qwen2-MoE, DeepSeek) or interleaved columns (GPT-OSS), or the up rows alone
(Nemotron-H's ungated experts), with optional biases.
The products accumulate in float32 (`ieee` for float32 inputs).
"""

from __future__ import annotations

import attrs
import torch
import triton

from unified_attn.kernels.moe.expert_blocks import ExpertBlocks, expert_blocks
from unified_attn.kernels.moe.grouped_experts_jit import (
    down_kernel,
    gate_up_kernel,
    sum_pairs_kernel,
)

PAIR_BYTES = 2**30  # the most one launch's pair outputs `[T * k, D]` may take


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
    return _fit(_by_pairs_per_expert(num_pairs / num_experts), element_size)


def invariant_config(element_size: int = 2) -> GroupedConfig:
    """The one configuration of batch-invariant mode, whatever the batch: the prefill tiles (64
    slots, 256 features, 8 warps). Decode, which reads each chosen expert's weights once either
    way, pays for the padded slots in tensor-core time only."""
    return _fit(_by_pairs_per_expert(float("inf")), element_size)


def _fit(cfg: GroupedConfig, element_size: int) -> GroupedConfig:
    """`cfg` with `block_k`, then the stages, halved until the pipeline fits `SHARED_BYTES`."""
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
    return GroupedConfig(64, 256, 64, 8, 3)


@attrs.frozen
class ExpertWeights:
    """The experts' stacked weights, in one of transformers' two layouts:

    - `interleaved=False` (Mixtral, Qwen2-MoE, DeepSeek): `gate_up [E, 2I, D]` (gate rows, then
      up rows), `down [E, D, I]`;
    - `interleaved=True` (GPT-OSS): `gate_up [E, D, 2I]` (gate and up in alternate columns),
      `down [E, I, D]`.

    With an ungated activation (`Activation(relu2=True)`: Nemotron-H) `gate_up` holds the up
    rows alone, `[E, I, D]` (`interleaved=False`), as transformers' `experts.up_proj`.

    Optional biases (GPT-OSS): `gate_up_bias [E, 2I]` in gate_up's order (`[E, I]` ungated),
    `down_bias [E, D]`."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    interleaved: bool = False

    @property
    def num_experts(self) -> int:
        return int(self.gate_up.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.gate_up.shape[1 if self.interleaved else 2])

    @property
    def inter(self) -> int:
        """`I`: down's reduced dimension (gate_up has `2I` rows gated, `I` ungated)."""
        return int(self.down.shape[1 if self.interleaved else 2])


def _ungated_alone(act: Activation, attribute: attrs.Attribute[bool], relu2: bool) -> None:
    if relu2 and (act.limit is not None or act.alpha is not None):
        raise ValueError(
            f"Activation: relu2 (ungated) takes no limit or alpha, got limit={act.limit}, "
            f"alpha={act.alpha}; pass Activation(relu2=True) alone"
        )


@attrs.frozen
class Activation:
    """`silu(gate) * up`, or with `alpha` GPT-OSS's `(up + 1) * gate * sigmoid(alpha * gate)`;
    with `limit`, gate clamped to at most `limit` and up to `[-limit, limit]` first. With
    `relu2` (Nemotron-H) the ungated `relu(up) ** 2`: the weights have no gate half."""

    limit: float | None = None
    alpha: float | None = None
    relu2: bool = attrs.field(default=False, validator=_ungated_alone)

    @property
    def halves(self) -> int:
        """Rows (or columns) of `gate_up` per intermediate feature: gate and up, or up alone."""
        return 1 if self.relu2 else 2


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: ExpertWeights,
    act: Activation = Activation(),
    config: GroupedConfig | None = None,
) -> torch.Tensor:
    """`sum_j weights[t, j] * expert_e(x[t])` over each token's chosen experts `e = ids[t, j]`:
    x `[T, D]`, weights and ids `[T, k]` -> `[T, D]` in x's dtype, where `expert_e(x) =
    down[e] @ act(gate_up[e] @ x + gate_up_bias[e]) + down_bias[e]`. Every id must lie in
    `[0, E)` (a router's output does; it is not checked on the device, which would need a host
    sync)."""
    _check(x, weights, ids, experts, act)
    top_k = ids.shape[1]
    tokens_per_launch = max(1, PAIR_BYTES // (top_k * x.shape[1] * x.element_size()))
    if x.shape[0] > tokens_per_launch:  # a long prefill: bounded pair outputs per launch
        config = config or default_config(tokens_per_launch * top_k, experts.num_experts,
                                          x.element_size())  # fmt: skip
        return torch.cat([
            grouped_experts(x[i : i + tokens_per_launch], weights[i : i + tokens_per_launch],
                            ids[i : i + tokens_per_launch], experts, act, config)
            for i in range(0, x.shape[0], tokens_per_launch)
        ])  # fmt: skip
    cfg = config or default_config(ids.numel(), experts.num_experts, x.element_size())
    blocks = expert_blocks(ids, experts.num_experts, cfg.block_m)
    h = _gate_up(x, experts, blocks, top_k, act, cfg)
    pairs = _down(h, experts, blocks, weights.reshape(-1).float().contiguous(), cfg)
    return sum_pairs(pairs, top_k)


def sum_pairs(pairs: torch.Tensor, top_k: int) -> torch.Tensor:
    """`[T * k, D]` contiguous pair outputs -> `[T, D]`: each token's k rows added in order in
    float32 (a fixed order whatever T: torch's reductions choose theirs by shape), cast to the
    pairs' dtype."""
    out = pairs.new_empty(pairs.shape[0] // top_k, pairs.shape[1])
    block = min(1024, triton.next_power_of_2(pairs.shape[1]))
    sum_pairs_kernel[(out.shape[0], triton.cdiv(pairs.shape[1], block))](
        pairs, out, pairs.shape[1], TOP_K=top_k, BLOCK=block
    )
    return out


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit inputs


def _gate_up(
    x: torch.Tensor,
    experts: ExpertWeights,
    blocks: ExpertBlocks,
    top_k: int,
    act: Activation,
    cfg: GroupedConfig,
) -> torch.Tensor:
    w, bias = experts.gate_up, experts.gate_up_bias
    # (output-feature, input-feature) strides of gate_up
    n_k = (w.stride(2), w.stride(1)) if experts.interleaved else (w.stride(1), w.stride(2))
    h = x.new_empty(blocks.slots.shape[0], experts.inter)
    grid = (blocks.block_expert.shape[0], triton.cdiv(experts.inter, cfg.block_n))
    gate_up_kernel[grid](
        x, w, w if bias is None else bias, blocks.slots, blocks.block_expert, h,
        blocks.num_pairs, experts.hidden, experts.inter, x.stride(0), w.stride(0), *n_k,
        0 if bias is None else bias.stride(0), h.stride(0),
        0.0 if act.limit is None else float(act.limit),
        0.0 if act.alpha is None else float(act.alpha),
        TOP_K=top_k, INTERLEAVED=experts.interleaved, HAS_BIAS=bias is not None,
        CLAMP=act.limit is not None, GPT_OSS=act.alpha is not None, RELU2=act.relu2,
        PRECISION=_precision(x),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.warps,
        num_stages=cfg.stages,
    )  # fmt: skip
    return h


def _down(
    h: torch.Tensor,
    experts: ExpertWeights,
    blocks: ExpertBlocks,
    weights: torch.Tensor,
    cfg: GroupedConfig,
) -> torch.Tensor:
    w, bias = experts.down, experts.down_bias
    n_k = (w.stride(2), w.stride(1)) if experts.interleaved else (w.stride(1), w.stride(2))
    out = h.new_empty(blocks.num_pairs, experts.hidden)
    grid = (blocks.block_expert.shape[0], triton.cdiv(experts.hidden, cfg.block_n))
    down_kernel[grid](
        h, w, w if bias is None else bias, blocks.slots, blocks.block_expert, weights, out,
        blocks.num_pairs, experts.hidden, experts.inter, h.stride(0), w.stride(0), *n_k,
        0 if bias is None else bias.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, PRECISION=_precision(h), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out


def _check(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: ExpertWeights,
    act: Activation,
) -> None:
    """A ValueError naming the first input whose shape, dtype or layout the kernels cannot take."""
    tokens, hidden = tuple(x.shape) if x.dim() == 2 else (-1, -1)
    gate_up, halves = experts.gate_up, act.halves
    rows = gate_up.shape[2 if experts.interleaved else 1] if gate_up.dim() == 3 else -1
    num, inter = (experts.num_experts, rows // halves) if gate_up.dim() == 3 else (-1, -1)
    layout = _layout(experts.interleaved, halves, num, hidden, inter)
    (up_shape, up_name), (down_shape, down_name) = layout
    checks = [
        ("x", x, x.dim() == 2 and x.stride(1) == 1, "[T, D] with unit feature stride"),
        ("ids", ids, ids.dim() == 2 and ids.shape[0] == tokens and not ids.is_floating_point(),
         f"[{tokens}, k] integer"),
        ("weights", weights, weights.shape == ids.shape, f"{tuple(ids.shape)}"),
        ("gate_up", gate_up, halves == 2 or not experts.interleaved,
         "the up rows [E, I, D] (interleaved=False) for an ungated activation"),
        ("gate_up", gate_up, _stacked(gate_up, up_shape, x.dtype),
         f"{up_name} = {up_shape} {x.dtype} with unit stride in its last dim"),
        ("down", experts.down, _stacked(experts.down, down_shape, x.dtype),
         f"{down_name} = {down_shape} {x.dtype} with unit stride in its last dim"),
    ]  # fmt: skip
    for name, bias, size in (("gate_up_bias", experts.gate_up_bias, halves * inter),
                             ("down_bias", experts.down_bias, hidden)):  # fmt: skip
        if bias is not None:
            checks.append((name, bias, tuple(bias.shape) == (num, size) and bias.stride(1) == 1,
                           f"[{num}, {size}] contiguous"))  # fmt: skip
    for name, tensor, ok, want in checks:
        if not ok:
            raise ValueError(
                f"grouped_experts: {name} must be {want}, got {tuple(tensor.shape)} "
                f"{tensor.dtype}; pass the experts' stacked weights and the router's outputs"
            )


_Layout = tuple[tuple[int, ...], str]


def _layout(
    interleaved: bool, halves: int, num: int, hidden: int, inter: int
) -> tuple[_Layout, _Layout]:
    """gate_up's and down's shapes, and their names, in `ExpertWeights`' layouts."""
    rows = "2I" if halves == 2 else "I"
    if interleaved:
        gate_up = ((num, hidden, halves * inter), f"[E, D, {rows}]")
        return gate_up, ((num, inter, hidden), "[E, I, D]")
    gate_up = ((num, halves * inter, hidden), f"[E, {rows}, D]")
    return gate_up, ((num, hidden, inter), "[E, D, I]")


def _stacked(weight: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    return tuple(weight.shape) == shape and weight.stride(-1) == 1 and weight.dtype == dtype


__all__ = [
    "Activation",
    "ExpertWeights",
    "GroupedConfig",
    "default_config",
    "grouped_experts",
    "invariant_config",
]
