"""The fused layers switch: a model's norms, activations, rotary embeddings and projections run
either their torch code (the CPU path, batch-invariant mode, and the reference) or the fused
Triton kernels of `kernels/layers` (CUDA), one projection GEMM per packed group
(`PackedLinear`).

`DecoderModel` turns the kernels on when it is built on CUDA outside batch-invariant mode, unless
`UNIFIED_ATTN_FUSED_LAYERS=0` (`fused_by_default`; the GPU suites pass with them on an H200). A
layer that can fuse offers `set_fused(enabled)` (`Fusable`).

The fused attention and MLP layers run the projections of at most `UNIFIED_ATTN_SKINNY_GEMM_ROWS`
rows (default 16: decode steps) through the decode-row GEMM of `kernels/layers/skinny_gemm.py`
instead of cuBLAS (`project`) unless `UNIFIED_ATTN_SKINNY_GEMM=0`: on an H200 it took
Llama-3-8B's decode step from 4.78 to 4.63 ms at batch 1 and from 5.19 to 4.97 ms at batch 16
(benchmarks/README.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from unified_attn.kernels.layers.skinny_gemm import MAX_ROWS, skinny_linear


@runtime_checkable
class Fusable(Protocol):
    """A layer with a fused kernel path beside its torch code."""

    def set_fused(self, enabled: bool) -> None: ...


FUSED_VARIABLE = "UNIFIED_ATTN_FUSED_LAYERS"
SKINNY_VARIABLE = "UNIFIED_ATTN_SKINNY_GEMM"
SKINNY_ROWS_VARIABLE = "UNIFIED_ATTN_SKINNY_GEMM_ROWS"
DEFAULT_SKINNY_ROWS = 16


def fused_by_default() -> bool:
    """Whether a model built on CUDA runs the fused layers: yes unless `UNIFIED_ATTN_FUSED_LAYERS`
    is "0" (the torch layers); any value but "0" and "1" is refused."""
    value = os.environ.get(FUSED_VARIABLE, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{FUSED_VARIABLE}={value!r}: expected 0 or 1")
    return value == "1"


def skinny_by_default() -> bool:
    """Whether fused layers take the decode-row GEMM: yes unless `UNIFIED_ATTN_SKINNY_GEMM` is
    "0"; any value but "0" and "1" is refused."""
    value = os.environ.get(SKINNY_VARIABLE, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{SKINNY_VARIABLE}={value!r}: expected 0 or 1")
    return value == "1"


def skinny_row_limit() -> int:
    """The most rows a fused layer's projection sends through the decode-row GEMM: 0 when
    `skinny_by_default()` says no, else `UNIFIED_ATTN_SKINNY_GEMM_ROWS` (1 to `MAX_ROWS`,
    default `DEFAULT_SKINNY_ROWS`); any other value is refused."""
    value = os.environ.get(SKINNY_ROWS_VARIABLE, str(DEFAULT_SKINNY_ROWS))
    if not value.isdigit() or not 1 <= int(value) <= MAX_ROWS:
        raise ValueError(f"{SKINNY_ROWS_VARIABLE}={value!r}: expected an integer from 1 to "
                         f"{MAX_ROWS} (decode rows through the decode-row GEMM)")  # fmt: skip
    return int(value) if skinny_by_default() else 0


def skinny_rows(x: torch.Tensor, max_rows: int) -> bool:
    """Whether x `[M, K]` suits the decode-row GEMM: 1 to `max_rows` contiguous rows."""
    return x.dim() == 2 and 0 < x.shape[0] <= max_rows and x.is_contiguous()


def project(layer: nn.Module | PackedLinear, x: torch.Tensor, max_rows: int) -> torch.Tensor:
    """`layer(x)`; steps of at most `max_rows` rows (`skinny_rows`; 0: none) through a plain
    `nn.Linear` or a `PackedLinear` of x's dtype take the decode-row GEMM (a tensor-parallel
    linear, whose collective is its own, keeps its forward)."""
    if max_rows and skinny_rows(x, max_rows):
        weight: torch.Tensor | None = None
        if isinstance(layer, PackedLinear):
            weight, bias = layer.parameters_now()
        elif type(layer) is nn.Linear:
            weight, bias = layer.weight, layer.bias
        if weight is not None and weight.dtype == x.dtype:
            return skinny_linear(x, weight, bias)
    return layer(x)


def set_fused_layers(model: nn.Module, enabled: bool) -> None:
    """Every `Fusable` layer of `model` on its kernel path (`enabled`) or its torch code."""
    for module in model.modules():
        if isinstance(module, Fusable):
            module.set_fused(enabled)


class PackedLinear:
    """Linear layers over one input as one GEMM: their weights (and biases) become row blocks
    of one tensor, each layer's parameters views of its block. What updates the parameters in
    place (`load_state_dict`, `copy_`, tensor-parallel slicing) updates the packed weight; a
    parameter replaced instead (`module.to`, `param.data = ...`) is noticed and packed again.

    Not a module: the parameters stay the layers' own, under their checkpoint names."""

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        biases = {linear.bias is None for linear in linears}
        if len(biases) != 1:
            raise ValueError("PackedLinear: the layers must all have a bias or none have one")
        self.linears = tuple(linears)
        self.sizes = [linear.out_features for linear in linears]
        self._pack()

    def _params(self) -> list[torch.Tensor]:
        return [p for linear in self.linears for p in (linear.weight, linear.bias)
                if p is not None]  # fmt: skip

    @torch.no_grad()
    def _pack(self) -> None:
        self.weight = _pack_rows([linear.weight for linear in self.linears], self.sizes)
        first = self.linears[0].bias
        self.bias = None
        if first is not None:
            self.bias = _pack_rows([linear.bias for linear in self.linears], self.sizes)
        self._pointers = [p.data_ptr() for p in self._params()]

    def is_current(self) -> bool:
        """True while every parameter is still a view of the packed tensors."""
        return [p.data_ptr() for p in self._params()] == self._pointers

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., K]` -> `[..., sum(sizes)]`: the layers' outputs side by side."""
        weight, bias = self.parameters_now()
        return nn.functional.linear(x, weight, bias)

    def parameters_now(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed weight and bias, packed again first if a parameter was replaced."""
        if not self.is_current():
            self._pack()
        return self.weight, self.bias


def _pack_rows(params: Sequence[torch.Tensor | None], sizes: list[int]) -> torch.Tensor:
    """The parameters concatenated along dim 0; each parameter becomes a view of its rows."""
    present = [p for p in params if p is not None]
    packed = torch.cat([p.detach() for p in present])
    for param, part in zip(present, packed.split(sizes), strict=True):
        param.data = part
    return packed
