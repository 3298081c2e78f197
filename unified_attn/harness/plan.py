"""Memory planning without allocating: the KV-cache groups of a model, its capacity under a
memory budget, and the same model with full attention on every layer for comparison."""

from __future__ import annotations

import json
from typing import Any

import attrs
import torch

from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.models import DecoderModel, LayerKind, ModelConfig
from unified_attn.runner.worker import KVCachePlan, plan_kv_cache


def _shape(
    name: str, layers: int, heads: int, kv_heads: int, head: int, kinds: list
) -> ModelConfig:
    return ModelConfig(
        name=name, vocab_size=1024, hidden_size=heads * head, intermediate_size=4 * heads * head,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_size=head,
        max_position_embeddings=1 << 20, layer_kinds=kinds,
    )  # fmt: skip


def _alternate(first: LayerKind, second: LayerKind, layers: int) -> list[LayerKind]:
    return [first if i % 2 == 0 else second for i in range(layers)]


# Real models' attention shapes (layer counts, heads, head sizes, layer patterns); the other
# dimensions do not affect the KV cache.
REAL_SHAPES: dict[str, ModelConfig] = {
    "gpt-oss-20b": _shape("gpt-oss-20b", 24, 64, 8, 64,
                          _alternate(LayerKind.sliding(128), LayerKind.full(), 24)),
    "gpt-oss-120b": _shape("gpt-oss-120b", 36, 64, 8, 64,
                           _alternate(LayerKind.sliding(128), LayerKind.full(), 36)),
    "gemma2-9b": _shape("gemma2-9b", 42, 16, 8, 256,
                        _alternate(LayerKind.sliding(4096), LayerKind.full(), 42)),
    "gemma2-27b": _shape("gemma2-27b", 46, 32, 16, 128,
                         _alternate(LayerKind.sliding(4096), LayerKind.full(), 46)),
    "llama4-scout": _shape("llama4-scout", 48, 40, 8, 128,
                           [LayerKind.full() if i % 4 == 3 else LayerKind.chunked(8192)
                            for i in range(48)]),
    "mistral-7b-v0.1": _shape("mistral-7b-v0.1", 32, 32, 8, 128, [LayerKind.sliding(4096)] * 32),
}  # fmt: skip


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

    def as_dict(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "block_size": plan.block_size,
            "bytes_per_block": plan.bytes_per_block,
            "num_blocks": self.num_blocks,
            "capacity_tokens": self.capacity_tokens,
            "max_concurrency": self.max_concurrency,
            "groups": [
                {
                    "manager": g.manager_cls.__name__,
                    "config": attrs.asdict(g.config) if attrs.has(type(g.config)) else {},
                    "layers": len(g.layers),
                    "page_bytes": g.page_bytes(),
                    "blocks_per_request": n,
                }
                for g, n in zip(plan.groups, self.blocks_per_request, strict=True)
            ],
        }


def attention_layers(config: ModelConfig, dtype: torch.dtype) -> list:
    """`(LayerConfig, backend)` of every layer, from a model built on the meta device."""
    model = DecoderModel(config, ReferenceAttentionBackend, dtype=dtype, device="meta")
    return list(model.attention_layers())


def capacity(
    config: ModelConfig,
    memory: int,
    max_model_len: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int | None = None,
    max_in_flight_tokens: int = 8192,
) -> Capacity:
    plan = plan_kv_cache(attention_layers(config, dtype), block_size)
    in_flight = min(max_in_flight_tokens, max_model_len)
    per_request = tuple(plan.blocks_per_request(max_model_len, in_flight))
    num_blocks = memory // plan.bytes_per_block - 1 if plan.bytes_per_block else 0  # null block
    return Capacity(plan, max(num_blocks, 0), per_request, max_model_len)


def all_full(config: ModelConfig) -> ModelConfig:
    """The same model with full attention on every layer (what a non-hybrid manager allocates)."""
    return attrs.evolve(config, layer_kinds=[LayerKind.full()] * config.num_layers)


def theoretical_ratio(config: ModelConfig, max_model_len: int, max_in_flight_tokens: int) -> float:
    """Bytes per request with full allocation over bytes with ideal per-layer allocation (no
    group padding, token-exact windows): the most the hybrid manager can gain."""
    in_flight = min(max_in_flight_tokens, max_model_len)
    ideal = 0
    for kind in config.layer_kinds:
        if kind.window is not None:
            ideal += min(kind.window - 1 + in_flight, max_model_len)
        elif kind.chunk is not None:
            ideal += min(kind.chunk + in_flight, max_model_len)
        else:
            ideal += max_model_len
    return config.num_layers * max_model_len / ideal


def compare(
    config: ModelConfig,
    memory: int,
    max_model_len: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int | None = None,
    max_in_flight_tokens: int = 8192,
) -> dict[str, Any]:
    """The hybrid plan next to full allocation, the achieved ratio and the theoretical one."""
    kwargs = dict(dtype=dtype, block_size=block_size, max_in_flight_tokens=max_in_flight_tokens)
    hybrid = capacity(config, memory, max_model_len, **kwargs)  # type: ignore[arg-type]
    full = capacity(all_full(config), memory, max_model_len, **kwargs)  # type: ignore[arg-type]
    achieved = hybrid.capacity_tokens / max(full.capacity_tokens, 1)
    ideal = theoretical_ratio(config, max_model_len, max_in_flight_tokens)
    return {
        "model": config.name,
        "memory_bytes": memory,
        "max_model_len": max_model_len,
        "hybrid": hybrid.as_dict(),
        "full": full.as_dict(),
        "capacity_ratio": achieved,
        "theoretical_ratio": ideal,
        "fraction_of_theoretical_gain": (achieved - 1) / (ideal - 1) if ideal > 1 else 1.0,
    }


# ---- the `unified-attn plan` command ---------------------------------------------------------


def resolve_model_config(name: str) -> ModelConfig:
    """A preset, a real-model shape (REAL_SHAPES) or a Hugging Face checkpoint directory."""
    from pathlib import Path

    from unified_attn.models import PRESETS, get_preset
    from unified_attn.models.hf import config_from_hf, read_hf_config

    if name in PRESETS:
        return get_preset(name)
    if name in REAL_SHAPES:
        return REAL_SHAPES[name]
    path = Path(name).expanduser()
    if path.is_dir():
        return config_from_hf(read_hf_config(path), name=path.name)
    raise ValueError(
        f"model {name!r} is not a preset ({', '.join(sorted(PRESETS))}), a real-model shape "
        f"({', '.join(sorted(REAL_SHAPES))}) or a checkpoint directory"
    )


def add_parser(commands: Any) -> None:
    plan = commands.add_parser("plan", help="KV-cache groups and capacity, next to full allocation")
    plan.add_argument("--model", default="gpt-oss-20b", help="preset, real shape or checkpoint")
    plan.add_argument("--kv-cache-memory", default="40GiB")
    plan.add_argument("--max-model-len", type=int, default=32768)
    plan.add_argument("--max-num-batched-tokens", type=int, default=2048,
                      help="tokens in flight per request (sizes window groups)")  # fmt: skip
    plan.add_argument("--dtype", default="bfloat16")
    plan.add_argument("--block-size", type=int, default=None)
    plan.add_argument("--json", action="store_true")
    plan.add_argument("--png", default=None, help="write capacity vs context length here")
    plan.set_defaults(handler=main)


def main(args: Any) -> int:
    from unified_attn.runner.memory import parse_memory
    from unified_attn.tensor_specs import as_dtype

    config = resolve_model_config(args.model)
    memory = parse_memory(args.kv_cache_memory)
    kwargs = dict(dtype=as_dtype(args.dtype), block_size=args.block_size,
                  max_in_flight_tokens=args.max_num_batched_tokens)  # fmt: skip
    report = compare(config, memory, args.max_model_len, **kwargs)
    if args.png:
        report["png"] = plot_capacity(config, memory, args.png, **kwargs)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_plan(report)
    return 0


def plot_capacity(config: ModelConfig, memory: int, path: str, **kwargs: Any) -> str | None:
    """Capacity in tokens against max_model_len, hybrid vs full allocation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    lengths = [2**k for k in range(12, 18)]
    hybrid = [capacity(config, memory, n, **kwargs).capacity_tokens for n in lengths]
    full = [capacity(all_full(config), memory, n, **kwargs).capacity_tokens for n in lengths]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(lengths, hybrid, marker="o", label="per-group managers")
    ax.plot(lengths, full, marker="s", label="full attention everywhere")
    ax.set(xscale="log", xlabel="max_model_len", ylabel="KV capacity (tokens)",
           title=f"{config.name}: {memory / 2**30:.0f} GiB of KV cache")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def print_plan(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    groups = Table(title=f"{report['model']}: KV-cache groups", title_justify="left")
    for column in ("manager", "config", "layers", "page bytes", "blocks/request"):
        groups.add_column(column)
    for g in report["hybrid"]["groups"]:
        groups.add_row(g["manager"], str(g["config"] or ""), str(g["layers"]),
                       f"{g['page_bytes']:,}", f"{g['blocks_per_request']:,}")  # fmt: skip
    console.print(groups)
    summary = Table(title="Capacity", title_justify="left")
    for column in ("", "bytes/block", "blocks", "capacity (tokens)", "max concurrency"):
        summary.add_column(column)
    for name in ("hybrid", "full"):
        c = report[name]
        summary.add_row(name, f"{c['bytes_per_block']:,}", f"{c['num_blocks']:,}",
                        f"{c['capacity_tokens']:,}", f"{c['max_concurrency']:.2f}")  # fmt: skip
    console.print(summary)
    console.print(
        f"capacity ratio {report['capacity_ratio']:.3f}x, theoretical "
        f"{report['theoretical_ratio']:.3f}x: {report['fraction_of_theoretical_gain']:.1%} of "
        f"the theoretical gain (max_model_len {report['max_model_len']:,})"
    )
