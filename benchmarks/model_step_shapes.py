"""The real-model shapes `model_step.py` builds with random weights, and what one step of them
must read and compute on one rank: the inputs of its roofline.

`register_shapes` adds the shapes to the engine's presets (in every process that builds one:
the spawned tensor-parallel ranks import the script again). The accounting reads the rank's own
model (`rank_weights`: its shard's parameters, by how a step uses them) and cache
(`attention_shape`), so tensor parallelism's cuts and replications count as they are.
"""

from __future__ import annotations

from typing import Any

import attrs

from unified_attn.models import LayerKind
from unified_attn.models.config import ModelConfig, MoEConfig
from unified_attn.models.moe import StackedExperts
from unified_attn.models.presets import PRESETS, get_preset


def _llama(name: str, **fields: Any) -> ModelConfig:
    """tiny-llama's byte tokenizer ids with a real model's dimensions (all full attention)."""
    return attrs.evolve(
        get_preset("tiny-llama"),
        name=name,
        layer_kinds=[LayerKind.full()] * fields["num_layers"],
        **fields,
    )


def _qwen3_moe(name: str, **fields: Any) -> ModelConfig:
    """Qwen3-MoE's features: q/k norms, routed SwiGLU experts, a float32 softmax over every
    expert with the top-k weights renormalised and rounded to the model dtype."""
    moe = MoEConfig(
        num_experts=fields.pop("num_experts"),
        top_k=fields.pop("top_k"),
        expert_kind="swiglu",
        router_softmax="all",
        routing_weights_dtype="model",
        intermediate_size=fields.pop("moe_intermediate_size"),
    )
    return _llama(name, mlp_kind="moe", moe=moe, qk_norm=True, **fields)


# config.json of meta-llama/Meta-Llama-3-8B (the context of Llama-3.1-8B, the same shape),
# meta-llama/Llama-3.2-1B and Qwen/Qwen3-30B-A3B; RoPE scaling left out.
SHAPES: dict[str, ModelConfig] = {
    "llama-3-8b": _llama(
        "llama-3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_size=128, rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=False,
    ),
    "llama-3.2-1b": _llama(
        "llama-3.2-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_size=64, rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=True,
    ),
    "qwen3-moe-30b-a3b": _qwen3_moe(
        "qwen3-moe-30b-a3b", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_layers=48, num_heads=32, num_kv_heads=4, head_size=128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
        num_experts=128, top_k=8, moe_intermediate_size=768,
    ),
    # CPU smoke runs: tiny-llama with Qwen3-MoE's features
    "tiny-qwen3-moe": _qwen3_moe(
        "tiny-qwen3-moe", vocab_size=384, hidden_size=128, intermediate_size=352, num_layers=4,
        num_heads=4, num_kv_heads=2, head_size=32, num_experts=4, top_k=2,
        moe_intermediate_size=64,
    ),
}  # fmt: skip
GPU_MODELS = ("llama-3-8b", "llama-3.2-1b", "qwen3-moe-30b-a3b")
CPU_MODELS = ("tiny-llama",)


def register_shapes() -> None:
    PRESETS.update(SHAPES)


# ---- what a step reads and computes on one rank -----------------------------------------------


@attrs.frozen
class RankWeights:
    """One rank's parameters (element counts) by how a step reads them: `dense` matrices every
    token multiplies (attention, dense MLP, router), routed `experts` (a token multiplies
    `expert_share` = top_k / num_experts of them), the logits `head` (the embedding when tied;
    it multiplies the sampled rows only) and `vectors` (norms, biases: read, not multiplied).
    An untied embedding is a lookup of one row per token: neither read whole nor multiplied."""

    dense: int
    experts: int
    head: int
    vectors: int
    expert_share: float
    element_bytes: int

    @property
    def bytes(self) -> int:
        return self.element_bytes * (self.dense + self.experts + self.head + self.vectors)


@attrs.frozen
class AttentionShape:
    """Per rank: KV-cache bytes per token (all layers) and attention FLOPs per (query, key)
    pair (QK^T and PV: 4 * query heads * head size, summed over the layers)."""

    kv_bytes_per_token: float
    flops_per_pair: float


@attrs.frozen
class StepCost:
    bytes: float
    flops: float


def rank_weights(model: Any, config: ModelConfig) -> RankWeights:
    lm_head = getattr(model, "lm_head", None)
    head = model.model.embed_tokens.weight if lm_head is None else lm_head.weight
    embedding = model.model.embed_tokens.weight
    experts = {id(p) for m in model.modules() if isinstance(m, StackedExperts)
               for p in m.parameters()}  # fmt: skip
    counts = {"dense": 0, "experts": 0, "vectors": 0}
    for param in model.parameters():
        if param is head or param is embedding:
            continue
        kind = "experts" if id(param) in experts else "dense" if param.dim() >= 2 else "vectors"
        counts[kind] += param.numel()
    share = config.moe.top_k / config.moe.num_experts if config.moe is not None else 0.0
    return RankWeights(head=head.numel(), expert_share=share,
                       element_bytes=head.element_size(), **counts)  # fmt: skip


def attention_shape(report: Any, config: ModelConfig, tp: int) -> AttentionShape:
    """`report`: the engine's `KVCacheReport` (rank 0's cache: its share of the KV heads)."""
    heads = config.num_heads // tp
    return AttentionShape(
        kv_bytes_per_token=report.bytes_per_block / report.block_size,
        flops_per_pair=4 * heads * config.head_size * config.num_layers,
    )


def decode_cost(w: RankWeights, attn: AttentionShape, batch: int, context: float) -> StepCost:
    """One decode step of `batch` requests of mean sequence length `context` (cached tokens and
    the new one): the weights once (of the experts, those some token picks: with uniform
    routing, a share 1 - (1 - top_k / E) ** batch), every request's KV; FLOPs of every token."""
    touched = 1 - (1 - w.expert_share) ** batch
    weights = w.element_bytes * (w.dense + w.head + w.vectors + w.experts * touched)
    pairs = batch * context
    matmul = 2 * batch * (w.dense + w.head + w.experts * w.expert_share)
    return StepCost(weights + attn.kv_bytes_per_token * pairs, matmul + attn.flops_per_pair * pairs)


def prefill_flops(w: RankWeights, attn: AttentionShape, tokens: int) -> float:
    """One request's prompt of `tokens` in one step: every token through the layers, causal
    attention (the visible half), the head on the one sampled row."""
    matmul = 2 * tokens * (w.dense + w.experts * w.expert_share) + 2 * w.head
    return matmul + attn.flops_per_pair * tokens * (tokens + 1) / 2


def roofline_s(cost: StepCost, copy_bytes_per_s: float, matmul_flops_per_s: float) -> float:
    return max(cost.bytes / copy_bytes_per_s, cost.flops / matmul_flops_per_s)


def bound(cost: StepCost, copy_bytes_per_s: float, matmul_flops_per_s: float) -> str:
    memory = cost.bytes / copy_bytes_per_s >= cost.flops / matmul_flops_per_s
    return "memory" if memory else "compute"


def shape_summary(config: ModelConfig) -> dict[str, Any]:
    moe = config.moe
    return {
        "num_layers": config.num_layers, "hidden_size": config.hidden_size,
        "num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads,
        "head_size": config.head_size, "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size, "tie_word_embeddings": config.tie_word_embeddings,
        "num_experts": moe.num_experts if moe else None, "top_k": moe.top_k if moe else None,
        "moe_intermediate_size": moe.intermediate_size if moe else None,
    }  # fmt: skip
