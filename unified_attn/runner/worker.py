"""The worker plans, sizes, allocates and binds the KV cache of one model replica.

Planning (`kv_plan.py`, re-exported here) groups layers by `(manager_cls, config)` equality and
gives each group its block size; the worker sizes one flat byte buffer shared by all groups: a
block id belongs to one group at a time, so groups alias the same bytes and `bytes_per_block`
is the max over groups, not the sum.

`kv_cache_layout()` exports where every layer's blocks live in that buffer (`kv_layout.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from unified_attn.backend import AttentionBackend
from unified_attn.managers import KVCacheManager
from unified_attn.runner.kv_layout import (
    ExportedBlock,
    LayerLayout,
    export_blocks,
    import_blocks,
    layer_layout,
)
from unified_attn.runner.kv_plan import (
    DEFAULT_BLOCK_SIZE,
    BoundLayer,
    GroupPlan,
    KVCachePlan,
    LayerPlan,
    choose_block_size,
    plan_kv_cache,
)
from unified_attn.runner.memory import format_memory, host_memory_bytes

CPU_KV_CACHE_MEMORY = 64 * 2**20  # the KV budget on a CPU device unless one is given


@attrs.frozen
class KVCacheReport:
    """What the worker allocated: printed at startup and returned by the engine."""

    block_size: int
    groups: tuple[dict, ...]
    bytes_per_block: int
    num_blocks: int
    max_model_len: int
    blocks_per_request: tuple[int, ...]
    budget: str = ""  # where the KV budget came from

    @property
    def max_concurrency(self) -> float:
        per_request = sum(self.blocks_per_request)
        return self.num_blocks / per_request if per_request else float("inf")

    @property
    def capacity_tokens(self) -> int:
        if not self.blocks_per_request:
            return 0
        return int(self.max_concurrency * self.max_model_len)

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def as_dict(self) -> dict:
        return {
            "block_size": self.block_size,
            "groups": list(self.groups),
            "bytes_per_block": self.bytes_per_block,
            "num_blocks": self.num_blocks,
            "total_bytes": self.total_bytes,
            "capacity_tokens": self.capacity_tokens,
            "max_concurrency": self.max_concurrency,
            "max_model_len": self.max_model_len,
            "budget": self.budget,
        }


class Worker:
    """Owns one model replica's KV cache: plan, size, allocate, bind."""

    def __init__(
        self,
        model: Any,
        *,
        device: torch.device | str,
        max_model_len: int,
        max_in_flight_tokens: int,
        block_size: int | None = None,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.max_in_flight_tokens = max_in_flight_tokens
        self.kv_cache_memory = kv_cache_memory
        self.gpu_memory_utilization = gpu_memory_utilization
        self.plan = plan_kv_cache(model.attention_layers(), block_size)
        self.blocks_per_request = self.plan.blocks_per_request(max_model_len, max_in_flight_tokens)
        self.kv_buffer: torch.Tensor | None = None
        self.num_blocks = 0
        self.bound_layers: dict[str, BoundLayer] = {}
        self.budget = ""  # where the KV budget came from (`available_memory`)

    def available_memory(self) -> int:
        """The KV budget: `kv_cache_memory` (checked against what the device has), else on
        CUDA `gpu_memory_utilization` of the memory free now (the model is loaded), else
        `CPU_KV_CACHE_MEMORY`. `budget` says which applied."""
        if self.kv_cache_memory is not None:
            self.check_budget_fits_device(self.kv_cache_memory)
            self.budget = f"kv_cache_memory={format_memory(self.kv_cache_memory)}"
            return self.kv_cache_memory
        if self.device.type != "cuda":
            self.budget = f"the {format_memory(CPU_KV_CACHE_MEMORY)} default of a CPU device"
            return CPU_KV_CACHE_MEMORY
        free, _total = torch.cuda.mem_get_info(self.device)
        self.budget = (
            f"gpu_memory_utilization={self.gpu_memory_utilization:g} of the "
            f"{format_memory(free)} free once the model was loaded"
        )
        return int(free * self.gpu_memory_utilization)

    def check_budget_fits_device(self, budget: int) -> None:
        """Refuse a budget that is not positive or exceeds the device's memory (CUDA: its
        total memory; CPU: the host's physical memory)."""
        if budget <= 0:
            raise ValueError(
                f"kv_cache_memory must be a positive number of bytes, got {budget}; "
                "give e.g. 256MiB"
            )
        where, capacity = "this machine's RAM", host_memory_bytes()
        if self.device.type == "cuda":
            where, capacity = f"device '{self.device}'", torch.cuda.mem_get_info(self.device)[1]
        if capacity is not None and budget > capacity:
            raise ValueError(
                f"kv_cache_memory={format_memory(budget)} is more than {where} has "
                f"({format_memory(capacity)} in total); give the KV cache at most "
                f"{format_memory(capacity)}"
            )

    def determine_num_blocks(self) -> int:
        """Blocks that fit the KV budget; checks that one `max_model_len` request fits."""
        bytes_per_block = self.plan.bytes_per_block
        if bytes_per_block == 0:
            return 2  # no KV cache: only the null block and one spare
        available = self.available_memory()
        num_blocks = available // bytes_per_block
        needed = sum(self.blocks_per_request) + 1  # + the null block
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache needs {needed * bytes_per_block / 2**20:.1f} MiB to serve one "
                f"request of max_model_len={self.max_model_len} but only "
                f"{available / 2**20:.1f} MiB are available; the largest max_model_len that "
                f"fits is {self.largest_fitting_len(num_blocks)}. Give the KV cache more memory "
                "or lower max_model_len."
            )
        return num_blocks

    def largest_fitting_len(self, num_blocks: int) -> int:
        lo, hi = 0, self.max_model_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            per_request = self.plan.blocks_per_request(mid, min(self.max_in_flight_tokens, mid))
            if sum(per_request) + 1 <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def allocate(self, num_blocks: int) -> None:
        """One flat buffer of `num_blocks * bytes_per_block` bytes; bind a view per layer."""
        plan = self.plan
        self.num_blocks = num_blocks
        self.kv_buffer = torch.zeros(
            num_blocks * plan.bytes_per_block, dtype=torch.uint8, device=self.device
        )
        views: dict[AttentionBackend, dict[str, Any]] = {}
        group_map: dict[AttentionBackend, dict[str, int]] = {}
        self.bound_layers = {}
        for gid, group in enumerate(plan.groups):
            offset = 0  # every group starts at byte 0 of the block: groups alias the buffer
            for lp in group.layers:
                view = lp.spec.make_view(
                    self.kv_buffer, offset, plan.bytes_per_block, num_blocks, group.block_size
                )
                views.setdefault(lp.backend, {})[lp.layer.name] = view
                group_map.setdefault(lp.backend, {})[lp.layer.name] = gid
                self.bound_layers[lp.layer.name] = BoundLayer(gid, lp.spec, offset, view)
                offset += lp.spec.page_size_bytes(group.block_size)
        for backend, layer_views in views.items():
            backend.bind_kv_caches(layer_views, group_map[backend])

    def kv_cache_layout(self) -> dict[str, LayerLayout]:
        """Per layer with a cache: where its blocks live in `kv_buffer` and how its view reads
        them. Block b of a layer is bytes `[b * bytes_per_block + offset_bytes, ... +
        page_bytes)` of `kv_buffer`."""
        self._allocated_buffer("kv_cache_layout")
        return {
            name: layer_layout(
                bound.group_id,
                bound.spec,
                bound.offset_bytes,
                bound.view,
                block_size=self.plan.groups[bound.group_id].block_size,
                bytes_per_block=self.plan.bytes_per_block,
                num_blocks=self.num_blocks,
            )
            for name, bound in self.bound_layers.items()
        }

    def export_cached_blocks(
        self,
        kv_cache_manager: KVCacheManager,
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int] | None = None,
    ) -> list[ExportedBlock]:
        """The cached blocks of the prefix `block_hashes`, read from this worker's buffer."""
        buffer = self._allocated_buffer("export_cached_blocks")
        layouts = self.kv_cache_layout()
        return export_blocks(kv_cache_manager, buffer, layouts, block_hashes, token_ids)

    def import_cached_blocks(
        self, kv_cache_manager: KVCacheManager, blocks: Iterable[ExportedBlock]
    ) -> int:
        """Write exported blocks into free blocks and cache them; returns how many were new."""
        buffer = self._allocated_buffer("import_cached_blocks")
        return import_blocks(kv_cache_manager, buffer, self.kv_cache_layout(), blocks)

    def _allocated_buffer(self, what: str) -> torch.Tensor:
        if self.kv_buffer is None:
            raise ValueError(f"{what}: the KV cache is not allocated yet; call allocate() first")
        return self.kv_buffer

    def report(self) -> KVCacheReport:
        plan = self.plan
        wasted = plan.wasted_bytes_per_block()
        groups = tuple(
            {
                "group_id": gid,
                "manager": group.manager_cls.__name__,
                "config": attrs.asdict(group.config) if attrs.has(type(group.config)) else {},
                "layers": [lp.layer.name for lp in group.layers],
                "block_size": group.block_size,
                "page_bytes": group.page_bytes(),
                "wasted_bytes_per_block": wasted[gid],
                "blocks_per_request": self.blocks_per_request[gid],
            }
            for gid, group in enumerate(plan.groups)
        )
        return KVCacheReport(
            block_size=plan.block_size,
            groups=groups,
            bytes_per_block=plan.bytes_per_block,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            blocks_per_request=tuple(self.blocks_per_request),
            budget=self.budget,
        )


def agree_on_num_blocks(workers: list[Worker]) -> int:
    """Every worker sizes its own cache; the engine uses the minimum on all of them."""
    return min(w.determine_num_blocks() for w in workers)


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "BoundLayer",
    "GroupPlan",
    "KVCachePlan",
    "KVCacheReport",
    "LayerPlan",
    "Worker",
    "agree_on_num_blocks",
    "choose_block_size",
    "plan_kv_cache",
]
