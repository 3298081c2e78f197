"""What the state backends (linear attention, Mamba-2, gated delta-net) share: a
`StateManager` in the engine's cache mode (with a slot per draft token under speculative
decoding), decoder layers only, one state per block of the shapes a subclass names, and the
host plan of where each request reads and writes (`state_rows`)."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import torch

from unified_attn.backend import (
    AttentionBackend,
    AttentionType,
    CacheConfig,
    CommonAttentionMetadata,
    LayerConfig,
)
from unified_attn.backends.state_rows import StateRow, state_rows
from unified_attn.managers import StateManager
from unified_attn.selector import SelectorConfig
from unified_attn.tensor_specs import StateSpec

PlanT = TypeVar("PlanT")


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

    def plan_rows(
        self, common: CommonAttentionMetadata, block_tables: dict[int, torch.Tensor]
    ) -> dict[int, list[StateRow]]:
        """Per group, where each request of the step reads and writes its state."""
        mode = self.manager_config.mamba_cache_mode
        return {
            gid: state_rows(common, block_tables[gid], common.block_sizes[gid], mode)
            for gid in set(self.group_of_layer.values())
        }

    @staticmethod
    def read_state(states: torch.Tensor, block: int | None) -> torch.Tensor:
        """A copy of the state in `block` (zeros for None: nothing computed yet)."""
        if block is None:
            return torch.zeros(states.shape[1:], dtype=states.dtype, device=states.device)
        return states[block].clone()
