"""`LegacyBackendAdapter` under the unified contract: grouping triples, layout, builders per
group, impls per layer, capability reasons and name resolution."""

import pytest
import torch

from tests.backends.batch import fill_cached_tokens, make_batch
from unified_attn.backend import LayerConfig
from unified_attn.backends.reference import ReferenceAttentionBackend, attend
from unified_attn.harness.migration.migration_run import legacy_name
from unified_attn.legacy_adapter import LegacyBackendAdapter
from unified_attn.legacy_adapter.layout import to_legacy_layout
from unified_attn.legacy_adapter.ports import LegacyReferenceAdapter, LegacyReferenceBackend
from unified_attn.legacy_adapter.ports.legacy_triton import LegacyTritonBackend
from unified_attn.managers import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    SlidingWindowManager,
)
from unified_attn.runner.worker import plan_kv_cache
from unified_attn.selector import SelectorConfig, registered_backends, resolve_backend
from unified_attn.tensor_specs import PagedKVSpec

KW = {"num_kv_heads": 2, "head_size": 8, "dtype": torch.float32}


@pytest.mark.parametrize(
    ("local", "manager", "config"),
    [
        ({}, FullAttentionManager, FullAttentionManager.Config()),
        ({"sliding_window": 32}, SlidingWindowManager, SlidingWindowManager.Config(32)),
        (
            {"attention_chunk_size": 64},
            ChunkedLocalAttentionManager,
            ChunkedLocalAttentionManager.Config(64),
        ),
    ],
)
def test_cache_config_triples_come_from_legacy_specs_and_match_native(local, manager, config):
    adapter = LegacyReferenceAdapter(**KW, **local)
    assert adapter.get_cache_config() == (manager, config, PagedKVSpec(2, 8, torch.float32))
    assert adapter.get_cache_config() == ReferenceAttentionBackend(**KW, **local).get_cache_config()
    assert adapter.get_cache_config() == LegacyReferenceAdapter(**KW, **local).get_cache_config()


def test_worker_groups_adapter_layers_like_native_ones():
    backends = {
        None: LegacyReferenceAdapter(**KW),
        32: LegacyReferenceAdapter(**KW, sliding_window=32),
    }
    layers = [
        (LayerConfig(f"l{i}", 4, 2, 8, scale=1.0, sliding_window=w), backends[w])
        for i, w in enumerate([None, 32, None, 32])
    ]
    plan = plan_kv_cache(layers, block_size=16)
    assert [(g.manager_cls, [lp.layer.name for lp in g.layers]) for g in plan.groups] == [
        (FullAttentionManager, ["l0", "l2"]),
        (SlidingWindowManager, ["l1", "l3"]),
    ]


def bound_adapter(num_blocks=32, block_size=4, **local):
    adapter = LegacyReferenceAdapter(**KW, **local)
    _, _, spec = adapter.get_cache_config()
    page = spec.page_size_bytes(block_size)
    buffer = torch.zeros(2 * page * (num_blocks + 1), dtype=torch.uint8)
    views = {
        name: spec.make_view(buffer, off, 2 * page, num_blocks, block_size)
        for name, off in (("a", 0), ("b", page))
    }
    adapter.bind_kv_caches(views, {"a": 0, "b": 5})
    return adapter, views


def test_legacy_cache_is_the_kv_first_transpose_of_the_unified_view():
    adapter, views = bound_adapter()
    legacy = adapter.legacy_caches["a"]
    assert legacy.shape == LegacyReferenceBackend.get_kv_cache_shape(32, 4, 2, 8)
    legacy[1, 7, 2] = 3.0  # V of block 7, offset 2
    assert views["a"][7, 1, 2].eq(3.0).all()
    assert legacy.data_ptr() == views["a"].data_ptr()  # a view, not a copy


def test_two_blocks_are_told_apart_and_foreign_layouts_are_rejected():
    view = PagedKVSpec(2, 8, torch.float32).make_view(
        torch.zeros(2 * 512, dtype=torch.uint8), 0, 512, 2, 4
    )
    assert torch.equal(
        torch.tensor(to_legacy_layout(LegacyReferenceBackend, view).stride()),
        torch.tensor(view.transpose(0, 1).stride()),
    )

    class HeadsFirst(LegacyReferenceBackend):
        @staticmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
            return (num_blocks, num_kv_heads, 2, block_size, head_size)

    with pytest.raises(ValueError, match="declares KV-cache shape"):
        to_legacy_layout(HeadsFirst, view)


def test_one_builder_per_group_with_the_bound_block_size():
    adapter, _ = bound_adapter(sliding_window=8)
    assert sorted(adapter.builders) == [0, 5]
    assert adapter.builders[5].layer_names == ["b"]
    assert adapter.builders[0].kv_cache_spec.block_size == 4
    assert adapter.builders[0].kv_cache_spec.sliding_window == 8
    batch = make_batch([3], [2], num_kv_heads=2, head_size=8, block_size=4, num_blocks=32)
    batch.common.slot_mappings[5] = batch.common.slot_mappings[0]
    adapter.prep_forward(batch.common, {0: batch.block_table, 5: batch.block_table})
    assert sorted(adapter.current_plan().metadata) == [0, 5]
    with pytest.raises(ValueError, match="group 9"):
        adapter.prep_forward(batch.common, {9: batch.block_table})


def test_impls_are_made_once_per_layer_and_the_math_matches():
    adapter, views = bound_adapter()
    computed, new = [5, 0], [1, 3]
    batch = make_batch(computed, new, num_kv_heads=2, head_size=8, block_size=4, num_blocks=32)
    fill_cached_tokens(views["a"], batch, computed)
    layer = LayerConfig("a", 4, 2, 8, scale=8**-0.5)
    q = torch.randn(4, 32)
    impls = []
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        adapter.prep_forward(batch.common, {0: batch.block_table})
        assert adapter.forward(layer, out, q, batch.k_new.flatten(1), batch.v_new.flatten(1)) is out
        impls.append(adapter.impls["a"].impl)
    assert impls[0] is impls[1]
    expected = attend(layer, q[:1].view(1, 4, 8), batch.k_full[0], batch.v_full[0], 5)
    torch.testing.assert_close(out[:1].view(1, 4, 8), expected)
    sinks = torch.zeros(4)
    adapter.forward(layer, out, q, batch.k_new.flatten(1), batch.v_new.flatten(1), sinks=sinks)
    assert adapter.impls["a"].impl is not impls[0] and adapter.impls["a"].impl.sinks is sinks


def test_bad_shapes_are_rejected_before_the_impl_runs():
    adapter, _ = bound_adapter()
    layer = LayerConfig("layers.3", 4, 2, 8, scale=1.0)
    with pytest.raises(ValueError, match=r"layers\.3: key has shape"):
        adapter.forward(
            layer, torch.empty(3, 32), torch.randn(3, 32), torch.randn(3, 15), torch.randn(3, 16)
        )
    assert "layers.3" not in adapter.impls


def test_capabilities_become_reasons():
    triton = LegacyBackendAdapter.wrap(LegacyTritonBackend)
    cfg = SelectorConfig(head_size=8, dtype=torch.float32, device="cuda", has_sinks=True)
    assert triton.validate_configuration(cfg) == [
        "head size 8 is not one of " + str(list(range(16, 257, 16)))
    ]
    fp8 = SelectorConfig(head_size=32, dtype=torch.float32, kv_cache_dtype="float8_e4m3fn")
    assert any("KV-cache dtype" in r for r in LegacyReferenceAdapter.validate_configuration(fp8))
    assert LegacyBackendAdapter.validate_configuration(cfg)  # nothing bound
    assert not triton.supports_batch_invariance()
    assert not LegacyReferenceAdapter.supports_batch_invariance()  # its decodes are batched

    class ClaimsInvariance(LegacyReferenceBackend):
        @classmethod
        def supports_batch_invariance(cls) -> bool:
            return True

    assert LegacyBackendAdapter.wrap(ClaimsInvariance).supports_batch_invariance()


def test_construction_by_argument_by_wrap_and_by_name():
    direct = LegacyBackendAdapter(LegacyReferenceBackend, **KW)
    assert direct.legacy is LegacyReferenceBackend
    assert LegacyReferenceAdapter.name == "legacy-reference"
    with pytest.raises(ValueError, match="needs a legacy backend class"):
        LegacyBackendAdapter(**KW)
    assert resolve_backend(legacy_name("reference")) is LegacyReferenceAdapter
    assert resolve_backend("reference") is ReferenceAttentionBackend
    wrapped = resolve_backend(
        "unified_attn.legacy_adapter.ports.legacy_reference:LegacyReferenceBackend"
    )
    assert (
        issubclass(wrapped, LegacyBackendAdapter)
        and wrapped.legacy_backend is LegacyReferenceBackend
    )
    with pytest.raises(ValueError, match="neither an AttentionBackend"):
        resolve_backend("unified_attn.backend:LayerConfig")


def test_the_ports_change_nothing_in_the_selector():
    assert not any(name.startswith("legacy-") for name in registered_backends())
