"""The fp8 (e4m3) KV cache's building blocks: the paged spec's page bytes, the dtype names,
quantization with saturation, calibration and the per-layer scale bookkeeping (`kv_quant`)."""

from __future__ import annotations

import pytest
import torch

from unified_attn.backend import LayerConfig
from unified_attn.backends.kv_quant import (
    FP8_MAX,
    KVScales,
    calibrated_scale,
    dequantize_fp8,
    kv_cache_dtype_reasons,
    quantize_fp8,
)
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.selector import SelectorConfig
from unified_attn.tensor_specs import PagedKVSpec
from unified_attn.tensor_specs.paged import is_fp8_kv, kv_cache_dtype_name

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("model_dtype", ["bfloat16", "float16"])
def test_an_fp8_page_holds_half_the_bytes_of_a_16_bit_page(model_dtype):
    fp8, wide = PagedKVSpec(8, 128, "fp8"), PagedKVSpec(8, 128, model_dtype)
    assert fp8.dtype == FP8 and PagedKVSpec(8, 128, "fp8_e4m3") == fp8
    assert fp8.page_size_bytes(16) * 2 == wide.page_size_bytes(16) == 2 * 16 * 8 * 128 * 2
    buffer = torch.zeros(4 * fp8.page_size_bytes(16), dtype=torch.uint8)
    view = fp8.make_view(buffer, 0, fp8.page_size_bytes(16), 4, 16)
    assert view.dtype == FP8 and view.shape == (4, 2, 16, 8, 128)


def test_a_backend_built_with_fp8_declares_an_fp8_spec():
    backend = ReferenceAttentionBackend(
        num_kv_heads=2, head_size=32, dtype=torch.bfloat16, kv_cache_dtype="fp8"
    )
    assert backend.get_cache_config()[2] == PagedKVSpec(2, 32, FP8)


def test_engine_names_of_the_cache_dtype():
    assert kv_cache_dtype_name("auto") == "auto"
    assert kv_cache_dtype_name("fp8") == kv_cache_dtype_name("fp8_e4m3") == "float8_e4m3fn"
    for bad in ("fp4", "float16", "fp8_e5m2", ""):
        with pytest.raises(ValueError, match=rf"kv_cache_dtype={bad!r} is not supported.*'fp8'"):
            kv_cache_dtype_name(bad)
    assert is_fp8_kv("fp8") and is_fp8_kv(FP8) and not is_fp8_kv("auto")
    assert not is_fp8_kv("fp4") and not is_fp8_kv(torch.float16)


@pytest.mark.parametrize("kv", ["fp8", "auto", torch.float32, "float32"])
def test_backends_storing_fp8_or_the_model_dtype_accept(kv):
    cfg = SelectorConfig(head_size=32, dtype="float32", kv_cache_dtype=kv)
    assert kv_cache_dtype_reasons("reference", cfg) == []


@pytest.mark.parametrize("kv", ["fp4", "float8_e5m2", "float16"])
def test_other_cache_dtypes_are_refused_naming_backend_and_value(kv):
    cfg = SelectorConfig(head_size=32, dtype="float32", kv_cache_dtype=kv)
    (reason,) = kv_cache_dtype_reasons("triton", cfg)
    assert reason.startswith(f"KV-cache dtype {kv} must equal the model dtype (torch.float32)")
    assert "triton takes kv_cache_dtype 'auto' or 'fp8'" in reason


def test_quantization_saturates_instead_of_overflowing():
    x = torch.tensor([1000.0, -1000.0, 448.0, 449.0, 500.0, -464.0, 0.0, float("nan")])
    stored = quantize_fp8(x, torch.tensor(1.0))
    assert stored.dtype == FP8
    assert stored.float()[:6].tolist() == [448.0, -448.0, 448.0, 448.0, 448.0, -448.0]
    assert stored.float()[6] == 0 and stored.float()[7].isnan()  # NaN stays NaN, no inf/NaN
    halved = quantize_fp8(torch.tensor([1000.0, 104.0]), torch.tensor(2.0))  # 500 -> 448
    assert dequantize_fp8(halved, torch.tensor(2.0)).tolist() == [896.0, 104.0]


def test_quantization_rounds_to_nearest_even_and_dequantizes_with_the_scale():
    scale = torch.tensor(0.5)
    # 1.0625 / 0.5 = 2.125: halfway between 2.0 and 2.25 -> even mantissa (2.0)
    # 1.1875 / 0.5 = 2.375: halfway between 2.25 and 2.5 -> 2.5
    stored = quantize_fp8(torch.tensor([1.0625, 1.1875, -3.0]), scale)
    assert stored.float().tolist() == [2.0, 2.5, -6.0]
    assert dequantize_fp8(stored, scale).tolist() == [1.0, 1.25, -3.0]
    assert dequantize_fp8(stored, scale).dtype == torch.float32


def test_round_trip_error_is_within_half_an_e4m3_step():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    scale = calibrated_scale(x)
    back = dequantize_fp8(quantize_fp8(x, scale), scale)
    # 3 mantissa bits: relative error <= 2^-4 for normal values; subnormals: <= scale * 2^-10
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10)
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()


def test_calibrated_scale_is_amax_over_448_of_the_written_rows():
    x = torch.tensor([[1.0, -8.96], [100.0, 3.0], [0.5, 0.25]])
    assert calibrated_scale(x) == torch.tensor(100.0) / FP8_MAX
    written = torch.tensor([True, False, True])
    assert calibrated_scale(x, written) == torch.tensor(8.96) / FP8_MAX
    assert calibrated_scale(x.half()).dtype == torch.float32


@pytest.mark.parametrize(
    "x", [torch.zeros(3, 2), torch.full((2, 2), float("inf")), torch.empty(0, 2)]
)
def test_calibrated_scale_falls_back_to_one(x):
    assert calibrated_scale(x) == 1.0


def layer(name="l0"):
    return LayerConfig(name, 4, 2, 8, scale=1.0)


def test_scales_are_calibrated_once_by_the_first_eager_step_with_keys():
    scales = KVScales(calibrate=True)
    scales.bind(["l0", "l1"], torch.device("cpu"))
    assert scales.tensors["l0"].tolist() == [1.0, 1.0] and not scales.fixed
    scales.begin_step(has_keys=True, capturing=True)  # a CUDA-graph capture never calibrates
    scales.begin_step(has_keys=False, capturing=False)  # nor a step without keys
    assert not scales.take_pending("l0") and not scales.fixed
    scales.begin_step(has_keys=True, capturing=False)
    assert scales.pending == {"l0", "l1"} and not scales.fixed
    assert scales.take_pending("l0") and not scales.take_pending("l0")  # once per step
    assert scales.fixed == {"l0"}
    k, v = torch.full((3, 2, 8), 4.48), torch.full((3, 2, 8), -8.96)
    scales.calibrate_layer("l0", k, v)
    assert torch.equal(scales.tensors["l0"], torch.tensor([4.48, 8.96]) / FP8_MAX)
    # l1 did not run in that step (never the case in a model): it calibrates at its next one
    scales.begin_step(has_keys=True, capturing=False)
    assert not scales.take_pending("l0") and scales.take_pending("l1")
    scales.begin_step(has_keys=True, capturing=False)  # later steps: nothing pending
    assert not scales.take_pending("l0") and not scales.take_pending("l1")


def test_batch_invariant_scales_never_calibrate():
    scales = KVScales(calibrate=False)
    scales.bind(["l0"], torch.device("cpu"))
    scales.begin_step(has_keys=True, capturing=False)
    assert not scales.take_pending("l0") and scales.tensors["l0"].tolist() == [1.0, 1.0]


def test_checkpoint_scales_are_checked_and_take_precedence():
    scales = KVScales(calibrate=True)
    scales.bind(["l0"], torch.device("cpu"))
    given = torch.tensor([0.1, 0.2])
    assert scales.of(layer(), given) is given
    assert scales.of(layer(), None) is scales.tensors["l0"]
    for bad in (torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.1, 0.2], dtype=torch.float64)):
        with pytest.raises(ValueError, match=r"layer l0: kv_scales must be a \[2\] float32"):
            scales.of(layer(), bad)
