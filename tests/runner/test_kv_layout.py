"""The standard KV layout: it names exactly the bytes every view writes (for every spec, and as
the worker binds real models), and it is enough to move cached blocks to a second engine that
then hits them and produces the same tokens and logits."""

from __future__ import annotations

import math
import random

import attrs
import pytest
import torch

from unified_attn import LLMEngine, SamplingParams
from unified_attn.runner.kv_layout import LayerLayout, layer_layout
from unified_attn.tensor_specs import PagedKVSpec, StateSpec

# ---- the layout names the bytes each view writes ----------------------------------------------


def touched_bytes(buffer: torch.Tensor, view, block_id: int) -> torch.Tensor:
    """Indices of the bytes that writing every element of block `block_id` changes."""
    buffer.zero_()
    for tensor in view if isinstance(view, tuple) else (view,):
        tensor[block_id].view(torch.uint8).fill_(0xFF)
    return buffer.nonzero().flatten()


def named_bytes(layout: LayerLayout, block_id: int) -> torch.Tensor:
    """The bytes the layout's tensors cover in block `block_id`, which must lie in its page."""
    page = layout.block_bytes(block_id)
    ranges = []
    for t in layout.tensors:
        itemsize = getattr(torch, t.dtype).itemsize
        assert t.strides[0] * itemsize == layout.bytes_per_block
        assert t.strides[1:] == torch.empty(t.shape[1:]).stride()  # contiguous inside a block
        start = block_id * layout.bytes_per_block + t.offset_bytes
        end = start + math.prod(t.shape[1:]) * itemsize
        assert page.start <= start and end <= page.stop
        ranges.append(torch.arange(start, end))
    return torch.cat(ranges).sort().values


SPECS = [
    PagedKVSpec(num_kv_heads=2, head_size=8, dtype="float16"),
    PagedKVSpec(num_kv_heads=3, head_size=4, dtype="float32"),
    PagedKVSpec(num_kv_heads=1, head_size=16, dtype="bfloat16"),
    PagedKVSpec(num_kv_heads=2, head_size=8, dtype="float8_e4m3fn"),
    StateSpec(shapes=[(2, 4, 4)], dtypes=["float32"]),
    StateSpec(shapes=[(3,), (2, 5), (4,)], dtypes=["int8", "float32", "float16"]),  # padded
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("offset", [0, 64])
def test_every_block_of_every_spec_is_where_the_layout_says(spec, offset):
    block_size, num_blocks = 4, 5
    page = spec.page_size_bytes(block_size)
    bytes_per_block = offset + page + 32  # another layer before it, waste after it
    buffer = torch.zeros(num_blocks * bytes_per_block, dtype=torch.uint8)
    view = spec.make_view(buffer, offset, bytes_per_block, num_blocks, block_size)
    layout = layer_layout(
        0, spec, offset, view,
        block_size=block_size, bytes_per_block=bytes_per_block, num_blocks=num_blocks,
    )  # fmt: skip
    assert layout.page_bytes == page
    for b in range(num_blocks):
        touched = touched_bytes(buffer, view, b)
        assert torch.equal(touched, named_bytes(layout, b))
        if isinstance(spec, PagedKVSpec):  # no padding: the whole page, nothing else
            page_bytes = layout.block_bytes(b)
            assert torch.equal(touched, torch.arange(page_bytes.start, page_bytes.stop))


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-hybrid", "hybrid-linear"])
def test_the_worker_binds_every_layer_where_its_layout_says(preset):
    engine = LLMEngine(preset, kv_cache_memory="1MiB", max_model_len=256)
    worker = engine.worker
    layouts = engine.kv_cache_layout()
    assert set(layouts) == set(worker.bound_layers)
    for name, layout in layouts.items():
        view = worker.bound_layers[name].view
        for b in (0, 1, layout.num_blocks - 1):
            assert torch.equal(touched_bytes(worker.kv_buffer, view, b), named_bytes(layout, b))


def test_layout_fields_of_a_full_attention_model():
    engine = LLMEngine("tiny-llama", kv_cache_memory="4MiB", max_model_len=512)
    layouts = engine.kv_cache_layout()
    page = 2 * 16 * 2 * 32 * 4  # K and V, 16 tokens, 2 KV heads of 32, float32
    assert [lay.offset_bytes for lay in layouts.values()] == [0, page, 2 * page, 3 * page]
    layout = layouts["model.layers.1.self_attn"]
    assert (layout.group_id, layout.kind, layout.block_size, layout.dtype) == (
        0, "paged_kv", 16, "float32",
    )  # fmt: skip
    assert layout.page_bytes == page and layout.bytes_per_block == 4 * page
    assert layout.shape == (engine.worker.num_blocks, 2, 16, 2, 32)
    assert layout.strides == (4 * page // 4, 1024, 64, 32, 1)
    state = LLMEngine("hybrid-linear", kv_cache_memory="4MiB", max_model_len=512)
    assert {lay.kind for lay in state.kv_cache_layout().values()} == {"state", "paged_kv"}


def test_a_multi_tensor_layer_has_no_single_dtype():
    spec = SPECS[-1]
    buffer = torch.zeros(2 * 64, dtype=torch.uint8)
    view = spec.make_view(buffer, 0, 64, 2, 4)
    layout = layer_layout(0, spec, 0, view, block_size=4, bytes_per_block=64, num_blocks=2)
    assert [t.dtype for t in layout.tensors] == ["int8", "float32", "float16"]
    with pytest.raises(ValueError, match="tensors"):
        _ = layout.dtype


# ---- moving cached blocks to a second engine ---------------------------------------------------

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True, return_logits=True)
PROMPT = [random.Random(3).randrange(256) for _ in range(100)]


def run(engine: LLMEngine, prompt: list[int]):
    (out,) = engine.generate([prompt], PARAMS)
    return out.output_token_ids, out.logits


def hits(engine: LLMEngine) -> int:
    return engine.kv_cache_manager.prefix_cache_stats.hits


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-hybrid", "hybrid-linear"])
def test_imported_blocks_are_prefix_hits_that_change_nothing(preset):
    a = LLMEngine(preset, kv_cache_memory="4MiB", max_model_len=512)
    cold_tokens, cold_logits = run(a, PROMPT)
    before = hits(a)
    warm_tokens, warm_logits = run(a, PROMPT)  # A hits its own cache: the path B will take
    warm_hit = hits(a) - before
    assert warm_hit == 96  # the prompt's full blocks but the last token's

    blocks = a.export_cached_blocks(a.prompt_block_hashes(PROMPT), PROMPT)
    assert {b.group_id for b in blocks} == set(range(a.kv_cache_manager.num_groups))
    # B has another block count: block ids differ, the layout of a block does not.
    b = LLMEngine(preset, kv_cache_memory="6MiB", max_model_len=512)
    assert b.import_cached_blocks(blocks) == len(blocks)
    assert b.import_cached_blocks(blocks) == 0  # already cached
    tokens, logits = run(b, PROMPT)
    assert hits(b) == warm_hit
    assert tokens == warm_tokens == cold_tokens
    assert torch.equal(logits, warm_logits)
    torch.testing.assert_close(logits, cold_logits)


def test_import_checks_every_block_before_changing_anything():
    a = LLMEngine("tiny-llama", kv_cache_memory="4MiB", max_model_len=512)
    run(a, PROMPT)
    blocks = a.export_cached_blocks(a.prompt_block_hashes(PROMPT))
    assert blocks and all(b.token_ids == () for b in blocks)
    b = LLMEngine("tiny-llama", kv_cache_memory="4MiB", max_model_len=512)
    pool = b.kv_cache_manager.block_pool
    name, data = next(iter(blocks[-1].pages.items()))
    short = [*blocks[:-1], attrs.evolve(blocks[-1], pages={**blocks[-1].pages, name: data[:-4]})]
    with pytest.raises(ValueError, match=f"layer '{name}' has {len(data) - 4} bytes"):
        b.import_cached_blocks(short)
    other = LLMEngine("tiny-hybrid", kv_cache_memory="4MiB", max_model_len=512)
    with pytest.raises(ValueError, match="the same model"):
        other.import_cached_blocks(blocks)
    assert pool.num_cached_blocks() == 0 and pool.get_num_free_blocks() == pool.num_blocks - 1
    off = LLMEngine("tiny-llama", kv_cache_memory="4MiB", max_model_len=512,
                    enable_prefix_caching=False)  # fmt: skip
    with pytest.raises(ValueError, match="prefix caching is off"):
        off.import_cached_blocks(blocks)
