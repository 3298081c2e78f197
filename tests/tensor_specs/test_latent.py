import pytest
import torch

from unified_attn.tensor_specs import LatentKVSpec, PagedKVSpec


def test_page_bytes_are_one_vector_per_token():
    spec = LatentKVSpec(head_size=512 + 64, dtype=torch.bfloat16)
    assert spec.page_size_bytes(64) == 64 * 576 * 2
    assert LatentKVSpec(48, "float32").page_size_bytes(16) == 16 * 48 * 4
    # MHA with the same width per head would store K and V for every head
    assert PagedKVSpec(128, 576, "bfloat16").page_size_bytes(64) == 2 * 128 * spec.page_size_bytes(
        64
    )


def test_view_aliases_the_shared_buffer_with_the_block_stride():
    spec = LatentKVSpec(head_size=6, dtype="float16")
    page = spec.page_size_bytes(block_size=4)
    stride = 3 * page  # bytes_per_block larger than this layer's page
    buffer = torch.zeros(5 * stride, dtype=torch.uint8)
    a = spec.make_view(buffer, 0, stride, 5, 4)
    b = spec.make_view(buffer, page, stride, 5, 4)
    assert a.shape == (5, 4, 6) and a.dtype == torch.float16
    assert a.stride() == (stride // 2, 6, 1)
    b[3, 2] = 1.0
    assert a.sum() == 0  # layers do not overlap
    raw = buffer.view(torch.float16)
    start = (3 * stride + page) // 2 + 2 * 6
    assert raw[start : start + 6].tolist() == [1.0] * 6
    assert raw.sum() == 6


def test_views_reject_misaligned_offsets_and_short_buffers():
    spec = LatentKVSpec(8, "float32")
    buffer = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiples"):
        spec.make_view(buffer, 2, 256, 2, 4)
    with pytest.raises(ValueError, match="bytes but the buffer has"):
        spec.make_view(buffer, 0, 512, 4, 4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(head_size=0, dtype="float16"), r"LatentKVSpec\.head_size must be a positive int"),
        (dict(head_size=2.5, dtype="float16"), r"LatentKVSpec\.head_size.*got 2\.5"),
        (dict(head_size=8, dtype="float13"), r"LatentKVSpec\.dtype: unknown dtype 'float13'"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LatentKVSpec(**kwargs)


def test_specs_are_hashable_values():
    assert LatentKVSpec(576, "bfloat16") == LatentKVSpec(576, torch.bfloat16)
    assert len({LatentKVSpec(576, "bfloat16"), LatentKVSpec(576, torch.bfloat16)}) == 1
    assert LatentKVSpec(576, "bfloat16") != LatentKVSpec(576, "float16")
