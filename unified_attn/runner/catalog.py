"""What this machine can run, for `unified-attn backends` and `unified-attn models`:
`describe_backends` (each backend's capabilities and whether it serves the default
configuration here) and `describe_models` (the presets and the checkpoint architectures).
"""

from __future__ import annotations

from typing import Any

import torch

from unified_attn.backend import AttentionBackend
from unified_attn.models import get_preset, supported_architectures
from unified_attn.models.families import families
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


def describe_models() -> dict[str, Any]:
    """The presets (with their layer kinds) and the Hugging Face architectures a checkpoint
    directory may have."""
    return {
        "presets": [
            family.describe(config) for family in families() for config in family.presets.values()
        ],
        "architectures": supported_architectures(),
    }


def describe_real_shapes() -> list[dict[str, Any]]:
    """The real-model shapes `plan` knows, described by their families."""
    return [family.describe(config) for family in families() for config in family.shapes.values()]
