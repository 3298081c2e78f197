"""Memory planning without allocating (the capacity model): the KV-cache groups of a model, its
capacity under a memory budget, and the same model with full attention on every layer for
comparison.

Holds `Capacity`, `attention_layers`, `capacity`, `full_capacity`, `compare` (the hybrid plan
next to full allocation, with the achieved and theoretical ratios), `fraction_of_gain` and
`resolve_model_config` (a model name to its config). What differs by model family (its
full-attention layers, its ideal allocation, its real-model shapes) is the family's
(`models/families/`). Nothing here parses arguments or prints:
the `unified-attn plan` command is `unified_attn/cli/plan.py`.

DeepSeek-V4 models (a preset, `deepseek-v4-flash` or a checkpoint) plan their cache users from
the model built on the meta device; their comparison keeps one `head_dim` latent per token and
layer for the whole request (what a cache without windows or compression holds).

DeepSeek-V2/V3 models (MLA: a preset, `deepseek-v3`, `deepseek-v2-lite` or a checkpoint) plan
their latent cache (`kv_lora_rank + qk_rope_head_dim` values per token and layer) from the model
built on the meta device; their comparison is attention without the latent: per-head keys and
values of `qk_head_dim` each (values padded to the key size, as FlashAttention-style paged
kernels need one head size and as vLLM served DeepSeek-V2 before its MLA backends).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch

from unified_attn.backend import AttentionBackend
from unified_attn.backends.mla import MLAReferenceBackend
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.models import DeepseekV4Config, ModelConfig
from unified_attn.models.deepseek_config import DeepseekConfig
from unified_attn.models.families import (
    family_for_hf,
    family_of,
    family_of_preset,
    kv_cache_options,
    preset_names,
    shape_names,
)
from unified_attn.models.families.decoder_family import all_full
from unified_attn.models.hf import read_hf_config
from unified_attn.models.real_shapes import REAL_MLA_SHAPES, REAL_SHAPES, REAL_V4_SHAPES
from unified_attn.runner.worker import KVCachePlan, plan_kv_cache
from unified_attn.selector import select_backend
from unified_attn.tensor_specs import StateSpec

# the real-model shapes live with the models (`models/real_shapes.py`)
PlanConfig = ModelConfig | DeepseekConfig | DeepseekV4Config


@attrs.frozen
class Capacity:
    plan: KVCachePlan
    num_blocks: int
    blocks_per_request: tuple[int, ...]
    max_model_len: int

    @property
    def max_concurrency(self) -> float:
        return self.num_blocks / max(sum(self.blocks_per_request), 1)

    @property
    def capacity_tokens(self) -> int:
        return int(self.max_concurrency * self.max_model_len)

    @property
    def fits_one_request(self) -> bool:
        """Whether one request of `max_model_len` fits (the engine refuses a budget where not)."""
        return self.num_blocks >= sum(self.blocks_per_request)

    def as_dict(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "block_size": plan.block_size,
            "bytes_per_block": plan.bytes_per_block,
            "num_blocks": self.num_blocks,
            "capacity_tokens": self.capacity_tokens,
            "max_concurrency": self.max_concurrency,
            "fits_one_request": self.fits_one_request,
            "groups": [
                {
                    "manager": g.manager_cls.__name__,
                    "config": attrs.asdict(g.config) if attrs.has(type(g.config)) else {},
                    "layers": len(g.layers),
                    "block_size": g.block_size,
                    "page_bytes": g.page_bytes(),
                    "wasted_bytes_per_block": wasted,
                    "blocks_per_request": n,
                }
                for g, n, wasted in zip(
                    plan.groups,
                    self.blocks_per_request,
                    plan.wasted_bytes_per_block(),
                    strict=True,
                )
            ],
        }


# the reference classes the planner builds full-attention layers with (`full_attention_layers`)
REFERENCE_CLASSES: dict[str, type[AttentionBackend]] = {
    "paged": ReferenceAttentionBackend,
    "latent": MLAReferenceBackend,
}


def planning_backend(config: PlanConfig, dtype: torch.dtype, kv_cache_dtype: str) -> type:
    """The backend that serves `config`'s layers on the CPU (the reference of its layer kind):
    only its cache configs are needed."""
    return select_backend(
        family_of(config).selector_configs(config, dtype, kv_cache_dtype=kv_cache_dtype)
    )


def attention_layers(config: PlanConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> list:
    """`(LayerConfig, backend)` of every layer (of every cache user, for DeepSeek-V4), from a
    model built on the meta device (no memory: only the cache configs are needed);
    `kv_cache_dtype` as the engine takes it."""
    backend_cls = planning_backend(config, dtype, kv_cache_dtype)
    model = family_of(config).build(config, backend_cls, dtype=dtype, device="meta",
                                    backend_options=kv_cache_options(kv_cache_dtype))  # fmt: skip
    return list(model.attention_layers())


def capacity(
    config: PlanConfig,
    memory: int,
    max_model_len: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int | None = None,
    max_in_flight_tokens: int = 8192,
    kv_cache_dtype: str = "auto",
    layers: list | None = None,
) -> Capacity:
    """The plan of `config`'s layers (or of `layers`) and its capacity under `memory`."""
    if layers is None:
        layers = attention_layers(config, dtype, kv_cache_dtype)
    plan = plan_kv_cache(layers, block_size)
    in_flight = min(max_in_flight_tokens, max_model_len)
    per_request = tuple(plan.blocks_per_request(max_model_len, in_flight))
    num_blocks = memory // plan.bytes_per_block - 1 if plan.bytes_per_block else 0  # null block
    return Capacity(plan, max(num_blocks, 0), per_request, max_model_len)


def state_size_in_tokens(hybrid: KVCachePlan, full: KVCachePlan) -> float:
    """One state layer's state bytes over one full layer's KV bytes per token (0: no state)."""
    states = [lp.spec for g in hybrid.groups for lp in g.layers if isinstance(lp.spec, StateSpec)]
    if not states:
        return 0.0
    layer = full.groups[0].layers[0].spec
    per_token = layer.page_size_bytes(full.block_size) / full.block_size
    return states[0].page_size_bytes(hybrid.block_size) / per_token


def full_capacity(config: PlanConfig, memory: int, max_model_len: int, **kwargs: Any) -> Capacity:
    """The capacity of the same model with full attention on every layer (the family's
    `full_attention_layers`: DeepSeek-V4 one full latent per layer, DeepSeek-V2/V3 per-head
    keys and values)."""
    layers = family_of(config).full_attention_layers(
        config, kwargs.get("dtype", torch.bfloat16), kwargs.get("kv_cache_dtype", "auto"),
        REFERENCE_CLASSES,
    )  # fmt: skip
    return capacity(config, memory, max_model_len, layers=layers, **kwargs)


def fraction_of_gain(achieved: float, ideal: float) -> float | None:
    """How much of the theoretical gain the plan achieves (negative: a loss); None when no
    gain is possible (the ideal ratio is 1)."""
    return (achieved - 1) / (ideal - 1) if ideal > 1 else None


def compare(
    config: PlanConfig,
    memory: int,
    max_model_len: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int | None = None,
    max_in_flight_tokens: int = 8192,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """The hybrid plan next to full allocation, the achieved ratio and the theoretical one."""
    kwargs = dict(dtype=dtype, block_size=block_size, max_in_flight_tokens=max_in_flight_tokens,
                  kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    hybrid = capacity(config, memory, max_model_len, **kwargs)  # type: ignore[arg-type]
    full = full_capacity(config, memory, max_model_len, **kwargs)
    state_tokens = state_size_in_tokens(hybrid.plan, full.plan)
    ideal = family_of(config).theoretical_ratio(
        config, max_model_len, max_in_flight_tokens, state_tokens
    )
    achieved = hybrid.capacity_tokens / max(full.capacity_tokens, 1)
    return {
        "model": config.name,
        "memory_bytes": memory,
        "max_model_len": max_model_len,
        "hybrid": hybrid.as_dict(),
        "full": full.as_dict(),
        "capacity_ratio": achieved,
        "theoretical_ratio": ideal,
        "fraction_of_theoretical_gain": fraction_of_gain(achieved, ideal),
    }


def resolve_model_config(name: str) -> PlanConfig:
    """A preset, a real-model shape (each family's `shapes`) or a Hugging Face checkpoint
    directory."""
    family = family_of_preset(name)
    if family is not None:
        return {**family.presets, **family.shapes}[name]
    path = Path(name).expanduser()
    if path.is_dir():
        hf = read_hf_config(path)
        family = family_for_hf(hf)
        if family.plan_refusal is not None:
            raise ValueError(family.plan_refusal.format(name=path.name, model=name))
        return family.config_from_hf(hf, name=path.name)
    raise ValueError(
        f"model {name!r} is not a preset ({', '.join(preset_names())}), a real-model shape "
        f"({', '.join(shape_names())}) or a checkpoint directory; see `unified-attn models`"
    )


__all__ = [
    "REAL_MLA_SHAPES",
    "REAL_SHAPES",
    "REAL_V4_SHAPES",
    "Capacity",
    "PlanConfig",
    "all_full",
    "attention_layers",
    "capacity",
    "compare",
    "fraction_of_gain",
    "full_capacity",
    "resolve_model_config",
    "state_size_in_tokens",
]
