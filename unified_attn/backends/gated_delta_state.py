"""Gated delta-net state layers (Qwen3-Next's linear attention): the causal convolution and
the gated delta rule, with each request's two states (the convolution's last inputs and the
recurrent state) in KV-cache state blocks.

A block holds `[K - 1, conv_dim]` carried convolution inputs (model dtype) and the
`[Hv, Dk, Dv]` recurrent state (float32). The manager is `StateManager`, in the mode
`mamba_cache_mode` names (`managers/state.py`); where a step reads and writes is `StateRow`,
as for Mamba-2 (`mamba_state.py`); a row's checkpoints may fall on any token (the chunks end
there too), both states saved at each.

`forward(layer, output, query, key, value, mixer=...)`: `query` is the convolution's input
`[q, k, v] [T, conv_dim]` (key heads' q and k, then the value heads' v), `key` is `a [T, Hv]`
(the decay's input before the softplus), `value` is `b [T, Hv]` (the rate before the
sigmoid), `mixer` the layer's `GatedDeltaWeights`. `output [T, Hv * Dv]` receives the rule's
output; the model norms, gates and projects it.

On CUDA the Triton kernels run (`gated_delta_device.py`: Mamba-2's convolution, the rule's
one-token update and its token-by-token varlen kernel) and decode steps are captured in CUDA
graphs; on the CPU, the torch forms of `gated_delta_math.py`, request by request.
"""

from __future__ import annotations

from typing import Any

import torch

from unified_attn.backend import (
    CommonAttentionMetadata,
    LayerConfig,
)
from unified_attn.backend.state_layers import GatedDeltaWeights
from unified_attn.backends.gated_delta_device import (
    CHECKPOINT_GRID,
    CHUNKED_GRID,
    decay_and_rate,
    decode,
    varlen,
)
from unified_attn.backends.gated_delta_math import (
    gated_delta_chunked,
    gated_delta_step,
    prepare_qk,
)
from unified_attn.backends.state_backend import KernelStepPlan, StateBackend
from unified_attn.backends.state_rows import StateRow
from unified_attn.backends.state_slots import DeviceSlots
from unified_attn.selector import register_backend


@register_backend(priority={"cpu": 100, "cuda": 100})
class GatedDeltaStateBackend(StateBackend[KernelStepPlan]):
    """One instance serves every gated delta-net layer of the same shape."""

    name = "gated_delta"
    layer_kinds = ("gated_delta",)

    def __init__(
        self,
        *,
        num_heads: int,
        head_size: int,
        dtype: torch.dtype | str,
        num_k_heads: int,
        k_head_size: int,
        conv_kernel: int,
        chunk_size: int = 64,
        **options: Any,
    ) -> None:
        super().__init__(num_heads=num_heads, head_size=head_size, dtype=dtype, **options)
        self.num_k_heads, self.k_head_size = num_k_heads, k_head_size
        self.conv_kernel, self.chunk_size = conv_kernel, chunk_size
        self.key_dim = num_k_heads * k_head_size
        self.conv_dim = 2 * self.key_dim + num_heads * head_size

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False  # the chunked rule's bits depend on where a step's chunks begin

    @classmethod
    def supports_cuda_graphs(cls) -> bool:
        return True  # decode: the one-token kernels over slots the plan computes on the device

    @classmethod
    def plans_inside_cuda_graphs(cls) -> bool:
        return True  # a graph step's slots come from seq_lens and the block tables alone

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype | str]]:
        return [((self.conv_kernel - 1, self.conv_dim), self.dtype),
                ((self.num_heads, self.k_head_size, self.head_size), "float32")]  # fmt: skip

    def prep_forward(
        self,
        common: CommonAttentionMetadata,
        block_tables: dict[int, torch.Tensor],
        for_cudagraph_capture: bool = False,
    ) -> None:
        # the kernels save a state after any row: on CUDA every step runs them (the chunked
        # form where every checkpoint ends one of its chunks, else token by token)
        grids = (CHUNKED_GRID, CHECKPOINT_GRID) if self.on_cuda else ()
        self.plan = self.plan_kernel_step(common, block_tables, grids)

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
                                                "key": (key, self.num_heads),
                                                "value": (value, self.num_heads)})  # fmt: skip
        weights: GatedDeltaWeights = kwargs["mixer"]
        plan, gid = self.current_plan(), self.group_of_layer[layer.name]
        convs = self.caches[layer.name][0]  # [num_blocks, K - 1, conv_dim]
        g, beta = decay_and_rate(key, value, weights)  # [T, Hv] float32 each
        if plan.slots is not None:
            return self._forward_kernels(layer, output, query, g, beta, weights, plan.slots[gid])
        rows = plan.requests[gid]
        out = output.view(-1, self.num_heads, self.head_size)
        for row in rows:
            qkv = self.convolve(convs, query[row.start : row.end], row, weights.conv_weight,
                                weights.conv_bias)  # fmt: skip
            o = self._rule(qkv, g[row.start : row.end], beta[row.start : row.end], layer, row)
            out[row.start : row.end] = o.to(out.dtype)
        return output

    def _forward_kernels(
        self, layer: LayerConfig, output: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, weights: GatedDeltaWeights, slots: DeviceSlots,
    ) -> torch.Tensor:  # fmt: skip
        plan = self.current_plan()
        convs, states = self.caches[layer.name]
        shape = (self.num_k_heads, self.k_head_size, self.num_heads, self.head_size)
        if plan.decode:
            o = decode(qkv, g, beta, weights, convs, states, slots, shape)
        else:
            assert plan.query_start_loc is not None
            o = varlen(qkv, g, beta, weights, convs, states, slots, plan.query_start_loc, shape)
        output.view(o.shape).copy_(o)
        return output

    def _rule(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, layer: LayerConfig,
        row: StateRow,
    ) -> torch.Tensor:  # fmt: skip
        """One request's convolved rows through the gated delta rule; writes its states."""
        states = self.caches[layer.name][1]  # [num_blocks, Hv, Dk, Dv] float32
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.num_heads * self.head_size], -1)
        q, k = (t.reshape(-1, self.num_k_heads, self.k_head_size) for t in (q, k))
        q, k = prepare_qk(q, k, self.num_heads)
        v = v.reshape(-1, self.num_heads, self.head_size)
        state = self.read_state(states, row.read)
        if len(v) == 1:
            o, new = gated_delta_step(q, k, v, g, beta, state[None])
            o, state = o[0], new[0]
        else:
            ends = tuple(end for end, _ in row.checkpoints)
            o, state, saved = gated_delta_chunked(
                q, k, v, g, beta, state, self.chunk_size, row.offset, ends
            )
            for (_, block), checkpoint in zip(row.checkpoints, saved, strict=True):
                states[block] = checkpoint
        states[row.write] = state
        return o
