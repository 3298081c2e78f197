"""The KV cache's standard layout, and moving cached blocks between engines with it alone.

Every layer's cache is a strided view over the worker's one flat `uint8` buffer. Block `b` of a
layer occupies bytes `[b * bytes_per_block + offset_bytes, b * bytes_per_block + offset_bytes +
page_bytes)` of `worker.kv_buffer`; layers of one group sit side by side inside a block, and
groups alias the same bytes (a block id belongs to one group at a time). A connector that knows
a `LayerLayout` can copy one block of one layer without looking at specs, backends or views.

`export_blocks` reads the cached blocks of a prefix as `ExportedBlock`s (hash and raw page bytes
per layer); `import_blocks` writes them into another engine's free blocks and caches them under
the same hashes, so its next request with that prefix gets a prefix-cache hit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import attrs
import torch

from unified_attn.managers import KVCacheManager
from unified_attn.managers.hashing import hashes_at_block_size
from unified_attn.tensor_specs import KVCacheTensorSpec, PagedKVSpec, StateSpec

_KINDS: dict[type, str] = {PagedKVSpec: "paged_kv", StateSpec: "state"}


def spec_kind(spec: KVCacheTensorSpec) -> str:
    """`"paged_kv"`, `"state"`, or the snake-cased class name of another spec."""
    for cls in type(spec).__mro__:
        if cls in _KINDS:
            return _KINDS[cls]
    name = type(spec).__name__.removesuffix("Spec")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@attrs.frozen
class TensorLayout:
    """One tensor of a layer's view: `[num_blocks, ...]` elements of `dtype`.

    Element `(b, *i)` is at byte `b * bytes_per_block + offset_bytes + itemsize * sum(i * s for
    the inner strides)` of the buffer; `strides[0] * itemsize == bytes_per_block`.
    """

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements, like torch.Tensor.stride()
    offset_bytes: int  # from the start of a block


@attrs.frozen
class LayerLayout:
    """Where one layer's cache lives in `kv_buffer`, and how its view reads it.

    `tensors` has one entry per tensor of the layer's view (one for paged K/V, one per state
    tensor for state layers); `dtype`, `shape` and `strides` are the single tensor's.
    """

    group_id: int
    kind: str  # the spec's kind: "paged_kv", "state", ...
    block_size: int  # tokens per block of the layer's group
    offset_bytes: int  # the layer's page inside a block
    page_bytes: int
    bytes_per_block: int
    num_blocks: int
    tensors: tuple[TensorLayout, ...]

    @property
    def dtype(self) -> str:
        return self._single("dtype").dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self._single("shape").shape

    @property
    def strides(self) -> tuple[int, ...]:
        return self._single("strides").strides

    def _single(self, what: str) -> TensorLayout:
        if len(self.tensors) != 1:
            raise ValueError(
                f"LayerLayout.{what}: this {self.kind} layer's view has {len(self.tensors)} "
                f"tensors; read LayerLayout.tensors[i].{what}"
            )
        return self.tensors[0]

    def block_bytes(self, block_id: int) -> slice:
        """The bytes of block `block_id` of this layer in `kv_buffer`."""
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside [0, {self.num_blocks})")
        start = block_id * self.bytes_per_block + self.offset_bytes
        return slice(start, start + self.page_bytes)


def layer_layout(
    group_id: int,
    spec: KVCacheTensorSpec,
    offset_bytes: int,
    view: torch.Tensor | tuple[torch.Tensor, ...],
    *,
    block_size: int,
    bytes_per_block: int,
    num_blocks: int,
) -> LayerLayout:
    """The layout of a layer bound at `offset_bytes`, read off the view `make_view` gave it."""
    tensors = view if isinstance(view, tuple) else (view,)
    return LayerLayout(
        group_id=group_id,
        kind=spec_kind(spec),
        block_size=block_size,
        offset_bytes=offset_bytes,
        page_bytes=spec.page_size_bytes(block_size),
        bytes_per_block=bytes_per_block,
        num_blocks=num_blocks,
        tensors=tuple(_tensor_layout(t) for t in tensors),
    )


def _tensor_layout(tensor: torch.Tensor) -> TensorLayout:
    return TensorLayout(
        dtype=str(tensor.dtype).removeprefix("torch."),
        shape=tuple(tensor.shape),
        strides=tuple(tensor.stride()),
        offset_bytes=int(tensor.storage_offset()) * tensor.element_size(),
    )


# ---- moving cached blocks ------------------------------------------------------------------------


@attrs.frozen
class ExportedBlock:
    """One cached block of one group: its plain block hash and its bytes, layer by layer.

    `parent_block_hash` and `token_ids` (empty when the exporter did not know them) describe
    the block in the importer's `BlockStored` event.
    """

    group_id: int
    block_hash: bytes
    block_size: int
    pages: dict[str, bytes]  # layer name -> the layer's `page_bytes` bytes of the block
    parent_block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


def export_blocks(
    kv_cache_manager: KVCacheManager,
    kv_buffer: torch.Tensor,
    layouts: Mapping[str, LayerLayout],
    block_hashes: Sequence[bytes],
    token_ids: Sequence[int] | None = None,
) -> list[ExportedBlock]:
    """Every block of the prefix `block_hashes` (at the hash block size) that is cached, per
    group in sequence order. Blocks that are not cached are left out."""
    exported = []
    for gid, manager in enumerate(kv_cache_manager.managers):
        bs = manager.block_size
        hashes = hashes_at_block_size(list(block_hashes), kv_cache_manager.hash_block_size, bs)
        for i, block_hash in enumerate(hashes):
            cached = kv_cache_manager.block_pool.get_cached_block(block_hash, (gid,))
            if cached is None:
                continue
            tokens = () if token_ids is None else tuple(token_ids[i * bs : (i + 1) * bs])
            pages = read_pages(kv_buffer, _group(layouts, gid), cached[0].block_id)
            parent = hashes[i - 1] if i else None
            exported.append(ExportedBlock(gid, block_hash, bs, pages, parent, tokens))
    return exported


def import_blocks(
    kv_cache_manager: KVCacheManager,
    kv_buffer: torch.Tensor,
    layouts: Mapping[str, LayerLayout],
    blocks: Iterable[ExportedBlock],
) -> int:
    """Write exported blocks into free blocks and cache them; returns how many were new.

    Blocks already cached here are skipped. Every block is checked against this engine's layout
    before anything changes. The imported blocks end up free and cached, like the blocks of a
    finished request (the last one imported is evicted first).
    """
    pool = kv_cache_manager.block_pool
    if not kv_cache_manager.enable_caching:
        raise ValueError("import_cached_blocks: prefix caching is off in this engine")
    new: dict[tuple[bytes, int], ExportedBlock] = {}
    for block in blocks:
        check_block(block, layouts, kv_cache_manager)
        if pool.get_cached_block(block.block_hash, (block.group_id,)) is None:
            new.setdefault((block.block_hash, block.group_id), block)
    if len(new) > pool.get_num_free_blocks():
        raise ValueError(
            f"import_cached_blocks: {len(new)} blocks to import but only "
            f"{pool.get_num_free_blocks()} blocks are free; import fewer or give the KV cache "
            "more memory"
        )
    adopted = []
    for block in new.values():
        held = pool.adopt_external_block(
            block.block_hash,
            block.group_id,
            block_size=block.block_size,
            parent_block_hash=block.parent_block_hash,
            token_ids=block.token_ids,
        )
        write_pages(kv_buffer, _group(layouts, block.group_id), held.block_id, block.pages)
        adopted.append(held)
    pool.free_blocks(reversed(adopted))
    return len(adopted)


def check_block(
    block: ExportedBlock, layouts: Mapping[str, LayerLayout], kv_cache_manager: KVCacheManager
) -> None:
    """Refuse a block this engine's layout cannot take (another model, dtype or block size)."""
    what = f"import_cached_blocks: block {block.block_hash.hex()[:12]} of group {block.group_id}"
    if not 0 <= block.group_id < kv_cache_manager.num_groups:
        raise ValueError(f"{what}: this engine has {kv_cache_manager.num_groups} groups")
    expected_bs = kv_cache_manager.managers[block.group_id].block_size
    if block.block_size != expected_bs:
        raise ValueError(f"{what}: block size {block.block_size}, this engine uses {expected_bs}")
    group = _group(layouts, block.group_id)
    if set(block.pages) != set(group):
        raise ValueError(
            f"{what}: holds layers {sorted(block.pages)}, this group has {sorted(group)}; "
            "import only blocks exported by an engine running the same model"
        )
    for name, data in block.pages.items():
        if len(data) != group[name].page_bytes:
            raise ValueError(
                f"{what}: layer {name!r} has {len(data)} bytes, this engine's page is "
                f"{group[name].page_bytes} bytes (another dtype or block size?)"
            )


def read_pages(
    kv_buffer: torch.Tensor, layouts: Mapping[str, LayerLayout], block_id: int
) -> dict[str, bytes]:
    """The bytes of block `block_id` of every layer in `layouts`."""
    return {
        name: kv_buffer[layout.block_bytes(block_id)].cpu().numpy().tobytes()
        for name, layout in layouts.items()
    }


def write_pages(
    kv_buffer: torch.Tensor,
    layouts: Mapping[str, LayerLayout],
    block_id: int,
    pages: Mapping[str, bytes],
) -> None:
    """Copy each layer's bytes into block `block_id` of that layer."""
    for name, data in pages.items():
        source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        kv_buffer[layouts[name].block_bytes(block_id)].copy_(source)


def _group(layouts: Mapping[str, LayerLayout], group_id: int) -> dict[str, LayerLayout]:
    return {name: layout for name, layout in layouts.items() if layout.group_id == group_id}
