"""Tensor-parallel shards of the state layers: Mamba-2 mixers (`mamba2_mixer.py`) and gated
delta-nets (`gated_delta.py`), as vLLM splits them.

Mamba-2 (`H` heads of `P` channels, `G` groups of B and C, norms over `NG` groups of channels):
rank `r` of `N` keeps heads `[r * H/N, (r + 1) * H/N)`: their rows of the gate z, of x and of
dt in `in_proj`, their x channels of the convolution, their `A_log`, `D`, `dt_bias`, their
channels of the gated norm and their columns of the row-parallel `out_proj`. B and C follow the
heads: `G/N` groups each when `N` divides `G`; when `G` divides `N` (Mamba2ForCausalLM and
Granite-4.0-H have one group) the one group the rank's heads read is replicated on `N/G` ranks
(vLLM duplicates the groups the same way). The gated norm is local when `N` divides `NG`;
otherwise one norm group spans `N/NG` ranks and the ranks sum their squares
(`RankGatedRMSNorm`, one small all-reduce; vLLM's sum-of-squares all-reduce for one group). A
rank's state blocks hold its heads' SSM states and its channels' convolution inputs.

Gated delta-net (`Hk` key heads, each read by `Hv / Hk` value heads): rank `r` keeps key heads
`[r * Hk/N, (r + 1) * Hk/N)` with their value heads. Qwen3-Next's `in_proj_qkvz` and
`in_proj_ba` are grouped by key head, so the rank's rows are one run; its q, k and v channels
of the convolution, its `A_log` and `dt_bias`, and its columns of `out_proj` follow. The gated
norm is per value head: replicated.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
from torch import nn

from unified_attn.models.gated_delta_config import GatedDeltaConfig
from unified_attn.models.hybrid_config import Mamba2Config
from unified_attn.models.mamba2_mixer import GatedRMSNorm

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the ranks, in place
Run = tuple[int, int]  # (start, count) along a dimension of the full tensor


def splits(parts: int, n: int) -> bool:
    """Whether `n` ranks can share `parts` (heads, groups): split when `n` divides them,
    replicated when they divide `n`."""
    return parts % n == 0 or n % parts == 0


def check_mamba2(mamba: Mamba2Config, n: int, model: str) -> None:
    """A `ValueError` naming the field when `n` ranks cannot split this mixer."""
    name = f"tensor_parallel_size={n}"
    if mamba.num_heads % n:
        raise ValueError(
            f"{name} does not divide the {mamba.num_heads} Mamba-2 heads of {model} "
            "(num_heads); use a divisor of it"
        )
    for field in ("num_groups", "norm_groups"):
        count = getattr(mamba, field)
        if not splits(count, n):
            raise ValueError(
                f"{name} and the Mamba-2 {field}={count} of {model}: one must divide the other "
                "(groups are split, or replicated when there are fewer than ranks); use a "
                f"divisor or a multiple of {count}"
            )


def shard_mamba2_config(mamba: Mamba2Config, n: int) -> Mamba2Config:
    """One rank's mixer: its heads, the groups they read, its norm groups (one when a norm
    group spans ranks)."""
    return attrs.evolve(
        mamba,
        num_heads=mamba.num_heads // n,
        num_groups=max(1, mamba.num_groups // n),
        norm_groups=max(1, mamba.norm_groups // n),
    )


@attrs.frozen
class Mamba2Shard:
    """Rank `rank` of `world_size`'s part of a mixer of shapes `full`."""

    full: Mamba2Config
    rank: int
    world_size: int

    @property
    def local(self) -> Mamba2Config:
        return shard_mamba2_config(self.full, self.world_size)

    @property
    def norm_spans_ranks(self) -> bool:
        return self.full.norm_groups % self.world_size != 0

    @property
    def head_start(self) -> int:
        return self.rank * self.local.num_heads

    @property
    def group_start(self) -> int:
        """The group of its first head (replicated groups are shared by several ranks)."""
        return self.head_start // (self.full.num_heads // self.full.num_groups)

    def conv_runs(self, offset: int = 0) -> list[Run]:
        """Its x, B and C channels of `[x, B, C]` (starting at `offset`)."""
        f, p, n = self.full, self.full.head_size, self.full.state_size
        x = (offset + self.head_start * p, self.local.inner_size)
        bc = self.local.num_groups * n
        b = (offset + f.inner_size + self.group_start * n, bc)
        c = (b[0] + f.num_groups * n, bc)
        return [x, b, c]

    def in_proj_runs(self) -> list[Run]:
        """Its rows of `in_proj`: z, then x / B / C, then dt."""
        f, inner = self.full, self.local.inner_size
        z = (self.head_start * f.head_size, inner)
        dt = (f.inner_size + f.conv_dim + self.head_start, self.local.num_heads)
        return [z, *self.conv_runs(f.inner_size), dt]

    def slice(self, part: str, full: torch.Tensor) -> torch.Tensor:
        """The rank's part of the mixer parameter `part` (`in_proj.weight`, `D`, ...)."""
        heads = (self.head_start, self.local.num_heads)
        channels = (self.head_start * self.full.head_size, self.local.inner_size)
        if part.startswith("in_proj."):
            return take(full, self.in_proj_runs())
        if part.startswith("conv1d."):
            return take(full, self.conv_runs())
        if part in ("A_log", "D", "dt_bias"):
            return take(full, [heads])
        if part == "norm.weight":
            return take(full, [channels])
        if part == "out_proj.weight":
            return take(full, [channels], dim=1)
        return full  # out_proj.bias: added once, after the sum


def take(full: torch.Tensor, runs: list[Run], dim: int = 0) -> torch.Tensor:
    """The runs of `full` along `dim`, concatenated."""
    return torch.cat([full.narrow(dim, start, count) for start, count in runs], dim=dim)


class RankGatedRMSNorm(GatedRMSNorm):
    """`GatedRMSNorm` over a rank's channels when its norm group spans several ranks: each rank
    sums its squares into its group's column of a `[T, NG]` tensor, one all-reduce gives every
    group's sum (vLLM's sum-of-squares all-reduce, for any number of groups)."""

    def __init__(self, local: GatedRMSNorm, shard: Mamba2Shard, all_reduce: AllReduce) -> None:
        super().__init__(local.weight.shape[0], 1, local.eps)
        self.weight = local.weight
        self.all_reduce = all_reduce
        full = shard.full
        self.num_groups = full.norm_groups
        self.group = shard.head_start * full.head_size // (full.inner_size // full.norm_groups)
        self.group_size = full.inner_size // full.norm_groups

    def forward(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        h = y.float() * nn.functional.silu(gate.float())  # [T, local channels]
        sums = h.new_zeros(h.shape[0], self.num_groups)
        sums[:, self.group] = h.pow(2).sum(-1)
        self.all_reduce(sums)
        variance = sums[:, self.group, None] / self.group_size
        return self.weight * (h * torch.rsqrt(variance + self.eps)).to(dtype)


def check_gated_delta(delta: GatedDeltaConfig, n: int, model: str) -> None:
    """A `ValueError` when `n` ranks cannot split the key heads (and so the value heads)."""
    if delta.num_k_heads % n:
        raise ValueError(
            f"tensor_parallel_size={n} does not divide the {delta.num_k_heads} key heads of "
            f"{model}'s gated delta-net layers (linear_num_key_heads; their value heads go "
            "with them); use a divisor of it"
        )


def shard_gated_delta_config(delta: GatedDeltaConfig, n: int) -> GatedDeltaConfig:
    return attrs.evolve(delta, num_k_heads=delta.num_k_heads // n,
                        num_v_heads=delta.num_v_heads // n)  # fmt: skip


def slice_gated_delta(
    part: str, full: torch.Tensor, delta: GatedDeltaConfig, rank: int, n: int
) -> torch.Tensor:
    """The rank's part of the gated delta-net parameter `part` (`in_proj_qkvz.weight`, ...)."""
    local = shard_gated_delta_config(delta, n)
    k0, v0 = rank * local.num_k_heads, rank * local.num_v_heads
    if part.startswith(("in_proj_qkvz.", "in_proj_ba.")):  # grouped by key head: one run
        return full.narrow(0, rank * (full.shape[0] // n), full.shape[0] // n)
    if part.startswith("conv1d."):  # [q, k, v] channels
        dk, dv = delta.k_head_size, delta.v_head_size
        return take(full, [(k0 * dk, local.key_dim), (delta.key_dim + k0 * dk, local.key_dim),
                           (2 * delta.key_dim + v0 * dv, local.value_dim)])  # fmt: skip
    if part in ("A_log", "dt_bias"):
        return full.narrow(0, v0, local.num_v_heads)
    if part == "out_proj.weight":
        return full.narrow(1, v0 * delta.v_head_size, local.value_dim)
    return full  # the per-head gated norm


__all__ = [
    "Mamba2Shard",
    "RankGatedRMSNorm",
    "check_gated_delta",
    "check_mamba2",
    "shard_gated_delta_config",
    "shard_mamba2_config",
    "slice_gated_delta",
]
