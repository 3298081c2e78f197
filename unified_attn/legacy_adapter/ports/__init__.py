"""Two backends ported the four-class way, and their adapters.

Importing this module registers `legacy-reference` and `legacy-triton` with the selector under
an empty priority map: reachable by name (`LLMEngine(backend="legacy-reference")`, the CLI) or
as `unified_attn.legacy_adapter.ports:LegacyReferenceAdapter`, never chosen automatically.
"""

from __future__ import annotations

from unified_attn.legacy_adapter.adapter import LegacyBackendAdapter
from unified_attn.legacy_adapter.ports.reference import LegacyReferenceBackend
from unified_attn.selector import register_backend

LegacyReferenceAdapter = register_backend(priority={})(
    LegacyBackendAdapter.wrap(LegacyReferenceBackend)
)

__all__ = ["LegacyReferenceAdapter", "LegacyReferenceBackend"]

try:  # Triton is Linux-only: without it only the reference port exists.
    from unified_attn.legacy_adapter.ports.triton import LegacyTritonBackend
except ImportError:  # pragma: no cover
    pass
else:
    LegacyTritonAdapter = register_backend(priority={})(
        LegacyBackendAdapter.wrap(LegacyTritonBackend)
    )
    __all__ += ["LegacyTritonAdapter", "LegacyTritonBackend"]
