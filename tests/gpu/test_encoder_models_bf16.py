"""BART and BERT through the Triton backend in bfloat16 on CUDA against transformers.

The yardstick is transformers itself: our bf16 error against transformers' float32 model must
stay within twice transformers' own bf16 error (plus 0.01), token by token along the generated
sequence (teacher forcing), and greedy tokens must equal float32 greedy wherever float32's
top-2 margin exceeds that tolerance. Run on the H100 through the device tool."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.models.hf_encoder_models import make_hf_bart, make_hf_bert, save_hf_model
from unified_attn import LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_TOKENS = 16


def tolerance(ours: torch.Tensor, hf32: torch.Tensor, hf16: torch.Tensor) -> tuple[float, float]:
    """(our max error, the allowed max error) against transformers' float32 result."""
    ours_err = (ours.float() - hf32).abs().max().item()
    hf_err = (hf16.float() - hf32).abs().max().item()
    return ours_err, 2 * hf_err + 1e-2


def test_bart_bf16_triton_tracks_transformers(tmp_path):
    hf32 = make_hf_bart(seed=3, d_model=256, encoder_attention_heads=4,
                        decoder_attention_heads=4, max_position_embeddings=1600)  # fmt: skip
    path = save_hf_model(hf32, tmp_path)
    hf32 = hf32.cuda()
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    engine = LLMEngine(str(path), backend="triton", device="cuda", dtype="bfloat16",
                       kv_cache_memory="256MiB", max_num_batched_tokens=64)  # fmt: skip
    prompts = [
        {"encoder_prompt_token_ids": [(7 * j) % 120 + 3 for j in range(n)], "prompt_token_ids": p}
        for n, p in ((1200, [2, 0, 7]), (40, [2]), (300, [2, 0, *range(5, 90)]))
    ]  # the last decoder prompt (87 tokens) is prefilled in chunks
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            return_logits=True)  # fmt: skip
    outputs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        dec = prompt["prompt_token_ids"] + out.output_token_ids
        enc = torch.tensor([prompt["encoder_prompt_token_ids"]], device="cuda")
        ids = torch.tensor([dec[:-1]], device="cuda")
        start = len(prompt["prompt_token_ids"]) - 1
        with torch.no_grad():
            ref32 = hf32(input_ids=enc, decoder_input_ids=ids).logits[0, start:].float()
            ref16 = hf16(input_ids=enc, decoder_input_ids=ids).logits[0, start:]
        err, allowed = tolerance(out.logits.cuda(), ref32, ref16)
        print(f"BART encoder {enc.shape[1]}: logits error {err:.4f} (allowed {allowed:.4f})")
        assert err <= allowed
        top2 = ref32.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > allowed
        greedy = torch.tensor(out.output_token_ids, device="cuda")
        assert torch.equal(greedy[sure], ref32.argmax(-1)[sure])


def test_bert_bf16_triton_tracks_transformers(tmp_path):
    hf32 = make_hf_bert(seed=1, hidden_size=256, num_attention_heads=4,
                        max_position_embeddings=1600)  # fmt: skip
    path = save_hf_model(hf32, tmp_path)
    hf32 = hf32.cuda()
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    engine = LLMEngine(str(path), backend="triton", device="cuda", dtype="bfloat16",
                       max_num_batched_tokens=4096)  # fmt: skip
    prompts = [[(5 * j) % 120 + 3 for j in range(n)] for n in (1500, 7, 1, 300)]
    for prompt, out in zip(prompts, engine.encode(prompts), strict=True):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            ref32 = hf32(input_ids=ids).last_hidden_state[0]
            ref16 = hf16(input_ids=ids).last_hidden_state[0]
        err, allowed = tolerance(out.hidden_states.cuda(), ref32, ref16)
        print(f"BERT length {len(prompt)}: hidden error {err:.4f} (allowed {allowed:.4f})")
        assert err <= allowed
