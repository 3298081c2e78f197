"""Worker planning: grouping by (manager_cls, config), splitting, sizing, binding; the budget
checked against the device; memory sizes (`runner/memory.py`)."""

import attrs
import pytest
import torch

from unified_attn.backend import LayerConfig
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.managers import FullAttentionManager, SlidingWindowManager
from unified_attn.runner.memory import format_memory, parse_memory
from unified_attn.runner.worker import (
    Worker,
    agree_on_num_blocks,
    choose_block_size,
    plan_kv_cache,
)


class FakeModel:
    def __init__(self, layers):
        self.layers = layers

    def attention_layers(self):
        return iter(self.layers)


def backend(window=None, heads=2, size=8):
    return ReferenceAttentionBackend(
        num_kv_heads=heads, head_size=size, dtype=torch.float16, sliding_window=window
    )


def layer(i, window=None, heads=2, size=8):
    return LayerConfig(f"layers.{i}", 4, heads, size, scale=1.0, sliding_window=window)


def test_equal_configs_share_a_group_even_across_backend_instances():
    a, b = backend(), backend()
    plan = plan_kv_cache([(layer(0), a), (layer(1), b)])
    assert len(plan.groups) == 1 and len(plan.groups[0].layers) == 2


def test_unequal_configs_get_separate_groups_and_alias_the_buffer():
    full, swa = backend(), backend(window=8)
    layers = [(layer(0), full), (layer(1, 8), swa), (layer(2), full), (layer(3, 8), swa)]
    plan = plan_kv_cache(layers)
    assert [g.manager_cls for g in plan.groups] == [FullAttentionManager, SlidingWindowManager]
    page = 2 * 16 * 2 * 8 * 2
    assert plan.bytes_per_block == 2 * page  # the max over groups, not the sum


def test_large_buckets_split_into_balanced_groups_and_report_waste():
    full, swa = backend(), backend(window=8)
    layers = [(layer(i, 8), swa) for i in range(7)] + [(layer(7 + i), full) for i in range(3)]
    plan = plan_kv_cache(layers)
    assert [len(g.layers) for g in plan.groups] == [3, 2, 2, 3]
    page = 2 * 16 * 2 * 8 * 2
    assert plan.wasted_bytes_per_block() == [0, page, page, 0]


class KeepAllManager(FullAttentionManager):
    @attrs.frozen
    class Config(FullAttentionManager.Config):
        tag: str = "model-specific"


class CustomBackend(ReferenceAttentionBackend):
    def get_cache_config(self):
        _, _, spec = super().get_cache_config()
        return KeepAllManager, KeepAllManager.Config(), spec


def test_a_custom_manager_gets_its_own_group_without_editing_any_table():
    custom = CustomBackend(num_kv_heads=2, head_size=8, dtype=torch.float16)
    plan = plan_kv_cache([(layer(0), backend()), (layer(1), custom)])
    assert [g.manager_cls for g in plan.groups] == [FullAttentionManager, KeepAllManager]


def test_sizing_allocation_and_binding():
    full, swa = backend(), backend(window=8)
    model = FakeModel([(layer(0), full), (layer(1, 8), swa)])
    page = 2 * 16 * 2 * 8 * 2
    worker = Worker(
        model, device="cpu", max_model_len=64, max_in_flight_tokens=16, kv_cache_memory=page * 20
    )
    assert worker.determine_num_blocks() == 20
    worker.allocate(20)
    assert worker.kv_buffer.numel() == 20 * page
    full_view, swa_view = full.kv_caches["layers.0"], swa.kv_caches["layers.1"]
    assert full_view.shape == (20, 2, 16, 2, 8)
    assert full_view.data_ptr() == swa_view.data_ptr()  # groups alias byte 0 of each block
    assert full.group_of_layer == {"layers.0": 0} and swa.group_of_layer == {"layers.1": 1}
    report = worker.report()
    assert report.blocks_per_request == (4, 3)  # cdiv(64,16); cdiv(min(7+16,64),16)+1
    assert report.max_concurrency == pytest.approx(20 / 7)


def test_budget_too_small_names_needed_available_and_the_largest_fitting_len():
    model = FakeModel([(layer(0), backend())])
    page = 2 * 16 * 2 * 8 * 2
    worker = Worker(
        model, device="cpu", max_model_len=1024, max_in_flight_tokens=64, kv_cache_memory=page * 10
    )
    with pytest.raises(ValueError, match=r"largest max_model_len that fits is 144"):
        worker.determine_num_blocks()


def test_engine_agrees_on_the_minimum_block_count():
    page = 2 * 16 * 2 * 8 * 2
    workers = [
        Worker(
            FakeModel([(layer(0), backend())]),
            device="cpu",
            max_model_len=64,
            max_in_flight_tokens=16,
            kv_cache_memory=page * n,
        )
        for n in (30, 12, 50)
    ]
    assert agree_on_num_blocks(workers) == 12


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size must be positive"):
        plan_kv_cache([(layer(0), backend())], block_size=0)


class Prefers64(ReferenceAttentionBackend):
    @classmethod
    def preferred_kernel_block_size(cls):
        return 64


class Takes16Or32(ReferenceAttentionBackend):
    @classmethod
    def supported_kernel_block_sizes(cls):
        return (16, 32)


def make(cls):
    return cls(num_kv_heads=2, head_size=8, dtype=torch.float16)


def test_a_preferred_block_size_is_taken_when_none_is_named():
    assert choose_block_size([make(Prefers64), backend()], None) == 64
    assert choose_block_size([make(Prefers64)], 16) == 16  # a named size wins
    # a preference another backend cannot take falls back to the usual rule
    assert choose_block_size([make(Prefers64), make(Takes16Or32)], None) == 16
    assert choose_block_size([backend(), backend()], None) == 16


# ---- the budget against what the device has; memory sizes as users write them -------------


def one_layer_worker(device: str, memory: int) -> Worker:
    return Worker(
        FakeModel([(layer(0), backend())]),
        device=device,
        max_model_len=64,
        max_in_flight_tokens=16,
        kv_cache_memory=memory,
    )


def test_a_budget_larger_than_the_host_names_both_sizes(monkeypatch):
    import unified_attn.runner.worker as worker_module

    monkeypatch.setattr(worker_module, "host_memory_bytes", lambda: 8 * 2**30)
    with pytest.raises(ValueError) as error:
        one_layer_worker("cpu", 12 * 2**30).determine_num_blocks()
    assert str(error.value) == (
        "kv_cache_memory=12.0 GiB is more than this machine's RAM has (8.0 GiB in total); "
        "give the KV cache at most 8.0 GiB"
    )
    assert one_layer_worker("cpu", 8 * 2**30).available_memory() == 8 * 2**30


def test_a_budget_larger_than_the_gpu_names_both_sizes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 80 * 2**30))
    with pytest.raises(ValueError, match=r"kv_cache_memory=1.0 TiB is more than device 'cuda' "
                                         r"has \(80.0 GiB in total\)"):  # fmt: skip
        one_layer_worker("cuda", 2**40).available_memory()


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError, match="kv_cache_memory must be a positive number of bytes"):
        one_layer_worker("cpu", 0).available_memory()


@pytest.mark.parametrize(
    "text, size",
    [("256MiB", 256 * 2**20), ("1.5GiB", 3 * 2**29), ("512m", 512 * 2**20), ("2TB", 2 * 10**12),
     ("1TiB", 2**40), ("1t", 2**40), ("3 kb", 3000), ("4096", 4096), (".5k", 512), (7, 7)],
)  # fmt: skip
def test_parse_memory_units(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize(
    "text, message",
    [("5XB", "unknown unit 'XB'"), ("0", "is zero"), ("0GiB", "is zero"),
     ("-1GiB", "is negative"), (-5, "is negative"), ("0.1b", "under one byte"),
     ("1.2.3GiB", "cannot parse"), (True, "is not a size")],
)  # fmt: skip
def test_parse_memory_refuses_what_makes_no_sense(text, message):
    with pytest.raises(ValueError, match=message):
        parse_memory(text)


def test_format_memory():
    assert [format_memory(n) for n in (512, 2048, 3 * 2**29, 2**40)] == [
        "512 B", "2.0 KiB", "1.5 GiB", "1.0 TiB"
    ]  # fmt: skip
