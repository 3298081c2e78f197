"""The decode-row GEMMs in a fused decoder (`UNIFIED_ATTN_SKINNY_GEMM=1`, `models/fused.py`;
CPU: the Triton interpreter): every family feature of `test_fused.py` against the torch path,
steps of up to 16 rows through the fused add + norm + GEMM launches (counted), longer steps and
post-norm layers through the library path, greedy decode steps, and the setting's validation."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.models.prefill import greedy_decode, prefill_logits
from tests.models.test_fused import CONFIGS, LLAMA, PROMPTS, make_model, spy_on
from unified_attn.kernels.layers import skinny_gemm

SKINNY = ("skinny_add_norm_linear", "skinny_linear", "skinny_act_linear")


@pytest.fixture
def skinny_calls(monkeypatch) -> Counter:
    """Turns the decode-row GEMMs on; counts their launches."""
    monkeypatch.setenv("UNIFIED_ATTN_SKINNY_GEMM", "1")
    return spy_on(monkeypatch, [(skinny_gemm, name) for name in SKINNY], Counter())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_skinny_decoder_matches_the_torch_path(name, skinny_calls):
    torch_model = make_model(CONFIGS[name])
    skinny_model = make_model(CONFIGS[name], fused=True)
    for want, got in zip(prefill_logits(torch_model, PROMPTS),
                         prefill_logits(skinny_model, PROMPTS), strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    layers = CONFIGS[name].num_layers
    assert skinny_calls["skinny_linear"] == layers  # o_proj
    if CONFIGS[name].post_norms:  # Gemma 2 norms the attention output before the add
        assert "skinny_add_norm_linear" not in skinny_calls
    else:
        assert skinny_calls["skinny_add_norm_linear"] >= layers, skinny_calls


def test_a_llama_layer_is_four_launches_and_no_norm_kernels(skinny_calls, monkeypatch):
    from unified_attn.models import layers as layers_module
    from unified_attn.models import mlp as mlp_module

    norms = layers_module.norm_kernels
    glue = spy_on(monkeypatch, [(norms, "rms_norm"), (norms, "add_rms_norm"),
                                (mlp_module, "act_and_mul")], Counter())  # fmt: skip
    prefill_logits(make_model(LLAMA, fused=True), PROMPTS)
    layers = LLAMA.num_layers
    assert skinny_calls == Counter(skinny_add_norm_linear=2 * layers, skinny_linear=layers,
                                   skinny_act_linear=layers)  # fmt: skip
    assert glue == Counter(add_rms_norm=1)  # the final norm only


def test_longer_steps_take_the_library_gemm(skinny_calls):
    prompts = [list(range(1, 21))]  # 20 rows
    want = prefill_logits(make_model(LLAMA), prompts)[0]
    got = prefill_logits(make_model(LLAMA, fused=True), prompts)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not skinny_calls


def test_greedy_decode_steps_match_the_torch_path(skinny_calls):
    want = greedy_decode(make_model(LLAMA), PROMPTS, 6)
    assert greedy_decode(make_model(LLAMA, fused=True), PROMPTS, 6) == want
    assert skinny_calls["skinny_act_linear"] > 0


def test_float16_stays_within_rounding(skinny_calls):
    want, got = (prefill_logits(make_model(LLAMA, torch.float16, fused=f), PROMPTS)
                 for f in (False, True))  # fmt: skip
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    assert skinny_calls


def test_the_setting_is_off_by_default_and_validated(monkeypatch):
    from unified_attn.models.fused import skinny_by_default

    monkeypatch.delenv("UNIFIED_ATTN_SKINNY_GEMM", raising=False)
    assert not skinny_by_default()
    model = make_model(LLAMA, fused=True)
    assert not model.model.layers[0].self_attn.skinny
    monkeypatch.setenv("UNIFIED_ATTN_SKINNY_GEMM", "on")
    with pytest.raises(ValueError, match="UNIFIED_ATTN_SKINNY_GEMM='on': expected 0 or 1"):
        make_model(LLAMA, fused=True)


def test_a_bad_setting_is_refused_on_every_device(monkeypatch, capsys):
    """Read when any `DecoderModel` is built, not only a fused one on CUDA; the CLI says so in
    one line with exit code 2."""
    from unified_attn.cli import main as cli_main

    monkeypatch.setenv("UNIFIED_ATTN_SKINNY_GEMM", "on")
    with pytest.raises(ValueError, match="UNIFIED_ATTN_SKINNY_GEMM='on'"):
        make_model(LLAMA)
    assert cli_main(["run", "--max-tokens", "2", "--num-requests", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["unified-attn run: error: UNIFIED_ATTN_SKINNY_GEMM='on': expected 0 or 1"]
    monkeypatch.setenv("UNIFIED_ATTN_SKINNY_GEMM", "0")
    make_model(LLAMA)  # the same process builds models again
