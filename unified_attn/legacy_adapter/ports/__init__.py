"""Two backends ported the four-class way, and their adapters.

`LegacyReferenceAdapter` and `LegacyTritonAdapter` are ordinary `AttentionBackend` classes,
registered by name only (`register_backend_name`): `legacy-reference` and `legacy-triton` name
them wherever a backend is named (`LLMEngine(backend=...)`, the CLI), and automatic selection
never picks them.
"""

from __future__ import annotations

from unified_attn.legacy_adapter.adapter import LegacyBackendAdapter
from unified_attn.legacy_adapter.ports.legacy_reference import LegacyReferenceBackend
from unified_attn.selector import register_backend_name


@register_backend_name
class LegacyReferenceAdapter(LegacyBackendAdapter):
    legacy_backend = LegacyReferenceBackend
    name = "legacy-reference"


__all__ = ["LegacyReferenceAdapter", "LegacyReferenceBackend"]

try:  # Triton is Linux-only: without it only the reference port exists.
    from unified_attn.legacy_adapter.ports.legacy_triton import LegacyTritonBackend
except ImportError:  # pragma: no cover
    pass
else:

    @register_backend_name
    class LegacyTritonAdapter(LegacyBackendAdapter):
        legacy_backend = LegacyTritonBackend
        name = "legacy-triton"

    __all__ += ["LegacyTritonAdapter", "LegacyTritonBackend"]
