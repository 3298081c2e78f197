import pytest
import torch

from unified_attn.tensor_specs import PagedKVSpec, StateSpec


def test_paged_page_size_and_strided_view_over_shared_buffer():
    spec = PagedKVSpec(num_kv_heads=2, head_size=4, dtype=torch.float16)
    page = spec.page_size_bytes(block_size=8)
    assert page == 2 * 8 * 2 * 4 * 2
    stride = page * 3  # bytes_per_block is larger than this layer's page
    buffer = torch.zeros(5 * stride, dtype=torch.uint8)
    a = spec.make_view(buffer, 0, stride, 5, 8)
    b = spec.make_view(buffer, page, stride, 5, 8)
    assert a.shape == (5, 2, 8, 2, 4) and a.dtype == torch.float16
    b[3, 1, 7] = 1.0
    assert a.sum() == 0  # layers do not overlap
    raw = buffer.view(torch.float16)
    start = (3 * stride + page) // 2 + (1 * 8 + 7) * 2 * 4
    assert raw[start : start + 8].tolist() == [1.0] * 8


def test_views_reject_misaligned_offsets_and_short_buffers():
    spec = PagedKVSpec(1, 4, "float32")
    buffer = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiples"):
        spec.make_view(buffer, 2, 256, 2, 4)
    with pytest.raises(ValueError, match="bytes but the buffer has"):
        spec.make_view(buffer, 0, 512, 4, 4)


def test_spec_validation():
    with pytest.raises(ValueError, match="num_kv_heads"):
        PagedKVSpec(0, 4, "float16")
    with pytest.raises(ValueError, match="head_size_v"):
        PagedKVSpec(1, 4, "float16", head_size_v=8)
    with pytest.raises(ValueError, match="unknown dtype"):
        PagedKVSpec(1, 4, "float13")


def test_specs_are_hashable_values():
    assert PagedKVSpec(2, 4, "float16") == PagedKVSpec(2, 4, torch.float16)
    assert len({PagedKVSpec(2, 4, "float16"), PagedKVSpec(2, 4, torch.float16)}) == 1


def test_state_spec_packs_tensors_and_ignores_block_size():
    spec = StateSpec(shapes=[(2, 3), (5,)], dtypes=["float32", "float16"])
    assert spec.page_size_bytes(16) == spec.page_size_bytes(64) == 2 * 3 * 4 + 5 * 2
    buffer = torch.zeros(4 * 64, dtype=torch.uint8)
    conv, ssm = spec.make_view(buffer, 0, 64, 4, 16)
    assert conv.shape == (4, 2, 3) and ssm.shape == (4, 5)
    ssm[2] = 1.0
    assert conv.sum() == 0
