"""The decode-row GEMM in a fused decoder (on unless `UNIFIED_ATTN_SKINNY_GEMM=0`,
`models/fused.py`; CPU: the Triton interpreter): every family feature of `test_fused.py` against
the torch path, steps of up to 16 rows through the decode-row GEMM (counted), longer steps
through the library GEMM, greedy decode steps, and the setting's validation."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.models.prefill import greedy_decode, prefill_logits
from tests.models.test_fused import CONFIGS, LLAMA, PROMPTS, make_model, spy_on
from unified_attn.models import fused as fused_module


@pytest.fixture
def skinny_calls(monkeypatch) -> Counter:
    """Turns the decode-row GEMM on; counts its launches."""
    monkeypatch.setenv("UNIFIED_ATTN_SKINNY_GEMM", "1")
    return spy_on(monkeypatch, [(fused_module, "skinny_linear")], Counter())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_skinny_decoder_matches_the_torch_path(name, skinny_calls):
    torch_model = make_model(CONFIGS[name])
    skinny_model = make_model(CONFIGS[name], fused=True)
    for want, got in zip(prefill_logits(torch_model, PROMPTS),
                         prefill_logits(skinny_model, PROMPTS), strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # q/k/v and o of every attention layer at least (the prompts are one step of 10 rows)
    assert skinny_calls["skinny_linear"] >= 2 * CONFIGS[name].num_layers


def test_every_projection_of_a_llama_layer_takes_it(skinny_calls):
    """q/k/v, o, gate/up and down: four decode-row GEMMs per layer in a step."""
    prefill_logits(make_model(LLAMA, fused=True), PROMPTS)
    assert skinny_calls == Counter(skinny_linear=4 * LLAMA.num_layers)


def test_longer_steps_take_the_library_gemm(skinny_calls):
    prompts = [list(range(1, 21))]  # 20 rows
    want = prefill_logits(make_model(LLAMA), prompts)[0]
    got = prefill_logits(make_model(LLAMA, fused=True), prompts)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not skinny_calls


def test_greedy_decode_steps_match_the_torch_path(skinny_calls):
    want = greedy_decode(make_model(LLAMA), PROMPTS, 6)
    assert greedy_decode(make_model(LLAMA, fused=True), PROMPTS, 6) == want
    assert skinny_calls["skinny_linear"] > 0


def test_float16_stays_within_rounding(skinny_calls):
    want, got = (prefill_logits(make_model(LLAMA, torch.float16, fused=f), PROMPTS)
                 for f in (False, True))  # fmt: skip
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    assert skinny_calls


def test_the_setting_is_on_by_default_and_validated(monkeypatch):
    from unified_attn.models.fused import skinny_by_default

    monkeypatch.delenv("UNIFIED_ATTN_SKINNY_GEMM", raising=False)
    assert skinny_by_default()
    assert make_model(LLAMA, fused=True).model.layers[0].self_attn.skinny
    assert not make_model(LLAMA).model.layers[0].self_attn.skinny  # the torch layers
    monkeypatch.setenv("UNIFIED_ATTN_SKINNY_GEMM", "0")
    model = make_model(LLAMA, fused=True)
    assert not model.model.layers[0].self_attn.skinny
    monkeypatch.setenv("UNIFIED_ATTN_SKINNY_GEMM", "on")
    with pytest.raises(ValueError, match="UNIFIED_ATTN_SKINNY_GEMM='on': expected 0 or 1"):
        make_model(LLAMA, fused=True)


def test_the_row_limit_is_a_setting(skinny_calls, monkeypatch):
    """`UNIFIED_ATTN_SKINNY_GEMM_ROWS` moves the limit: 20 rows take the decode-row GEMM (blocks of
    32 rows) at 32, and stay on the library GEMM at 19; a value out of 1..64 is refused."""
    prompts = [list(range(1, 21))]  # 20 rows
    want = prefill_logits(make_model(LLAMA), prompts)[0]
    monkeypatch.setenv("UNIFIED_ATTN_SKINNY_GEMM_ROWS", "32")
    got = prefill_logits(make_model(LLAMA, fused=True), prompts)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert skinny_calls == Counter(skinny_linear=4 * LLAMA.num_layers)
    monkeypatch.setenv("UNIFIED_ATTN_SKINNY_GEMM_ROWS", "19")
    prefill_logits(make_model(LLAMA, fused=True), prompts)
    assert skinny_calls == Counter(skinny_linear=4 * LLAMA.num_layers)  # no more calls
    for bad in ("0", "65", "all"):
        monkeypatch.setenv("UNIFIED_ATTN_SKINNY_GEMM_ROWS", bad)
        with pytest.raises(ValueError, match=f"UNIFIED_ATTN_SKINNY_GEMM_ROWS='{bad}': expected "
                           "an integer from 1 to 64"):  # fmt: skip
            make_model(LLAMA)


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
