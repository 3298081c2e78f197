"""`KVCacheAccess`, the part of `LLMEngine` that lets other software see and move its KV cache:
event subscriptions, the buffer layout, and cached blocks exported to / imported from another
engine (docs/kv-cache.md, "Events and block transfer")."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from unified_attn.managers import KVCacheManager
from unified_attn.managers.events import KVCacheEvent
from unified_attn.request import Request
from unified_attn.runner.kv_layout import ExportedBlock, LayerLayout
from unified_attn.runner.worker import Worker


class KVCacheAccess:
    """Mixed into `LLMEngine`, which sets these attributes and calls `_publish_kv_events` at
    the end of every step."""

    worker: Worker
    kv_cache_manager: KVCacheManager
    _kv_event_callbacks: list[Callable[[list[KVCacheEvent]], object]]
    tokenize: Callable[[str | Sequence[int]], list[int]]  # the engine's

    def subscribe_kv_events(self, callback: Callable[[list[KVCacheEvent]], object]) -> None:
        """Call `callback(events)` after every step that changed the prefix cache (and after
        `import_cached_blocks`), with the `BlockStored` / `BlockRemoved` / `AllBlocksCleared`
        events in order; never with an empty list. Turns events on: they describe changes from
        now on, so a subscriber mirroring the whole cache subscribes before the first request."""
        if not self._kv_event_callbacks:
            self.kv_cache_manager.enable_kv_cache_events()
        self._kv_event_callbacks.append(callback)

    def _publish_kv_events(self) -> None:
        """Hand the pending KV-cache events to the subscribers (`_step` calls it last)."""
        if not self._kv_event_callbacks:
            return
        events = self.kv_cache_manager.take_events()
        if events:
            for callback in self._kv_event_callbacks:
                callback(list(events))

    def kv_cache_layout(self) -> dict[str, LayerLayout]:
        """Per layer with a cache, where its blocks live in `worker.kv_buffer`
        (docs/kv-cache.md, "Events and block transfer")."""
        return self.worker.kv_cache_layout()

    def prompt_block_hashes(
        self, prompt: str | Sequence[int], cache_salt: str | None = None
    ) -> list[bytes]:
        """The chained block hashes this engine keys a prompt's full blocks on (at the hash
        block size): what routers match and `export_cached_blocks` takes."""
        hasher = self.kv_cache_manager.make_block_hasher()
        tokens = self.tokenize(prompt)
        return Request("prompt", tokens, block_hasher=hasher, cache_salt=cache_salt).block_hashes

    def export_cached_blocks(
        self, block_hashes: Sequence[bytes], token_ids: Sequence[int] | None = None
    ) -> list[ExportedBlock]:
        """Every cached block of the prefix `block_hashes`, per group: its hash and its bytes
        (read with `kv_cache_layout()` alone). `token_ids`, the prefix's tokens, are optional:
        they only describe the blocks in the importer's events."""
        return self.worker.export_cached_blocks(self.kv_cache_manager, block_hashes, token_ids)

    def import_cached_blocks(self, blocks: Iterable[ExportedBlock]) -> int:
        """Cache blocks another engine running the same model exported, so requests with that
        prefix hit them here; returns how many were new. Checks every block first."""
        imported = self.worker.import_cached_blocks(self.kv_cache_manager, blocks)
        self._publish_kv_events()
        return imported
