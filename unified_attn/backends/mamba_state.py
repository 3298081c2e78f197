"""Mamba-2 state layers: the causal convolution and the SSD scan, with each request's two
states (the convolution's last inputs and the SSM state) in KV-cache state blocks.

A block holds `[K - 1, conv_dim]` carried convolution inputs (model dtype) and the
`[H, P, N]` SSM state (float32). The manager is `StateManager` (`MambaManager`): mode "none"
keeps one block per request; "align" and "all" keep state checkpoints at block boundaries for
prefix caching (see `managers/state.py`); where a step reads and writes is `StateRow`.

`forward(layer, output, query, key, value, mixer=...)`: `query` is the convolution's input
`xBC [T, conv_dim]`, `key` is dt `[T, H]` before the softplus, `value` is unused, `mixer` the
layer's `Mamba2Weights`. `output [T, H * P]` receives `scan + D * x`; the model gates, norms
and projects it.

On CUDA the Triton kernels run (`mamba_device.py`) and decode steps are captured in CUDA
graphs; on the CPU, the torch forms of `mamba_math.py`, request by request.
"""

from __future__ import annotations

from typing import Any

import torch

from unified_attn.backend import (
    CommonAttentionMetadata,
    LayerConfig,
)
from unified_attn.backend.state_layers import Mamba2Weights
from unified_attn.backends.mamba_device import (
    decode,
    varlen,
)
from unified_attn.backends.mamba_math import discretize, ssd_scan, ssd_step
from unified_attn.backends.state_backend import KernelStepPlan, StateBackend
from unified_attn.backends.state_rows import StateRow
from unified_attn.selector import register_backend


@register_backend(priority={"cpu": 100, "cuda": 100})
class Mamba2StateBackend(StateBackend[KernelStepPlan]):
    """One instance serves every Mamba-2 layer of the same shape."""

    name = "mamba2"
    layer_kinds = ("mamba2",)

    def __init__(
        self,
        *,
        num_heads: int,
        head_size: int,
        dtype: torch.dtype | str,
        num_groups: int,
        state_size: int,
        conv_kernel: int,
        chunk_size: int,
        time_step_limit: tuple[float, float] = (0.0, float("inf")),
        **options: Any,
    ) -> None:
        super().__init__(num_heads=num_heads, head_size=head_size, dtype=dtype, **options)
        self.num_groups, self.state_size = num_groups, state_size
        self.conv_kernel, self.chunk_size = conv_kernel, chunk_size
        self.time_step_limit = time_step_limit
        self.conv_dim = num_heads * head_size + 2 * num_groups * state_size
        # the Triton scan takes chunks of a power of two >= 16 (real models: 128, 256); other
        # sizes run the torch scan (decode steps take the kernels whatever the chunk)
        self.kernel_scan = chunk_size >= 16 and not chunk_size & (chunk_size - 1)

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False  # the chunked scan's bits depend on where a step's chunks begin

    @classmethod
    def supports_cuda_graphs(cls) -> bool:
        return True  # decode: the one-token kernels over slots the plan computes on the device

    @classmethod
    def plans_inside_cuda_graphs(cls) -> bool:
        return True  # a graph step's slots come from seq_lens and the block tables alone

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype | str]]:
        return [((self.conv_kernel - 1, self.conv_dim), self.dtype),
                ((self.num_heads, self.head_size, self.state_size), "float32")]  # fmt: skip

    def prep_forward(
        self,
        common: CommonAttentionMetadata,
        block_tables: dict[int, torch.Tensor],
        for_cudagraph_capture: bool = False,
    ) -> None:
        kernels = self.on_cuda and (common.max_query_len == 1 or self.kernel_scan)
        self.plan = self.plan_kernel_step(common, block_tables,
                                          (self.chunk_size,) if kernels else ())  # fmt: skip

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        self.check_state_inputs(layer, output, {"query": (query, self.conv_dim),
                                                "key": (key, self.num_heads)})  # fmt: skip
        weights: Mamba2Weights = kwargs["mixer"]
        plan, gid = self.current_plan(), self.group_of_layer[layer.name]
        convs, ssms = self.caches[layer.name]  # [num_blocks, K - 1, conv_dim], [.., H, P, N]
        if plan.slots is not None:
            shape = (self.num_heads, self.head_size, self.num_groups, self.state_size)
            if plan.decode:
                y = decode(query, key, weights, convs, ssms, plan.slots[gid], shape,
                           self.time_step_limit)  # fmt: skip
            else:
                assert plan.query_start_loc is not None
                y = varlen(query, key, weights, convs, ssms, plan.slots[gid],
                           plan.query_start_loc, shape, self.chunk_size, self.time_step_limit)
            output.view(y.shape).copy_(y)
            return output
        rows = plan.requests[gid]
        dt = discretize(key, weights.dt_bias, self.time_step_limit)  # [T, H] float32
        out = output.view(-1, self.num_heads, self.head_size)
        for row in rows:
            xbc = self.convolve(convs, query[row.start : row.end], row, weights.conv_weight,
                                weights.conv_bias)  # fmt: skip
            y = self._scan(xbc, dt[row.start : row.end], weights, ssms, row)
            out[row.start : row.end] = y.to(out.dtype)
        return output

    def _scan(
        self, xbc: torch.Tensor, dt: torch.Tensor, weights: Mamba2Weights, ssms: torch.Tensor,
        row: StateRow,
    ) -> torch.Tensor:  # fmt: skip
        """One request's convolved rows through the SSD scan; writes its states."""
        inner, bc = self.num_heads * self.head_size, self.num_groups * self.state_size
        x, B, C = xbc.split([inner, bc, bc], dim=-1)
        x = x.view(-1, self.num_heads, self.head_size)
        B, C = (t.reshape(-1, self.num_groups, self.state_size) for t in (B, C))
        state = self.read_state(ssms, row.read)
        if len(x) == 1:
            y, new = ssd_step(x, dt, weights.A, B, C, state[None])
            y, state = y[0], new[0]
        else:
            ends = tuple(end for end, _ in row.checkpoints)
            y, state, saved = ssd_scan(
                x, dt, weights.A, B, C, state, self.chunk_size, row.offset, ends
            )
            for (_, block), checkpoint in zip(row.checkpoints, saved, strict=True):
                ssms[block] = checkpoint
        ssms[row.write] = state
        return y + weights.D.float()[:, None] * x.float()
