"""The cells of the conformance grid, each carrying its attention type: `Cell` (a batch's shape
and the layer's options: decoder cells, and encoder / encoder-only cells that keep no cache),
`CrossCell` (cross-attention over encoder keys written in earlier steps), the CPU grids `GRID`,
`ENCODER_GRID`, `CROSS_GRID` and `FP8_GRID` (decoder cells over an fp8 KV cache), and the
half-precision `CUDA_CELLS`."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from unified_attn.backend import AttentionType, LayerConfig
from unified_attn.selector import SelectorConfig

LAYER = "layers.0.self_attn"
NO_CACHE_TYPES = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)


def selector_config(
    layer: LayerConfig, dtype: torch.dtype, block_size: int, device: str, **fields: Any
) -> SelectorConfig:
    """What a backend must support to serve a cell's `layer` (`fields`: the KV-cache dtype,
    learned sinks), in the engine's default (not batch-invariant) mode."""
    return SelectorConfig(
        head_size=layer.head_size,
        dtype=dtype,
        block_size=block_size,
        sliding_window=layer.sliding_window,
        attention_chunk_size=layer.chunk_size,
        logits_soft_cap=layer.logits_soft_cap,
        attn_type=layer.attn_type,
        device=device,
        **fields,
    )


@attrs.frozen
class Cell:
    """One step of `new` tokens after `computed` ones per request. Encoder and encoder-only
    cells (no cache, compared with SDPA) have nothing computed and plain attention only."""

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
    sink_tokens: int = 0  # StreamingLLM: the first tokens every query sees (with a window)
    dtype: torch.dtype = torch.float32
    attn_type: AttentionType = AttentionType.DECODER
    # "fp8": the backend stores K/V as float8 e4m3 (compared by `fp8.compare_fp8`)
    kv_cache_dtype: str = "auto"
    # fp8 cells: checkpoint scales (k, v) passed as the `kv_scales` forward kwarg (None: the
    # backend calibrates on the first step), and a gain on the keys and values of the cell's
    # own step (> 1: they exceed what the history step calibrated, so the cache saturates)
    kv_scales: tuple[float, float] | None = None
    new_kv_gain: float = 1.0

    def __attrs_post_init__(self) -> None:
        if self.attn_type == AttentionType.ENCODER_DECODER:
            raise ValueError(f"cell {self.name!r}: cross-attention cells are `CrossCell`s")
        fp8_only = self.kv_scales is not None or self.new_kv_gain != 1.0
        if fp8_only and self.kv_cache_dtype == "auto":
            raise ValueError(f"cell {self.name!r}: kv_scales and new_kv_gain need an fp8 cache")
        if self.kv_cache_dtype != "auto" and self.attn_type != AttentionType.DECODER:
            raise ValueError(f"cell {self.name!r}: fp8 cells are decoder cells")
        if self.sink_tokens and self.sliding_window is None:
            raise ValueError(f"cell {self.name!r}: sink_tokens need a sliding window")
        options = {"sliding_window": self.sliding_window, "chunk_size": self.chunk_size,
                   "soft_cap": self.soft_cap, "sinks": self.sinks or None,
                   "sink_tokens": self.sink_tokens or None}  # fmt: skip
        used = [k for k, v in options.items() if v is not None]
        if self.attn_type in NO_CACHE_TYPES and (any(self.computed) or used):
            raise ValueError(
                f"cell {self.name!r}: {self.attn_type.value} cells have nothing computed and "
                f"plain attention (their oracle is SDPA), got computed={self.computed}, {used}"
            )

    def layer(self) -> LayerConfig:
        return LayerConfig(
            LAYER,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            scale=self.head_size**-0.5,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.soft_cap,
            attn_type=self.attn_type,
            chunk_size=self.chunk_size,
        )

    def backend_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": self.dtype,
            "sliding_window": self.sliding_window,
            "attention_chunk_size": self.chunk_size,
            "attn_type": self.attn_type,
        }
        if self.kv_cache_dtype != "auto":
            kwargs["kv_cache_dtype"] = self.kv_cache_dtype
        if self.sink_tokens:
            kwargs["num_sink_tokens"] = self.sink_tokens
        return kwargs

    def selector_config(self, device: str) -> SelectorConfig:
        options = {"kv_cache_dtype": self.kv_cache_dtype, "has_sinks": self.sinks,
                   "num_sink_tokens": self.sink_tokens}  # fmt: skip
        return selector_config(self.layer(), self.dtype, self.block_size, device, **options)


@attrs.frozen
class CrossCell:
    """Cross-attention in several steps. `steps[s][i]` decoder tokens of request i in step s
    (0: not scheduled); a request's encoder keys and values are written in the first step it is
    scheduled in (as the runner does at admission) and read from the cache afterwards."""

    name: str
    encoder: tuple[int, ...]  # encoder length of each request
    steps: tuple[tuple[int, ...], ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    attn_type: AttentionType = attrs.field(default=AttentionType.ENCODER_DECODER, init=False)

    def __attrs_post_init__(self) -> None:
        shaped = min(self.encoder) > 0 and all(len(s) == len(self.encoder) for s in self.steps)
        scheduled = all(any(s[i] for s in self.steps) for i in range(len(self.encoder)))
        if not (shaped and scheduled):
            raise ValueError(
                f"cell {self.name!r}: every request needs a positive encoder length and decoder "
                f"tokens in some step, got encoder={self.encoder}, steps={self.steps}"
            )

    @property
    def max_encoder_len(self) -> int:
        return max(self.encoder)

    def layer(self) -> LayerConfig:
        return LayerConfig(
            LAYER,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            scale=self.head_size**-0.5,
            attn_type=self.attn_type,
        )

    def backend_kwargs(self) -> dict[str, Any]:
        return {
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": self.dtype,
            "attn_type": self.attn_type,
            "max_encoder_len": self.max_encoder_len,
        }

    def selector_config(self, device: str) -> SelectorConfig:
        return selector_config(self.layer(), self.dtype, self.block_size, device)


AttentionCell = Cell | CrossCell


def mixed(name: str, **options: Any) -> Cell:
    """A prefill, two decodes and a chunked prefill in one batch."""
    return Cell(name, computed=(0, 17, 40, 5), new=(13, 1, 1, 20), **options)


def packed(name: str, attn_type: AttentionType, **options: Any) -> Cell:
    """An encoder pass: four whole inputs of mixed lengths (one of a single token)."""
    return Cell(name, computed=(0, 0, 0, 0), new=(13, 1, 37, 6), attn_type=attn_type, **options)


def admit_then_decode(name: str, **options: Any) -> CrossCell:
    """Step 1 writes every encoder (one spans three blocks) and runs decoder chunks (one longer
    than its encoder, one a single token); step 2 writes nothing and decodes a token each."""
    return CrossCell(name, encoder=(5, 1, 19, 40), steps=((3, 4, 1, 6), (1, 1, 1, 1)), **options)


GRID = (
    Cell("prefill", computed=(0, 0), new=(7, 12)),
    Cell("decode", computed=(5, 17, 33), new=(1, 1, 1)),
    mixed("mixed"),
    Cell("chunked prefill", computed=(16, 9, 3), new=(8, 5, 2)),
    mixed("sliding window 8", sliding_window=8),
    mixed("chunked local 16", chunk_size=16),
    mixed("learned sinks", sinks=True),
    mixed("sink tokens 4 + window 8", sliding_window=8, sink_tokens=4),
    mixed("soft cap 2", soft_cap=2.0),
    mixed("GQA 1:1 (MHA)", num_heads=4, num_kv_heads=4),
    mixed("GQA 8:1, head 32", num_heads=8, num_kv_heads=1, head_size=32),
    mixed("block size 8", block_size=8),
)
ENCODER_GRID = (
    packed("encoder-only: mixed lengths", AttentionType.ENCODER_ONLY),
    packed("encoder-only: MHA", AttentionType.ENCODER_ONLY, num_kv_heads=4),
    packed("encoder: mixed lengths", AttentionType.ENCODER),
    packed("encoder: MHA, head 32", AttentionType.ENCODER, num_kv_heads=4, head_size=32),
)
CROSS_GRID = (
    admit_then_decode("cross: admit, then decode"),
    admit_then_decode("cross: MHA, block size 8", num_kv_heads=4, block_size=8),
    # request 2 is admitted (its encoder written) while 0 and 1 read theirs from the cache
    CrossCell(
        "cross: staggered admission, GQA 8:1",
        encoder=(7, 23, 2),
        steps=((2, 5, 0), (1, 1, 3), (1, 1, 1)),
        num_heads=8,
        num_kv_heads=1,
        head_size=32,
    ),
)
FP8_GRID = (
    Cell("fp8 cache: prefill", computed=(0, 0), new=(7, 12), kv_cache_dtype="fp8"),
    Cell("fp8 cache: decode", computed=(5, 17, 33), new=(1, 1, 1), kv_cache_dtype="fp8"),
    mixed("fp8 cache: mixed", kv_cache_dtype="fp8"),
    mixed("fp8 cache: sliding window 8", sliding_window=8, kv_cache_dtype="fp8"),
    mixed("fp8 cache: sinks, soft cap 2", sinks=True, soft_cap=2.0, kv_cache_dtype="fp8"),
    mixed("fp8 cache: GQA 8:1, head 32", num_heads=8, num_kv_heads=1, head_size=32,
          kv_cache_dtype="fp8"),
    mixed("fp8 cache: checkpoint scales", kv_cache_dtype="fp8", kv_scales=(0.02, 0.03)),
    mixed("fp8 cache: saturation", kv_cache_dtype="fp8", new_kv_gain=4.0),
    mixed("fp8 cache: float16", kv_cache_dtype="fp8", dtype=torch.float16),
)  # fmt: skip
HALF_PRECISION = (
    "mixed",
    "decode",
    "sliding window 8",
    "learned sinks",
    "encoder-only: mixed lengths",
    "encoder: mixed lengths",
    "cross: admit, then decode",
)
CUDA_CELLS: tuple[AttentionCell, ...] = tuple(
    attrs.evolve(cell, name=f"{cell.name}, {str(dtype)[6:]}", dtype=dtype)
    for dtype in (torch.float16, torch.bfloat16)
    for cell in GRID + ENCODER_GRID + CROSS_GRID
    if cell.name in HALF_PRECISION
) + tuple(
    attrs.evolve(cell, name=f"{cell.name}, bfloat16", dtype=torch.bfloat16)
    for cell in FP8_GRID
    if cell.name in ("fp8 cache: mixed", "fp8 cache: decode", "fp8 cache: sinks, soft cap 2")
)
