"""Memory planning without allocating (the capacity model): the KV-cache groups of a model, its
capacity under a memory budget, and the same model with full attention on every layer for
comparison.

Holds the attention shapes of real models (`REAL_SHAPES`, `REAL_MLA_SHAPES`, `REAL_V4_SHAPES`),
`Capacity`,
`attention_layers`, `capacity`, `full_capacity`, `compare` (the hybrid plan next to full
allocation, with the achieved and theoretical ratios), the ideal-allocation helpers
(`theoretical_ratio`, `v4_theoretical_ratio`, `ideal_tokens`, `fraction_of_gain`) and
`resolve_model_config` (a model name to its config). Nothing here parses arguments or prints:
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

from typing import Any

import attrs
import torch

from unified_attn.backend import LayerConfig
from unified_attn.backends.deepseek_v4 import DeepseekV4WindowBackend
from unified_attn.backends.mla import MLAReferenceBackend
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.models import (
    DecoderModel,
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    LayerKind,
    ModelConfig,
)
from unified_attn.models.deepseek import DeepseekForCausalLM
from unified_attn.models.deepseek_config import DeepseekConfig
from unified_attn.runner.worker import KVCachePlan, plan_kv_cache
from unified_attn.tensor_specs import StateSpec
from unified_attn.tensor_specs.paged import kv_cache_dtype_name


def _shape(
    name: str, layers: int, heads: int, kv_heads: int, head: int, kinds: list, context: int
) -> ModelConfig:
    return ModelConfig(
        name=name, vocab_size=1024, hidden_size=heads * head, intermediate_size=4 * heads * head,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_size=head,
        max_position_embeddings=context, layer_kinds=kinds,
    )  # fmt: skip


def _alternate(first: LayerKind, second: LayerKind, layers: int) -> list[LayerKind]:
    return [first if i % 2 == 0 else second for i in range(layers)]


# Real models' attention shapes (layer counts, heads, head sizes, layer patterns) and context
# lengths (`max_position_embeddings` of their config.json); the other dimensions do not affect
# the KV cache.
REAL_SHAPES: dict[str, ModelConfig] = {
    "gpt-oss-20b": _shape("gpt-oss-20b", 24, 64, 8, 64,
                          _alternate(LayerKind.sliding(128), LayerKind.full(), 24), 131072),
    "gpt-oss-120b": _shape("gpt-oss-120b", 36, 64, 8, 64,
                           _alternate(LayerKind.sliding(128), LayerKind.full(), 36), 131072),
    "gemma2-9b": _shape("gemma2-9b", 42, 16, 8, 256,
                        _alternate(LayerKind.sliding(4096), LayerKind.full(), 42), 8192),
    "gemma2-27b": _shape("gemma2-27b", 46, 32, 16, 128,
                         _alternate(LayerKind.sliding(4096), LayerKind.full(), 46), 8192),
    "llama4-scout": _shape("llama4-scout", 48, 40, 8, 128,
                           [LayerKind.full() if i % 4 == 3 else LayerKind.chunked(8192)
                            for i in range(48)], 10485760),
    "mistral-7b-v0.1": _shape("mistral-7b-v0.1", 32, 32, 8, 128, [LayerKind.sliding(4096)] * 32,
                              32768),
}  # fmt: skip


def _flash_layer_types(layers: int) -> list[str]:
    """DeepSeek-V4-Flash's schedule: two sliding-only layers, then CSA (ratio 4) on even and
    HCA (ratio 128) on odd layers (the model card's `compress_ratios`)."""
    tail = ["compressed_sparse_attention" if i % 2 == 0 else "heavily_compressed_attention"
            for i in range(2, layers)]  # fmt: skip
    return ["sliding_attention"] * 2 + tail


# DeepSeek-V4-Flash's attention and cache shapes (config.json of deepseek-ai/DeepSeek-V4-Flash;
# the MoE and vocabulary sizes do not affect the KV cache).
REAL_V4_SHAPES: dict[str, DeepseekV4Config] = {
    "deepseek-v4-flash": DeepseekV4Config(
        name="deepseek-v4-flash", vocab_size=129280, hidden_size=4096,
        moe_intermediate_size=2048, num_layers=43, num_heads=64, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
        layer_types=_flash_layer_types(43), mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 40,
        csa_compress_rate=4, hca_compress_rate=128, index_n_heads=64, index_head_dim=128,
        index_topk=512, n_routed_experts=256, num_experts_per_tok=6,
        max_position_embeddings=1048576,
    ),
}  # fmt: skip
# DeepSeek-V2/V3's attention shapes (config.json of deepseek-ai/DeepSeek-V3 and
# deepseek-ai/DeepSeek-V2-Lite; the expert and vocabulary sizes do not affect the KV cache).
REAL_MLA_SHAPES: dict[str, DeepseekConfig] = {
    "deepseek-v3": DeepseekConfig(
        name="deepseek-v3", version="v3", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_layers=61, num_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3,
        max_position_embeddings=163840,
    ),
    "deepseek-v2-lite": DeepseekConfig(
        name="deepseek-v2-lite", version="v2", vocab_size=102400, hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, num_layers=27, num_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        routing="greedy", norm_topk_prob=False, first_k_dense_replace=1,
        max_position_embeddings=163840,
    ),
}  # fmt: skip
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


def backend_options(kv_cache_dtype: str) -> dict[str, Any]:
    """The backend keyword arguments for `kv_cache_dtype` as the engine takes it ("auto": none)."""
    if kv_cache_dtype == "auto":
        return {}
    return {"kv_cache_dtype": kv_cache_dtype_name(kv_cache_dtype)}


def attention_layers(config: PlanConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> list:
    """`(LayerConfig, backend)` of every layer (of every cache user, for DeepSeek-V4), from a
    model built on the meta device (no memory: only the cache configs are needed);
    `kv_cache_dtype` as the engine takes it."""
    options = backend_options(kv_cache_dtype)
    if isinstance(config, DeepseekV4Config):
        v4 = DeepseekV4ForCausalLM(
            config, DeepseekV4WindowBackend, dtype=dtype, device="meta", backend_options=options
        )
        return list(v4.attention_layers())
    if isinstance(config, DeepseekConfig):
        mla = DeepseekForCausalLM(
            config, MLAReferenceBackend, dtype=dtype, device="meta", backend_options=options
        )
        return list(mla.attention_layers())
    model = DecoderModel(
        config, ReferenceAttentionBackend, dtype=dtype, device="meta", backend_options=options
    )
    return list(model.attention_layers())


def full_latent_layers(config: DeepseekV4Config, dtype: torch.dtype) -> list:
    """DeepSeek-V4 without windows or compression: one `head_dim` latent per token and layer
    (shared K = V), kept for the whole request."""
    rope = config.qk_rope_head_dim
    backend = MLAReferenceBackend(
        head_size=config.head_dim, dtype=dtype, kv_lora_rank=config.head_dim - rope
    )
    scale = config.head_dim**-0.5
    heads, dim = config.num_heads, config.head_dim
    return [
        (LayerConfig(f"model.layers.{i}.self_attn", heads, 1, dim, scale), backend)
        for i in range(config.num_layers)
    ]


def full_mha_layers(config: DeepseekConfig, dtype: torch.dtype, kv_cache_dtype: str) -> list:
    """DeepSeek-V2/V3 without the latent: per-head keys and values of `qk_head_dim` each (values
    padded to the key size) in every layer, `kv_cache_dtype` as the engine takes it."""
    backend = ReferenceAttentionBackend(
        num_kv_heads=config.num_heads, head_size=config.qk_head_dim, dtype=dtype,
        **backend_options(kv_cache_dtype),
    )  # fmt: skip
    heads, head = config.num_heads, config.qk_head_dim
    return [
        (LayerConfig(f"model.layers.{i}.self_attn", heads, heads, head, config.softmax_scale),
         backend)
        for i in range(config.num_layers)
    ]  # fmt: skip


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


def all_full(config: ModelConfig) -> ModelConfig:
    """The same model with full attention on every layer (what a non-hybrid manager allocates)."""
    return attrs.evolve(config, layer_kinds=[LayerKind.full()] * config.num_layers)


def theoretical_ratio(
    config: ModelConfig, max_model_len: int, max_in_flight_tokens: int, state_tokens: float = 0.0
) -> float:
    """Bytes per request with full allocation over bytes with ideal per-layer allocation (no
    group padding, token-exact windows, sink tokens kept, one state per state layer): the most
    the hybrid manager can gain. `state_tokens`: a state layer's state in tokens of one full
    layer's KV (full allocation makes the state layers full attention layers)."""
    in_flight = min(max_in_flight_tokens, max_model_len)
    ideal = sum(
        state_tokens
        if kind.kind == "linear_state"
        else ideal_tokens(kind, max_model_len, in_flight)
        for kind in config.layer_kinds
    )
    return config.num_layers * max_model_len / ideal if ideal else float("inf")


def state_size_in_tokens(hybrid: KVCachePlan, full: KVCachePlan) -> float:
    """One state layer's state bytes over one full layer's KV bytes per token (0: no state)."""
    states = [lp.spec for g in hybrid.groups for lp in g.layers if isinstance(lp.spec, StateSpec)]
    if not states:
        return 0.0
    layer = full.groups[0].layers[0].spec
    per_token = layer.page_size_bytes(full.block_size) / full.block_size
    return states[0].page_size_bytes(hybrid.block_size) / per_token


def ideal_tokens(kind: LayerKind, max_model_len: int, in_flight: int) -> int:
    """Tokens one layer of `kind` must hold for a request of `max_model_len` tokens."""
    if kind.window is not None:
        return min(kind.window - 1 + kind.sink_tokens + in_flight, max_model_len)
    if kind.chunk is not None:
        return min(kind.chunk + in_flight, max_model_len)
    return max_model_len


def full_capacity(config: PlanConfig, memory: int, max_model_len: int, **kwargs: Any) -> Capacity:
    """The capacity of the same model with full attention on every layer (DeepSeek-V4: one
    full latent per layer, `full_latent_layers`)."""
    if isinstance(config, DeepseekV4Config):
        layers = full_latent_layers(config, kwargs.get("dtype", torch.bfloat16))
        options = {k: v for k, v in kwargs.items() if k != "kv_cache_dtype"}
        return capacity(config, memory, max_model_len, layers=layers, **options)
    if isinstance(config, DeepseekConfig):
        layers = full_mha_layers(config, kwargs.get("dtype", torch.bfloat16),
                                 kwargs.get("kv_cache_dtype", "auto"))  # fmt: skip
        return capacity(config, memory, max_model_len, layers=layers, **kwargs)
    return capacity(all_full(config), memory, max_model_len, **kwargs)


def v4_theoretical_ratio(config: DeepseekV4Config, max_model_len: int, in_flight: int) -> float:
    """Full latents over the least a DeepSeek-V4 request must hold (values per layer): its
    window, the compressed entries and indexer keys, and the compressors' raw rows."""
    length = max_model_len

    def tokens(window: int) -> int:
        return min(window - 1 + in_flight, length)

    dim, idx = config.head_dim, config.index_head_dim
    ideal = float(config.num_layers * tokens(config.sliding_window) * dim)
    csa, hca = config.csa_compress_rate, config.hca_compress_rate
    ideal += config.layer_count("compressed_sparse_attention") * (
        length / csa * (dim + idx) + tokens(2 * csa) * 2 * (2 * dim + 2 * idx)
    )
    ideal += config.layer_count("heavily_compressed_attention") * (
        length / hca * dim + tokens(hca) * 2 * dim
    )
    return config.num_layers * length * dim / ideal


def mla_theoretical_ratio(config: DeepseekConfig) -> float:
    """Per-head keys and values (`full_mha_layers`) over one latent, per token and layer."""
    return 2 * config.num_heads * config.qk_head_dim / config.latent_size


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
    if isinstance(config, DeepseekV4Config):
        in_flight = min(max_in_flight_tokens, max_model_len)
        ideal = v4_theoretical_ratio(config, max_model_len, in_flight)
    elif isinstance(config, DeepseekConfig):
        ideal = mla_theoretical_ratio(config)
    else:
        state_tokens = state_size_in_tokens(hybrid.plan, full.plan)
        ideal = theoretical_ratio(config, max_model_len, max_in_flight_tokens, state_tokens)
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
    """A preset, a real-model shape (REAL_SHAPES, REAL_MLA_SHAPES, REAL_V4_SHAPES) or a Hugging
    Face checkpoint directory."""
    from pathlib import Path

    from unified_attn.models import MLA_PRESETS, PRESETS, V4_PRESETS, get_preset
    from unified_attn.models.deepseek_hf import deepseek_config_from_hf
    from unified_attn.models.deepseek_v4_hf import deepseek_v4_config_from_hf
    from unified_attn.models.hf import config_from_hf, read_hf_config
    from unified_attn.models.hf_config import encoder_family, is_deepseek_v4, mla_version

    if name in PRESETS:
        return get_preset(name)
    if name in REAL_SHAPES:
        return REAL_SHAPES[name]
    if name in MLA_PRESETS or name in REAL_MLA_SHAPES:
        return {**MLA_PRESETS, **REAL_MLA_SHAPES}[name]
    if name in V4_PRESETS or name in REAL_V4_SHAPES:
        return {**V4_PRESETS, **REAL_V4_SHAPES}[name]
    path = Path(name).expanduser()
    if path.is_dir():
        hf = read_hf_config(path)
        if is_deepseek_v4(hf):
            return deepseek_v4_config_from_hf(hf, name=path.name)
        if mla_version(hf) is not None:
            return deepseek_config_from_hf(hf, name=path.name)
        family = encoder_family(hf)
        if family is not None:
            raise ValueError(
                f"plan compares a decoder's layer kinds with full attention; {path.name} is "
                f"{'an encoder-only' if family == 'bert' else 'an encoder-decoder'} "
                f"({family.upper()}) checkpoint: `unified-attn run --model {name}` reports its "
                "KV cache"
            )
        return config_from_hf(hf, name=path.name)
    presets = ", ".join(sorted([*PRESETS, *MLA_PRESETS, *V4_PRESETS]))
    shapes = ", ".join(sorted([*REAL_SHAPES, *REAL_MLA_SHAPES, *REAL_V4_SHAPES]))
    raise ValueError(
        f"model {name!r} is not a preset ({presets}), a real-model shape ({shapes}) or a "
        "checkpoint directory; see `unified-attn models`"
    )
