"""Names on the command line -> backend classes, legacy ones wrapped in the adapter."""

from __future__ import annotations

import importlib

from unified_attn.backend import AttentionBackend
from unified_attn.legacy_adapter.adapter import LegacyBackendAdapter
from unified_attn.legacy_adapter.interfaces import LegacyAttentionBackend
from unified_attn.selector import registered_backends, resolve_backend


def resolve_any_backend(name: str, *, legacy: bool = False) -> type[AttentionBackend]:
    """A registered name or `module:Class`. A four-class backend class comes back wrapped in
    `LegacyBackendAdapter`; with `legacy=True` a bare name `x` means the port `legacy-x`."""
    importlib.import_module("unified_attn.legacy_adapter.ports")  # registers the ports' names
    if ":" in name:
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
        raise ValueError(
            f"{name} is neither an AttentionBackend nor a LegacyAttentionBackend subclass"
        )
    if legacy and not name.startswith("legacy-") and f"legacy-{name}" in registered_backends():
        name = f"legacy-{name}"
    return resolve_backend(name)
