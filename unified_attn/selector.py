"""Backend registry and selection.

Backends register with `@register_backend(priority={"cuda": 50, "cpu": 10})`; no table names
them. `select_backend(cfg)` picks the highest-priority backend whose `validate_configuration`
returns no reasons; an override is validated and never silently replaced.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import attrs
import torch

from unified_attn.backend import AttentionBackend, AttentionType
from unified_attn.tensor_specs import as_dtype

BATCH_INVARIANT_ENV = "UNIFIED_ATTN_BATCH_INVARIANT"

_REGISTRY: dict[str, tuple[type[AttentionBackend], dict[str, int]]] = {}
# Modules that register the built-in backends; imported lazily on first selection. A module
# whose dependencies are missing (Triton off Linux) registers nothing.
_BUILTIN_MODULES = (
    "unified_attn.backends.reference",
    "unified_attn.backends.triton",
    "unified_attn.backends.linear_state",
    "unified_attn.backends.mla",
    "unified_attn.backends.triton.mla_backend",
    "unified_attn.backends.triton.deepseek_v4_backend",
)


def batch_invariant_from_env() -> bool:
    return os.environ.get(BATCH_INVARIANT_ENV, "0").lower() in ("1", "true", "yes")


@attrs.frozen
class SelectorConfig:
    """What a backend must support for one attention kind of a model."""

    head_size: int
    dtype: torch.dtype = attrs.field(converter=as_dtype)
    kv_cache_dtype: torch.dtype | str = "auto"
    block_size: int | None = None
    has_sinks: bool = False
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    attn_type: AttentionType = AttentionType.DECODER
    device: str = "cpu"
    use_batch_invariant: bool = attrs.field(factory=batch_invariant_from_env)
    # What the layer computes: "attention" (softmax attention over a KV cache), "mla"
    # (multi-head latent attention over a latent cache, DeepSeek-V2/V3), "deepseek_v4"
    # (DeepSeek-V4's sliding window plus compressed caches, one backend per cache user) or a
    # kind of recurrent-state layer ("linear_state"); a backend serves the kinds in its
    # `layer_kinds`.
    layer_kind: str = "attention"


def register_backend(priority: dict[str, int]) -> Callable[[type], type]:
    """Class decorator: register a backend with a priority per device type (higher wins)."""

    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        _REGISTRY[cls.name] = (cls, dict(priority))
        return cls

    return wrap


def registered_backends() -> dict[str, type[AttentionBackend]]:
    for module in _BUILTIN_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            continue
    return {name: cls for name, (cls, _) in _REGISTRY.items()}


def resolve_backend(name: str) -> type[AttentionBackend]:
    """A registered name, or `module:Class` for a backend defined elsewhere."""
    if ":" in name:
        module, _, attr = name.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            raise ValueError(f"{name} is not an AttentionBackend subclass")
        return cls
    backends = registered_backends()
    if name not in backends:
        raise ValueError(f"unknown attention backend {name!r}; valid names: {sorted(backends)}")
    return backends[name]


def backend_reasons(cls: type[AttentionBackend], cfg: SelectorConfig) -> list[str]:
    if cfg.layer_kind not in cls.layer_kinds:
        return [f"serves {'/'.join(cls.layer_kinds)} layers, not {cfg.layer_kind}"]
    reasons = list(cls.validate_configuration(cfg))
    if cfg.use_batch_invariant and not cls.supports_batch_invariance():
        reasons.append("does not support batch-invariant mode")
    return reasons


def select_backend(
    cfg: SelectorConfig | list[SelectorConfig],
    override: str | type[AttentionBackend] | None = None,
) -> type[AttentionBackend]:
    """The backend for one attention kind, or one backend valid for every kind of a model.
    `override` (a name, `module:Class` or a class) is validated and never silently replaced."""
    cfgs = cfg if isinstance(cfg, list) else [cfg]
    if not cfgs:
        raise ValueError("select_backend needs at least one SelectorConfig")
    if override is not None:
        cls = override if isinstance(override, type) else resolve_backend(override)
        reasons = [r for c in cfgs for r in backend_reasons(cls, c)]
        if reasons:
            raise ValueError(
                f"attention backend {cls.name!r} cannot serve this model: "
                + "; ".join(dict.fromkeys(reasons))
                + f". Valid backends: {sorted(registered_backends())}"
            )
        return cls
    device_types = {torch.device(c.device).type for c in cfgs}
    candidates = []
    report = []
    for name, (cls, priorities) in _registry_snapshot().items():
        missing = sorted(device_types - priorities.keys())
        if missing:
            report.append(f"  {name}: not registered for device {missing[0]!r}")
            continue
        reasons = list(dict.fromkeys(r for c in cfgs for r in backend_reasons(cls, c)))
        if reasons:
            report.append(f"  {name}: " + "; ".join(reasons))
        else:
            candidates.append((min(priorities[d] for d in device_types), name, cls))
    if not candidates:
        raise ValueError(
            f"no attention backend can serve {cfgs[0] if len(cfgs) == 1 else cfgs}:\n"
            + "\n".join(report)
            + "\nChange the model dtype, KV-cache dtype, head size or device, or register a "
            "backend."
        )
    return max(candidates, key=lambda c: c[0])[2]


def backend_priorities() -> dict[str, dict[str, int]]:
    """Registered name -> its priority per device type (copies)."""
    return {name: dict(priorities) for name, (_, priorities) in _registry_snapshot().items()}


def _registry_snapshot() -> dict[str, tuple[type[AttentionBackend], dict[str, int]]]:
    registered_backends()
    return dict(_REGISTRY)
