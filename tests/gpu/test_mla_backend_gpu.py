"""`TritonMLABackend` on a GPU: the `deepseek-v3-like` preset's tokens and logits against the MLA
reference backend (bf16 within its rounding, float32 identical tokens), decode steps replayed
from CUDA graphs."""

from __future__ import annotations

import attrs
import pytest
import torch

from unified_attn import LLMEngine, SamplingParams
from unified_attn.backends.triton.mla_plan import HOPPER_TILES
from unified_attn.models.presets import MLA_PRESETS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)

PROMPTS = [[5 + i % 7, 9, 11 + i] * (4 + i) for i in range(6)]


def run(backend: str, dtype: str, **options):
    engine = LLMEngine("deepseek-v3-like", device="cuda", dtype=dtype, backend=backend,
                       kv_cache_memory="256MiB", **options)  # fmt: skip
    params = SamplingParams(max_tokens=16, ignore_eos=True, return_logits=True)
    return engine, engine.generate(PROMPTS, params)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-3), ("bfloat16", 0.15)])
def test_triton_equals_the_reference(dtype, tolerance, kv_cache_dtype):
    # kv_cache_dtype="fp8": the portable kernel dequantizes the e4m3 latents in registers
    # (float16 dots for bf16 queries); each backend calibrates its layers' scales from the same
    # first prefill.
    _, want = run("mla-reference", dtype, cuda_graphs=False, kv_cache_dtype=kv_cache_dtype)
    engine, got = run("triton-mla", dtype, kv_cache_dtype=kv_cache_dtype)
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    for _, backend in engine.model.attention_layers():
        assert (backend.kv_scales is not None) == (kv_cache_dtype == "fp8")
    for a, b in zip(got, want, strict=True):
        if dtype == "float32":
            assert a.output_token_ids == b.output_token_ids
        # compare the logits of the tokens both runs share (bf16 may pick another argmax)
        same = next((i for i, (x, y) in enumerate(zip(a.output_token_ids, b.output_token_ids,
                                                      strict=True)) if x != y), 16)  # fmt: skip
        # (a random tiny model has near-ties: in bf16 the greedy paths part after a few tokens,
        # 70% of the tokens shared on an H200. The rows before the parting are compared: at the
        # parting row itself a near-tie of the router can choose another expert, which moves
        # that row's logits by more than rounding, 0.2 on an H100)
        assert (a.logits[:same] - b.logits[:same]).abs().max() < tolerance


@pytest.mark.skipif(not SM90, reason="the Hopper kernels need an sm90 GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_sixty_four_heads_run_a_hopper_kernel_in_graphs(monkeypatch, kv_cache_dtype):
    """64 heads and a 128 + 16 latent: `triton-mla`'s preferred block size (64) gives pages the
    warp-specialized Hopper kernel takes (the fp8 Hopper kernel over an fp8 cache); decode
    steps replay CUDA graphs; the tokens' logits equal the reference backend's within bf16
    rounding."""
    wide = attrs.evolve(MLA_PRESETS["deepseek-v3-like"], name="mla-64-heads", num_heads=64,
                        kv_lora_rank=128)  # fmt: skip
    monkeypatch.setitem(MLA_PRESETS, "mla-64-heads", wide)
    params = SamplingParams(max_tokens=16, ignore_eos=True, return_logits=True)
    outputs = {}
    for backend in ("mla-reference", "triton-mla"):
        graphs = backend == "triton-mla"
        engine = LLMEngine("mla-64-heads", device="cuda", dtype="bfloat16", backend=backend,
                           kv_cache_memory="256MiB", cuda_graphs=graphs,
                           kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        outputs[backend] = engine.generate(PROMPTS, params)
    assert engine.kv_cache_report.block_size == 64
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    mla = next(b for _, b in engine.worker.model.attention_layers() if b.name == "triton-mla")
    assert mla.current_plan().launch.tiles == HOPPER_TILES
    assert (mla.kv_scales is not None) == (kv_cache_dtype == "fp8")
    for a, b in zip(outputs["triton-mla"], outputs["mla-reference"], strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a.output_token_ids, b.output_token_ids,
                                                      strict=True)) if x != y), 16)  # fmt: skip
        assert (a.logits[: same + 1] - b.logits[: same + 1]).abs().max() < 0.15

