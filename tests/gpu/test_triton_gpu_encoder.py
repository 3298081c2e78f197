"""GPU checks of the Triton backend's encoder, encoder-only and cross-attention layers: the
checks of `tests/backends/test_triton_encoder.py` in bfloat16 and float16 with long encoders,
and BERT / BART engines on Triton against the reference backend."""

import pytest
import torch

from tests.backends.test_triton_encoder import (
    CROSS,
    ENCODER_TYPES,
    check_cross,
    check_encoder,
    layer_of,
    make_cross_case,
)
from unified_attn import LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = [torch.bfloat16, torch.float16]
HEADS = [(16, 16, 64), (32, 8, 128)]  # (Hq, Hkv, D): BART-like MHA, GQA with wide heads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("attn_type", ENCODER_TYPES)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_long_encoder_batches_match_sdpa_and_the_reference(dtype, attn_type, hq, hkv, d):
    lengths = [1, 300, 1500, 77]
    check_encoder(attn_type, lengths, hq, hkv, d, dtype, fused=True, device="cuda")
    check_encoder(attn_type, lengths[::-1], hq, hkv, d, dtype, fused=False, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_cross_attention_over_long_encoders(dtype, hq, hkv, d, batch_invariant):
    layer = layer_of(CROSS, hq, hkv, d)
    case = make_cross_case(layer, [1500, 600, 1200, 1], block_size=16, dtype=dtype, device="cuda")
    # step 1 writes the encoders of requests 1-3 while all four have queries (request 1's
    # chunk of 900 is longer than its 600 encoder keys); step 2 decodes with nothing written
    steps = [
        ([5, 0, 0, 0], [1, 900, 37, 3], [1, 2, 3]),
        ([6, 900, 37, 3], [1, 1, 1, 1], []),
    ]
    plans = check_cross(case, steps, max_encoder_len=1536, batch_invariant=batch_invariant)
    # a decode step over 1500 keys under-fills the GPU: split-KV, unless batch invariant
    assert (plans[1].split is None) == batch_invariant


def bart_engine(path, backend):
    return LLMEngine(str(path), backend=backend, device="cuda", dtype="float32",
                     kv_cache_memory="256MiB", max_num_batched_tokens=2048)  # fmt: skip


def test_bart_on_triton_matches_the_reference_backend(tmp_path):
    from tests.models.hf_encoder_models import make_hf_bart, save_hf_model

    hf = make_hf_bart(seed=3, d_model=256, encoder_attention_heads=4, decoder_attention_heads=4,
                      max_position_embeddings=1600)  # fmt: skip
    path = save_hf_model(hf, tmp_path)
    prompts = [
        {"encoder_prompt_token_ids": [(7 * j) % 120 + 3 for j in range(n)], "prompt_token_ids": p}
        for n, p in ((1500, [2, 0, 7]), (40, [2]), (300, [2, 0, 5, 9, 11, 4, 8, 13, 21]))
    ]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, return_logits=True)
    outputs = {b: bart_engine(path, b).generate(prompts, params) for b in ("triton", "reference")}
    for a, b in zip(outputs["triton"], outputs["reference"], strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert (a.logits - b.logits).abs().max() < 1e-3


def test_bert_on_triton_matches_the_reference_backend(tmp_path):
    from tests.models.hf_encoder_models import make_hf_bert, save_hf_model

    hf = make_hf_bert(seed=1, hidden_size=256, num_attention_heads=4,
                      max_position_embeddings=1600)  # fmt: skip
    path = save_hf_model(hf, tmp_path)
    prompts = [[(5 * j) % 120 + 3 for j in range(n)] for n in (1500, 7, 1, 300)]
    options = dict(device="cuda", dtype="float32", max_num_batched_tokens=4096)
    outputs = {
        b: LLMEngine(str(path), backend=b, **options).encode(prompts)
        for b in ("triton", "reference")
    }
    for a, b in zip(outputs["triton"], outputs["reference"], strict=True):
        assert (a.hidden_states - b.hidden_states).abs().max() < 1e-3
