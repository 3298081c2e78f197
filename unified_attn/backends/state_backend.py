"""What the state backends (linear attention, Mamba-2, gated delta-net) share: a
`StateManager` in the engine's cache mode (with a slot per draft token under speculative
decoding), decoder layers only, one state per block of the shapes a subclass names, and the
host plan of where each request reads and writes (`state_rows`)."""

from __future__ import annotations

import math
from typing import Any, Literal, TypeVar

import attrs
import torch

from unified_attn.backend import (
    AttentionBackend,
    AttentionType,
    CacheConfig,
    CommonAttentionMetadata,
    LayerConfig,
    check_dtype_device,
)
from unified_attn.backends.mamba_math import causal_conv1d
from unified_attn.backends.state_rows import StateRow, state_rows
from unified_attn.backends.state_slots import DeviceSlots, device_slots, host_slots
from unified_attn.managers import StateManager
from unified_attn.selector import SelectorConfig
from unified_attn.tensor_specs import StateSpec

PlanT = TypeVar("PlanT")


@attrs.frozen
class KernelStepPlan:
    """A step of a state backend with a kernel path (Mamba-2, gated delta-net)."""

    requests: dict[int, list[StateRow]]  # host: group id -> one row per request (torch path)
    # group id -> the step's slots for the kernels; None: the torch path
    slots: dict[int, DeviceSlots] | None = None
    query_start_loc: torch.Tensor | None = None  # device [R + 1] int32 (varlen steps)
    decode: bool = False  # one token per request: the one-token kernels


class StateBackend(AttentionBackend[PlanT]):
    """Subclasses name their per-block state tensors (`state_shapes`) and run the recurrence."""

    def __init__(
        self,
        *,
        num_heads: int,
        head_size: int,
        dtype: torch.dtype | str,
        mamba_cache_mode: Literal["none", "align", "all"] = "align",
        num_speculative_blocks: int = 0,
        **options: Any,
    ) -> None:
        super().__init__(num_kv_heads=num_heads, head_size=head_size, dtype=dtype, **options)
        self.num_heads = num_heads
        self.manager_config = StateManager.Config(
            mamba_cache_mode=mamba_cache_mode, num_speculative_blocks=num_speculative_blocks
        )
        # layer -> its state tensors, in `state_shapes` order, each `[num_blocks, *shape]`
        self.caches: dict[str, tuple[torch.Tensor, ...]] = {}
        self.on_cuda = False

    @classmethod
    def validate_configuration(cls, cfg: SelectorConfig) -> list[str]:
        if cfg.attn_type != AttentionType.DECODER:
            return [f"attention type {cfg.attn_type.value} is not supported"]
        return []

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype | str]]:
        """(shape, dtype) of each state tensor a block holds, in order."""
        raise NotImplementedError

    def get_cache_config(self) -> CacheConfig:
        shapes = self.state_shapes()
        spec = StateSpec(shapes=[s for s, _ in shapes], dtypes=[d for _, d in shapes])
        return StateManager, self.manager_config, spec

    def check_layer(self, layer: LayerConfig) -> None:
        if (layer.num_heads, layer.head_size) != (self.num_heads, self.head_size):
            raise ValueError(
                f"layer {layer.name}: (num_heads, head_size)=({layer.num_heads}, "
                f"{layer.head_size}) but the backend has ({self.num_heads}, {self.head_size})"
            )

    def check_state_inputs(
        self, layer: LayerConfig, output: torch.Tensor, inputs: dict[str, tuple[torch.Tensor, int]]
    ) -> None:
        """`ValueError` naming the layer unless `output` is `[T, H * D]` and each named input
        `[T, width]` (or `[T, ...]` of `width` features) on the output's device, the query (the
        convolution's input, whose last rows the state blocks keep) in the backend's dtype."""
        self.check_layer(layer)
        num_tokens = output.shape[0]
        expected = {"output": (output, self.num_heads * self.head_size), **inputs}
        for what, (tensor, width) in expected.items():
            if (tensor.shape[0], math.prod(tensor.shape[1:])) != (num_tokens, width):
                raise ValueError(
                    f"layer {layer.name}: {what} has shape {tuple(tensor.shape)}, expected "
                    f"({num_tokens}, {width})"
                )
            if tensor.device != output.device:
                raise ValueError(
                    f"layer {layer.name}: {what} is on {tensor.device}, expected {output.device}"
                )
        check_dtype_device(layer, "query", inputs["query"][0], self.dtype, output.device)

    def bind_kv_caches(self, kv_caches: dict[str, Any], block_table_map: dict[str, int]) -> None:
        self.caches = {name: tuple(views) for name, views in kv_caches.items()}
        self.group_of_layer = dict(block_table_map)
        self.on_cuda = any(v.device.type == "cuda" for vs in self.caches.values() for v in vs)

    def plan_rows(
        self, common: CommonAttentionMetadata, block_tables: dict[int, torch.Tensor]
    ) -> dict[int, list[StateRow]]:
        """Per group, where each request of the step reads and writes its state."""
        mode = self.manager_config.mamba_cache_mode
        tables = common.block_tables_cpu or block_tables  # the host copy: no wait for the device
        return {
            gid: state_rows(common, tables[gid], common.block_sizes[gid], mode)
            for gid in set(self.group_of_layer.values())
        }

    def plan_kernel_step(
        self, common: CommonAttentionMetadata, block_tables: dict[int, torch.Tensor],
        checkpoint_grids: tuple[int, ...],
    ) -> KernelStepPlan:  # fmt: skip
        """The step's plan: in a CUDA-graph decode step, slots from device tensors alone
        (captured with the forward); else the host rows, and slots for the kernels on the
        first of `checkpoint_grids` (the rows on which they can save a state, tried in order;
        empty: the torch path) that every checkpoint falls on."""
        groups = set(self.group_of_layer.values())
        mode = self.manager_config.mamba_cache_mode
        if common.graph_step:
            return KernelStepPlan({}, {
                gid: device_slots(common.seq_lens, block_tables[gid], common.block_sizes[gid],
                                  mode) for gid in groups}, decode=True)  # fmt: skip
        rows = self.plan_rows(common, block_tables)
        slots = None
        device = common.query_start_loc.device
        for grid in checkpoint_grids:
            planned = {gid: host_slots(rows[gid], grid, device) for gid in groups}
            if all(s is not None for s in planned.values()):
                slots = {gid: s for gid, s in planned.items() if s is not None}
                break
        return KernelStepPlan(rows, slots, common.query_start_loc[: common.num_reqs + 1],
                              decode=common.max_query_len == 1)  # fmt: skip

    def convolve(
        self, convs: torch.Tensor, inputs: torch.Tensor, row: StateRow,
        weight: torch.Tensor, bias: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """One request's causal convolution (torch path): from the inputs carried in its read
        block, writing the last `K - 1` inputs to its write block and, at each checkpoint, the
        inputs before it. inputs `[L, C]` -> SiLU(conv) `[L, C]`."""
        before = self.read_state(convs, row.read)
        out, carried = causal_conv1d(inputs, before, weight, bias)
        convs[row.write] = carried.to(convs.dtype)
        if row.checkpoints:
            window = torch.cat([before.to(inputs.dtype), inputs])
            for rows_done, block in row.checkpoints:
                convs[block] = window[rows_done : rows_done + weight.shape[1] - 1]
        return out

    @staticmethod
    def read_state(states: torch.Tensor, block: int | None) -> torch.Tensor:
        """A copy of the state in `block` (zeros for None: nothing computed yet)."""
        if block is None:
            return torch.zeros(states.shape[1:], dtype=states.dtype, device=states.device)
        return states[block].clone()
