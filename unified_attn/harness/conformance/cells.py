"""The cells of the conformance grid: `Cell` (a batch's shape and the layer's options), `mixed`
cells, the CPU `GRID` and the half-precision `CUDA_CELLS`."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from unified_attn.backend import LayerConfig
from unified_attn.selector import SelectorConfig

LAYER = "layers.0.self_attn"


@attrs.frozen
class Cell:
    name: str
    computed: tuple[int, ...]
    new: tuple[int, ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    block_size: int = 16
    sliding_window: int | None = None
    chunk_size: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    dtype: torch.dtype = torch.float32

    def layer(self) -> LayerConfig:
        return LayerConfig(
            LAYER,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            scale=self.head_size**-0.5,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.soft_cap,
            chunk_size=self.chunk_size,
        )

    def backend_kwargs(self) -> dict[str, Any]:
        return {
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": self.dtype,
            "sliding_window": self.sliding_window,
            "attention_chunk_size": self.chunk_size,
        }

    def selector_config(self, device: str) -> SelectorConfig:
        return SelectorConfig(
            head_size=self.head_size,
            dtype=self.dtype,
            block_size=self.block_size,
            has_sinks=self.sinks,
            sliding_window=self.sliding_window,
            attention_chunk_size=self.chunk_size,
            device=device,
            use_batch_invariant=False,
        )


def mixed(name: str, **options: Any) -> Cell:
    """A prefill, two decodes and a chunked prefill in one batch."""
    return Cell(name, computed=(0, 17, 40, 5), new=(13, 1, 1, 20), **options)


GRID = (
    Cell("prefill", computed=(0, 0), new=(7, 12)),
    Cell("decode", computed=(5, 17, 33), new=(1, 1, 1)),
    mixed("mixed"),
    Cell("chunked prefill", computed=(16, 9, 3), new=(8, 5, 2)),
    mixed("sliding window 8", sliding_window=8),
    mixed("chunked local 16", chunk_size=16),
    mixed("learned sinks", sinks=True),
    mixed("soft cap 2", soft_cap=2.0),
    mixed("GQA 1:1 (MHA)", num_heads=4, num_kv_heads=4),
    mixed("GQA 8:1, head 32", num_heads=8, num_kv_heads=1, head_size=32),
    mixed("block size 8", block_size=8),
)
CUDA_CELLS = tuple(
    attrs.evolve(cell, name=f"{cell.name}, {str(dtype)[6:]}", dtype=dtype)
    for dtype in (torch.float16, torch.bfloat16)
    for cell in GRID
    if cell.name in ("mixed", "decode", "sliding window 8", "learned sinks")
)
