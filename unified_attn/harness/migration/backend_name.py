"""`engine_backend_name`: the name `LLMEngine(backend=...)` resolves to exactly a given class,
registering classes made at run time (wrapped legacy backends) by name."""

from __future__ import annotations

from unified_attn.backend import AttentionBackend
from unified_attn.selector import register_backend, registered_backends, resolve_backend


def engine_backend_name(cls: type[AttentionBackend]) -> str:
    """What `LLMEngine(backend=...)` resolves to exactly `cls`: its `module:Class` path, or for a
    class made at run time (a legacy class wrapped by `resolve_any_backend`) its name, which is
    then registered with an empty priority map (by name only, never chosen automatically)."""
    path = f"{cls.__module__}:{cls.__qualname__}"
    try:
        if resolve_backend(path) is cls:
            return path
    except (ImportError, AttributeError, ValueError):
        pass
    taken = registered_backends().get(cls.name)
    same_port = getattr(taken, "legacy_backend", None) is getattr(cls, "legacy_backend", cls)
    if taken is not None and taken is not cls and not same_port:
        raise ValueError(
            f"backend name {cls.name!r} is taken by {taken.__qualname__}; give "
            f"{cls.__qualname__} a distinct name (for a legacy backend: get_name())"
        )
    register_backend(priority={})(cls)
    return cls.name
