"""Legacy specs: validation, and their split into the unified triple."""

import pytest
import torch

from unified_attn.legacy_adapter import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    split_spec,
)
from unified_attn.managers import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    SlidingWindowManager,
    StateManager,
)
from unified_attn.tensor_specs import PagedKVSpec, StateSpec

LAYOUT = {"block_size": 16, "num_kv_heads": 2, "head_size": 32, "dtype": "float16"}
PAGED = PagedKVSpec(2, 32, torch.float16)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (FullAttentionSpec(**LAYOUT), (FullAttentionManager, FullAttentionManager.Config(), PAGED)),
        (
            SlidingWindowSpec(sliding_window=128, **LAYOUT),
            (SlidingWindowManager, SlidingWindowManager.Config(sliding_window=128), PAGED),
        ),
        (
            ChunkedLocalAttentionSpec(attention_chunk_size=64, **LAYOUT),
            (
                ChunkedLocalAttentionManager,
                ChunkedLocalAttentionManager.Config(attention_chunk_size=64),
                PAGED,
            ),
        ),
        (
            MambaSpec(block_size=16, shapes=[(4, 8), (16,)], dtypes=["float32", "bfloat16"]),
            (
                StateManager,
                StateManager.Config(),
                StateSpec([(4, 8), (16,)], [torch.float32, torch.bfloat16]),
            ),
        ),
    ],
)
def test_each_legacy_spec_splits_into_policy_and_layout(spec, expected):
    assert split_spec(spec) == expected
    assert split_spec(spec) == split_spec(spec)  # pure


def test_block_size_is_dropped_the_worker_chooses_it():
    small = split_spec(SlidingWindowSpec(sliding_window=8, **(LAYOUT | {"block_size": 8})))
    assert small == split_spec(SlidingWindowSpec(sliding_window=8, **LAYOUT))


def test_a_promoted_window_in_a_full_spec_keeps_every_block():
    manager, config, _ = split_spec(FullAttentionSpec(sliding_window=32, **LAYOUT))
    assert (manager, config) == (FullAttentionManager, FullAttentionManager.Config())


def test_mamba_policy_fields_become_the_manager_config():
    spec = MambaSpec(block_size=16, shapes=[(4,)], dtypes=["float32"], mamba_cache_mode="align")
    assert split_spec(spec)[1] == StateManager.Config(mamba_cache_mode="align")


def test_unknown_spec_types_are_rejected_with_the_known_ones():
    class CustomSpec(FullAttentionSpec):
        pass

    with pytest.raises(ValueError, match=r"CustomSpec.*FullAttentionSpec, SlidingWindowSpec"):
        split_spec(CustomSpec(**LAYOUT))
    with pytest.raises(ValueError, match="no manager"):
        split_spec(KVCacheSpec(block_size=16))


@pytest.mark.parametrize(
    "bad",
    [
        {"sliding_window": 0},
        {"sliding_window": 8, "block_size": -16},
        {"sliding_window": 8, "head_size": 0},
    ],
)
def test_invalid_specs_fail_at_construction(bad):
    with pytest.raises(ValueError, match="must be a positive int"):
        SlidingWindowSpec(**(LAYOUT | bad))


def test_specs_are_frozen_and_hashable_and_know_their_page_size():
    spec = FullAttentionSpec(**LAYOUT)
    assert spec.page_size_bytes == 2 * 16 * 2 * 32 * 2 == PAGED.page_size_bytes(16)
    assert hash(spec) == hash(FullAttentionSpec(**LAYOUT))
    with pytest.raises(AttributeError):
        spec.block_size = 8  # type: ignore[misc]
