"""Names on the command line -> backend classes, legacy ones wrapped in the adapter."""

from __future__ import annotations

import importlib

from unified_attn.backend import AttentionBackend
from unified_attn.legacy_adapter.adapter import LegacyBackendAdapter
from unified_attn.legacy_adapter.interfaces import LegacyAttentionBackend
from unified_attn.selector import resolve_backend


def resolve_any_backend(name: str, *, legacy: bool = False) -> type[AttentionBackend]:
    """A selector name, an adapter's name (`legacy-reference`) or `module:Class`. A four-class
    backend class comes back wrapped in `LegacyBackendAdapter`; with `legacy=True` a bare name
    `x` means the adapter named `legacy-x` when there is one."""
    if ":" in name:
        return _import_backend(name)
    adapter = find_adapter(f"legacy-{name}" if legacy else name) or find_adapter(name)
    return adapter or resolve_backend(name)


def find_adapter(name: str) -> type[LegacyBackendAdapter] | None:
    """The first-defined `LegacyBackendAdapter` subclass called `name` (the ports included)."""
    importlib.import_module("unified_attn.legacy_adapter.ports")
    pending = list(LegacyBackendAdapter.__subclasses__())
    while pending:
        cls = pending.pop(0)
        if cls.name == name:
            return cls
        pending.extend(cls.__subclasses__())
    return None


def _import_backend(name: str) -> type[AttentionBackend]:
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr, None)
    except ImportError as error:
        raise ValueError(
            f"cannot import {module!r} for backend {name!r}: {error}; put its directory on "
            "PYTHONPATH"
        ) from error
    if isinstance(cls, type) and issubclass(cls, LegacyAttentionBackend):
        return LegacyBackendAdapter.wrap(cls)
    if isinstance(cls, type) and issubclass(cls, AttentionBackend):
        return cls
    raise ValueError(f"{name} is neither an AttentionBackend nor a LegacyAttentionBackend subclass")
