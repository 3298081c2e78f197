import pytest
import torch

from unified_attn.backend import AttentionBackend
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.selector import (
    SelectorConfig,
    register_backend,
    registered_backends,
    resolve_backend,
    select_backend,
)


class _Picky(AttentionBackend):
    name = "test-picky"

    @classmethod
    def validate_configuration(cls, cfg):
        return [] if cfg.head_size == 64 else [f"head size {cfg.head_size} is not 64"]

    def prep_forward(self, common, block_tables, for_cudagraph_capture=False):
        pass

    def forward(self, layer, output, query, key, value, **kwargs):
        return output


@pytest.fixture
def picky():
    register_backend(priority={"cpu": 1000})(_Picky)
    yield _Picky
    from unified_attn import selector

    selector._REGISTRY.pop("test-picky")


def test_reference_is_the_cpu_default():
    assert (
        select_backend(SelectorConfig(head_size=64, dtype="float32")) is ReferenceAttentionBackend
    )


def test_highest_priority_valid_backend_wins(picky):
    assert select_backend(SelectorConfig(head_size=64, dtype="float32")) is picky
    assert (
        select_backend(SelectorConfig(head_size=32, dtype="float32")) is ReferenceAttentionBackend
    )


def test_override_is_validated_without_fallback(picky):
    with pytest.raises(ValueError, match="head size 32 is not 64"):
        select_backend(SelectorConfig(head_size=32, dtype="float32"), override="test-picky")


def test_unknown_backend_lists_the_valid_names():
    with pytest.raises(ValueError, match=r"backend 'nope'; use one of .*\breference\b"):
        resolve_backend("nope")


def test_module_path_override():
    cls = resolve_backend("unified_attn.backends.reference:ReferenceAttentionBackend")
    assert cls is ReferenceAttentionBackend


def test_no_valid_backend_lists_every_backend_with_reasons(picky):
    cfg = SelectorConfig(head_size=32, dtype="float32", kv_cache_dtype="float16")
    with pytest.raises(ValueError) as err:
        select_backend(cfg)
    assert "reference: KV-cache dtype float16 must equal the model dtype" in str(err.value)
    assert "test-picky: head size 32 is not 64" in str(err.value)


def test_batch_invariant_mode_from_the_environment(monkeypatch, picky):
    # read once, into the engine's config; the selector takes the mode as a value
    from unified_attn.engine.engine_config import EngineConfig, with_environment

    monkeypatch.setenv("UNIFIED_ATTN_BATCH_INVARIANT", "1")
    assert not SelectorConfig(head_size=64, dtype=torch.float32).use_batch_invariant
    assert with_environment(EngineConfig()).batch_invariant
    monkeypatch.setenv("UNIFIED_ATTN_BATCH_INVARIANT", "0")
    assert not with_environment(EngineConfig()).batch_invariant
    monkeypatch.setenv("UNIFIED_ATTN_BATCH_INVARIANT", "on")  # not silently off
    with pytest.raises(ValueError, match=r"UNIFIED_ATTN_BATCH_INVARIANT='on' is not a switch"):
        with_environment(EngineConfig())
    cfg = SelectorConfig(head_size=64, dtype=torch.float32, use_batch_invariant=True)
    assert select_backend(cfg) is ReferenceAttentionBackend  # picky is not batch invariant


def test_registry_has_the_builtin_backends():
    assert "reference" in registered_backends()


def test_state_layers_select_the_state_backend_and_attention_backends_refuse_them():
    from unified_attn.backends.linear_state import LinearStateBackend

    state = SelectorConfig(head_size=32, dtype="float32", layer_kind="linear_state")
    assert select_backend(state) is LinearStateBackend
    with pytest.raises(ValueError, match="serves attention layers, not linear_state"):
        select_backend(state, override="reference")
    attention = SelectorConfig(head_size=32, dtype="float32")
    assert select_backend(attention) is ReferenceAttentionBackend
    with pytest.raises(ValueError, match="serves linear_state layers, not attention"):
        select_backend(attention, override="linear-state")
