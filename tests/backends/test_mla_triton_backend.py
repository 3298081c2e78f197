"""`TritonMLABackend` (the MLA kernels of `mla_ops` behind the reference MLA backend's seams) on
the CPU interpreter: a DeepSeek-V3 checkpoint through the engine gives transformers' greedy
tokens and logits (float32), with chunked prefill and decode in the same steps; what the kernel
cannot serve is refused with reasons."""

from __future__ import annotations

import pytest
import torch

from tests.models.hf_models import save_hf_model
from tests.models.test_deepseek_hf import check_tokens, make_deepseek, prompts
from unified_attn import LLMEngine, SamplingParams
from unified_attn.backends.triton.mla_backend import TritonMLABackend
from unified_attn.selector import SelectorConfig

NUM_TOKENS = 6


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    hf = make_deepseek("v3")
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("v3"))


def test_engine_matches_transformers(v3):
    hf, path = v3
    # 7-token chunks: prefill rows of one request share steps with other requests' decodes
    engine = LLMEngine(str(path), backend="triton-mla", kv_cache_memory="1MiB",
                       max_num_batched_tokens=7, block_size=16, max_model_len=64)  # fmt: skip
    assert engine.backend_cls is TritonMLABackend
    batch = prompts([9, 3, 12])
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, return_logits=True)
    for prompt, out in zip(batch, engine.generate(batch, params), strict=True):
        full = check_tokens(hf, prompt, out.output_token_ids)
        sampled = full[len(prompt) - 1 : len(prompt) - 1 + NUM_TOKENS]
        assert (out.logits - sampled).abs().max() < 1e-4


def test_an_fp8_latent_cache_gives_the_reference_backends_logits(v3):
    # Both backends calibrate each layer's scale from the same first prefill (equal up to the
    # float32 rounding of the layers before), write the latents as e4m3 and attend over the
    # dequantized latents (the kernel converts them to the dot dtype and folds the scale into
    # the softmax scale and the output).
    _, path = v3
    batch = prompts([9, 3, 12])
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, return_logits=True,
                            prompt_logits=True)  # fmt: skip
    runs = {}
    for backend in ("triton-mla", "mla-reference"):
        engine = LLMEngine(str(path), backend=backend, kv_cache_dtype="fp8", block_size=16,
                           kv_cache_memory="1MiB", max_num_batched_tokens=7,
                           max_model_len=64)  # fmt: skip
        outs = engine.generate(batch, params)
        scales = {name: backend.kv_scales.tensors[name].tolist()
                  for name, backend in ((layer.name, b) for layer, b in
                                        engine.model.attention_layers())}  # fmt: skip
        kv = {b.kv_cache_dtype for _, b in engine.model.attention_layers()}
        runs[backend] = (outs, scales, kv)
    (triton_outs, triton_scales, kv), (ref_outs, ref_scales, _) = runs.values()
    assert kv == {torch.float8_e4m3fn} and triton_scales.keys() == ref_scales.keys()
    for name, scale in triton_scales.items():  # layer 0's equal; later ones see their inputs
        assert scale == pytest.approx(ref_scales[name], rel=1e-6)  # through float32 rounding
    assert all(s != [1.0, 1.0] for s in triton_scales.values())  # calibrated
    for got, want in zip(triton_outs, ref_outs, strict=True):
        assert got.output_token_ids == want.output_token_ids
        assert (got.prompt_logits - want.prompt_logits).abs().max() < 1e-4
        assert (got.logits - want.logits).abs().max() < 1e-4


@pytest.mark.parametrize(
    "options, reason",
    [
        (dict(sliding_window=64), "sliding windows are not supported"),
        (dict(use_batch_invariant=True), "batch invariance is not supported"),
        (dict(kv_cache_dtype="float16"), "KV-cache dtype float16 must equal the model dtype"),
        (dict(dtype=torch.float64), "dtype torch.float64 is not one of"),
    ],
)
def test_what_the_kernel_cannot_serve_is_refused(options, reason):
    cfg = SelectorConfig(
        **{"head_size": 48, "dtype": torch.float32, "layer_kind": "mla", **options}
    )
    assert any(reason in r for r in TritonMLABackend.validate_configuration(cfg))


def test_latent_widths_the_kernel_cannot_tile_are_refused():
    with pytest.raises(ValueError, match="kv_lora_rank=24 and qk_rope_head_dim=16 must be"):
        TritonMLABackend(head_size=40, dtype=torch.float32, kv_lora_rank=24)
