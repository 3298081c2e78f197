"""Two backends ported the four-class way, and their adapters.

`LegacyReferenceAdapter` and `LegacyTritonAdapter` are ordinary `AttentionBackend` classes: pass
them as `unified_attn.legacy_adapter.ports:LegacyReferenceAdapter` wherever a backend is named
(`LLMEngine(backend=...)`, the CLI). They are not registered with the selector, so importing this
module changes no automatic choice and no list of valid names; the harness commands also accept
their names, `legacy-reference` and `legacy-triton` (see `resolve_any_backend`).
"""

from __future__ import annotations

from unified_attn.legacy_adapter.adapter import LegacyBackendAdapter
from unified_attn.legacy_adapter.ports.reference import LegacyReferenceBackend


class LegacyReferenceAdapter(LegacyBackendAdapter):
    legacy_backend = LegacyReferenceBackend
    name = "legacy-reference"


__all__ = ["LegacyReferenceAdapter", "LegacyReferenceBackend"]

try:  # Triton is Linux-only: without it only the reference port exists.
    from unified_attn.legacy_adapter.ports.triton import LegacyTritonBackend
except ImportError:  # pragma: no cover
    pass
else:

    class LegacyTritonAdapter(LegacyBackendAdapter):
        legacy_backend = LegacyTritonBackend
        name = "legacy-triton"

    __all__ += ["LegacyTritonAdapter", "LegacyTritonBackend"]
