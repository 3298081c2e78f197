"""Backends are named the same way everywhere (the engine, `run`, `check`, `migrate`): a
registered name, a legacy port's name (`legacy-reference`, `legacy-triton`) or `module:Class` of
a native or a four-class backend (the latter wrapped in `LegacyBackendAdapter`);
`resolve_engine_backend` resolves them and `select_engine_backend` validates the choice.
"""

from __future__ import annotations

import importlib
from typing import Any

from unified_attn.backend import AttentionBackend
from unified_attn.legacy_adapter import (
    LegacyAttentionBackend,
    LegacyBackendAdapter,
    resolve_any_backend,
)
from unified_attn.selector import SelectorConfig, registered_backends, select_backend


def resolve_engine_backend(backend: Any) -> type[AttentionBackend] | None:
    """None (select automatically), a name, `module:Class`, or a class (a four-class backend
    is wrapped in `LegacyBackendAdapter`). Unknown names raise `ValueError` listing all."""
    if backend is None:
        return None
    if isinstance(backend, str):
        return resolve_backend_name(backend)
    if isinstance(backend, type) and issubclass(backend, LegacyAttentionBackend):
        return LegacyBackendAdapter.wrap(backend)
    if isinstance(backend, type) and issubclass(backend, AttentionBackend):
        return backend
    raise ValueError(
        f"backend {backend!r} is neither a name, module:Class, an AttentionBackend nor a "
        "LegacyAttentionBackend subclass"
    )


def resolve_backend_name(name: str) -> type[AttentionBackend]:
    """A registered name, a legacy port's name or `module:Class` (legacy classes wrapped)."""
    if ":" not in name and name not in backend_classes():
        raise ValueError(
            f"unknown attention backend {name!r}; use one of {', '.join(backend_classes())} "
            "(see `unified-attn backends`) or module:Class"
        )
    return resolve_any_backend(name)


def select_engine_backend(
    cfgs: list[SelectorConfig], backend: Any = None
) -> type[AttentionBackend]:
    """The requested backend, validated for every config (never replaced), else the
    selector's choice."""
    cls = resolve_engine_backend(backend)
    return select_backend(cfgs) if cls is None else select_backend(cfgs, override=cls)


def backend_classes() -> dict[str, type[AttentionBackend]]:
    """Every backend a bare name selects: the registered ones by name, then the legacy ports."""
    ports = importlib.import_module("unified_attn.legacy_adapter.ports")
    adapters = [getattr(ports, n) for n in ports.__all__ if n.endswith("Adapter")]
    registered = dict(sorted(registered_backends().items()))
    return registered | {cls.name: cls for cls in adapters}
