"""The one backend registry, and selection.

Backends register with `@register_backend(priority={"cuda": 50, "cpu": 10})`; no table names
them. `select_backend(cfg)` picks the highest-priority backend whose `validate_configuration`
returns no reasons; an override is validated and never silently replaced.

Every way of naming a backend resolves here (`resolve_backend`): a registered name; a name
registered for selection by name only (`register_backend_name`: the legacy ports,
`legacy-reference` and `legacy-triton`); `module:Class` (the CLI also finds modules in the working
directory); or a class. A class that is not an `AttentionBackend` is offered to the registered
class adapters (`register_class_adapter`: the legacy adapter wraps four-class backends), so
nothing above this module needs to know the legacy package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import attrs
import torch

from unified_attn.backend import AttentionBackend, AttentionType
from unified_attn.tensor_specs import as_dtype

_REGISTRY: dict[str, tuple[type[AttentionBackend], dict[str, int]]] = {}
# selected by name only, never automatically
_NAMED: dict[str, type[AttentionBackend]] = {}
# class -> an AttentionBackend serving it, or None when the adapter does not take the class
ClassAdapter = Callable[[type], "type[AttentionBackend] | None"]
_CLASS_ADAPTERS: list[ClassAdapter] = []
# Modules that register the built-in backends and adapters; imported lazily on first use. A
# module whose dependencies are missing (Triton off Linux) registers nothing.
_BUILTIN_MODULES = (
    "unified_attn.backends.reference",
    "unified_attn.backends.triton",
    "unified_attn.backends.linear_state",
    "unified_attn.backends.mamba_state",
    "unified_attn.backends.gated_delta_state",
    "unified_attn.backends.mla",
    "unified_attn.backends.sparse_mla",
    "unified_attn.backends.triton.mla_backend",
    "unified_attn.backends.triton.deepseek_v4_backend",
    "unified_attn.backends.triton.sparse_mla_backend",
    "unified_attn.legacy_adapter.ports",
)


@attrs.frozen
class SelectorConfig:
    """What a backend must support for one attention kind of a model."""

    head_size: int
    dtype: torch.dtype = attrs.field(converter=as_dtype)
    kv_cache_dtype: torch.dtype | str = "auto"
    block_size: int | None = None
    has_sinks: bool = False
    sliding_window: int | None = None
    num_sink_tokens: int = 0  # StreamingLLM: the first tokens every query also sees
    attention_chunk_size: int | None = None
    logits_soft_cap: float | None = None  # tanh capping of the scores (Gemma 2)
    attn_type: AttentionType = AttentionType.DECODER
    device: str = "cpu"
    use_batch_invariant: bool = False  # the engine's mode (`EngineConfig.batch_invariant`)
    # What the layer computes: "attention" (softmax attention over a KV cache), "mla"
    # (multi-head latent attention over a latent cache, DeepSeek-V2/V3), "deepseek_v4"
    # (DeepSeek-V4's sliding window plus compressed caches, one backend per cache user) or a
    # kind of recurrent-state layer ("linear_state"); a backend serves the kinds in its
    # `layer_kinds`.
    layer_kind: str = "attention"
    # Roles of the layer's other cache users (a layer with several caches): the backend needs
    # a class for each (`AttentionBackend.cache_user_classes`).
    cache_users: tuple[str, ...] = ()


def register_backend(priority: dict[str, int]) -> Callable[[type], type]:
    """Class decorator: register a backend with a priority per device type (higher wins)."""

    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        _REGISTRY[cls.name] = (cls, dict(priority))
        return cls

    return wrap


def register_backend_name(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: `cls.name` selects `cls` by name; it is never chosen automatically."""
    _NAMED[cls.name] = cls
    return cls


def register_class_adapter(adapter: ClassAdapter) -> None:
    """`adapter(cls)` returns an `AttentionBackend` class serving a backend class of another
    interface, or None when it does not take `cls`."""
    if adapter not in _CLASS_ADAPTERS:
        _CLASS_ADAPTERS.append(adapter)


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            continue


def registered_backends() -> dict[str, type[AttentionBackend]]:
    """The backends automatic selection chooses among, by name."""
    _load_builtins()
    return {name: cls for name, (cls, _) in _REGISTRY.items()}


def backend_classes() -> dict[str, type[AttentionBackend]]:
    """Every backend a bare name selects: the registered ones by name, then those selected by
    name only."""
    registered = dict(sorted(registered_backends().items()))
    return registered | {name: cls for name, cls in _NAMED.items() if name not in registered}


def resolve_backend(backend: str | type) -> type[AttentionBackend]:
    """A name, `module:Class` or a class as an `AttentionBackend` class (a class of another
    interface adapted); `ValueError` saying what would do."""
    if isinstance(backend, type):
        return _as_backend_class(backend, backend.__qualname__)
    if not isinstance(backend, str):
        raise ValueError(
            f"backend {backend!r} is neither a name, module:Class, an AttentionBackend nor a "
            "LegacyAttentionBackend subclass"
        )
    if ":" in backend:
        return _as_backend_class(_import_class(backend), backend)
    backends = backend_classes()
    if backend not in backends:
        names = ", ".join(backends)
        raise ValueError(
            f"unknown attention backend {backend!r}; use one of {names} (see `unified-attn "
            "backends`) or module:Class"
        )
    return backends[backend]


def _import_class(name: str) -> object:
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr, None)
    except ImportError as error:
        raise ValueError(
            f"cannot import {module!r} for backend {name!r}: {error}; put its directory on "
            "PYTHONPATH"
        ) from error


def _as_backend_class(cls: object, name: str) -> type[AttentionBackend]:
    if isinstance(cls, type) and issubclass(cls, AttentionBackend):
        return cls
    if isinstance(cls, type):
        _load_builtins()
        for adapter in _CLASS_ADAPTERS:
            adapted = adapter(cls)
            if adapted is not None:
                return adapted
    raise ValueError(f"{name} is neither an AttentionBackend nor a LegacyAttentionBackend subclass")


def backend_reasons(cls: type[AttentionBackend], cfg: SelectorConfig) -> list[str]:
    if cfg.layer_kind not in cls.layer_kinds:
        return [f"serves {'/'.join(cls.layer_kinds)} layers, not {cfg.layer_kind}"]
    reasons = list(cls.validate_configuration(cfg))
    missing = [role for role in cfg.cache_users if role not in cls.cache_user_classes()]
    if missing:
        reasons.append(f"has no class for the cache users {missing}")
    if cfg.use_batch_invariant and not cls.supports_batch_invariance():
        reasons.append("does not support batch-invariant mode")
    return reasons


def valid_backend_names(cfgs: list[SelectorConfig]) -> list[str]:
    """The registered backends that can serve every one of `cfgs` here."""
    return sorted(
        name
        for name in registered_backends()
        if not any(backend_reasons(resolve_backend(name), c) for c in cfgs)
    )


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
        cls = resolve_backend(override)
        reasons = [r for c in cfgs for r in backend_reasons(cls, c)]
        if reasons:
            raise ValueError(
                f"attention backend {cls.name!r} cannot serve this model: "
                + "; ".join(dict.fromkeys(reasons))
                + f". Backends that can: {valid_backend_names(cfgs) or 'none'}"
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
