"""What this machine can run, for `unified-attn backends` and `unified-attn models`:
`describe_backends` (each backend's capabilities and whether it serves the default
configuration here) and `describe_models` (the presets and the checkpoint architectures).
"""

from __future__ import annotations

from typing import Any

import torch

from unified_attn.backend import AttentionBackend
from unified_attn.models import (
    MLA_PRESETS,
    PRESETS,
    V4_PRESETS,
    LayerKind,
    ModelConfig,
    get_preset,
    supported_architectures,
)
from unified_attn.models.deepseek_config import DeepseekConfig
from unified_attn.models.deepseek_v4 import DeepseekV4Config
from unified_attn.runner.model_source import DEFAULT_MODEL, default_dtype
from unified_attn.selector import (
    SelectorConfig,
    backend_classes,
    backend_priorities,
    backend_reasons,
    select_backend,
)

# ---- backends -----------------------------------------------------------------------------------


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_selector_config(cls: type[AttentionBackend], device: str) -> SelectorConfig:
    """What `unified-attn run` asks of a backend by default: the default model's head size,
    the device's default dtype, the backend's first layer kind."""
    return SelectorConfig(
        head_size=get_preset(DEFAULT_MODEL).head_size,
        dtype=default_dtype(torch.device(device)),
        device=device,
        use_batch_invariant=False,
        layer_kind=cls.layer_kinds[0],
    )


def describe_backends(device: str | None = None) -> list[dict[str, Any]]:
    """Per backend: its class, capabilities, and whether it can serve the default
    configuration on `device` (default: cuda when visible, else cpu), with the reasons."""
    device = device or default_device()
    rows = []
    for name, cls in backend_classes().items():
        cfg = default_selector_config(cls, device)
        rows.append({
            "name": name,
            "class": f"{cls.__module__}:{cls.__qualname__}",
            "priority": backend_priorities().get(name, {}),
            "batch_invariant": cls.supports_batch_invariance(),
            "cuda_graphs": cls.supports_cuda_graphs(),
            "layer_kinds": list(cls.layer_kinds),
            "device": device,
            "dtype": str(cfg.dtype).removeprefix("torch."),
            "head_size": cfg.head_size,
            "reasons": backend_reasons(cls, cfg),
            "automatic": automatic_choice(cfg) is cls,
        })  # fmt: skip
    return rows


def automatic_choice(cfg: SelectorConfig) -> type[AttentionBackend] | None:
    try:
        return select_backend(cfg)
    except ValueError:
        return None


# ---- models -----------------------------------------------------------------------------------


def describe_layer_kinds(config: ModelConfig) -> str:
    """`full x2, sliding 32 x2`: each distinct layer kind with its count, in order."""
    counts: dict[str, int] = {}
    for kind in config.layer_kinds:
        label = layer_kind_label(kind)
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{label} x{n}" for label, n in counts.items())


def layer_kind_label(kind: LayerKind) -> str:
    label = kind.kind.replace("_", " ")
    if kind.window is not None:
        label += f" {kind.window}"
    if kind.chunk is not None:
        label += f" {kind.chunk}"
    if kind.sink_tokens:
        label += f" + {kind.sink_tokens} sink tokens"
    if kind.has_sinks:
        label += " (learned sinks)"
    return label


def describe_model(config: ModelConfig) -> dict[str, Any]:
    return {
        "name": config.name,
        "layers": config.num_layers,
        "layer_kinds": describe_layer_kinds(config),
        "heads": f"{config.num_heads} / {config.num_kv_heads} KV x {config.head_size}",
        "max_position_embeddings": config.max_position_embeddings,
    }


def describe_mla_model(config: DeepseekConfig) -> dict[str, Any]:
    """`describe_model`'s row for a DeepSeek model: its MLP pattern and latent width."""
    dense, moe = config.first_k_dense_replace, config.num_layers - config.first_k_dense_replace
    return {
        "name": config.name,
        "layers": config.num_layers,
        "layer_kinds": f"mla x{config.num_layers} (dense MLP x{dense}, MoE x{moe})",
        "heads": f"{config.num_heads} / latent {config.kv_lora_rank} + {config.qk_rope_head_dim}",
        "max_position_embeddings": config.max_position_embeddings,
    }


def describe_v4_model(config: DeepseekV4Config) -> dict[str, Any]:
    """`describe_model`'s row for a DeepSeek-V4 model: its attention pattern and caches."""
    kinds = {"sliding_attention": "sliding", "compressed_sparse_attention": "CSA",
             "heavily_compressed_attention": "HCA"}  # fmt: skip
    counts: dict[str, int] = {}
    for kind in config.layer_types:
        counts[kinds[kind]] = counts.get(kinds[kind], 0) + 1
    return {
        "name": config.name,
        "layers": config.num_layers,
        "layer_kinds": ", ".join(f"{k} x{n}" for k, n in counts.items())
        + f" (window {config.sliding_window}, rates {config.csa_compress_rate} / "
        f"{config.hca_compress_rate})",
        "heads": f"{config.num_heads} / shared KV x {config.head_dim}",
        "max_position_embeddings": config.max_position_embeddings,
    }


def describe_models() -> dict[str, Any]:
    """The presets (with their layer kinds) and the Hugging Face architectures a checkpoint
    directory may have."""
    return {
        "presets": [describe_model(config) for config in PRESETS.values()]
        + [describe_mla_model(config) for config in MLA_PRESETS.values()]
        + [describe_v4_model(config) for config in V4_PRESETS.values()],
        "architectures": supported_architectures(),
    }
