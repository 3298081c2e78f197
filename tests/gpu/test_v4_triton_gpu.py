"""DeepSeek-V4 on the Triton kernels on CUDA in bf16 (run through the device tool): the preset's
prompt logits on `triton-deepseek-v4` are as close to a float32 run as the reference backends'
bf16 logits are, and the selector picks the Triton backend on CUDA. (float32 equality with the
reference: tests/backends/test_v4_triton.py, also on the GPU.) On an sm90 GPU the Hopper kernel
equals the reference partial attention over the same bf16 / fp16 rows.)"""

from __future__ import annotations

import pytest
import torch

from tests.backends.test_v4_triton import gathered_case, row_sets_case
from tests.gpu.graphs import assert_replay_equals_eager, capture
from tests.models.hf_models import save_hf_model
from tests.models.test_deepseek_v4_hf import make_v4
from unified_attn import LLMEngine, SamplingParams
from unified_attn.backends.deepseek_v4_steps import (
    GatheredRows,
    attend_row_sets,
    partial_attention,
)
from unified_attn.backends.triton import v4_ops
from unified_attn.backends.triton.deepseek_v4_backend import TritonDeepseekV4Backend
from unified_attn.backends.triton.v4_ops import (
    Sm90GatherConfig,
    gathered_attention,
    gathered_attention_sets,
    sm90_eligible,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[(5 * i + 11 * j) % 300 + 3 for j in range(n)] for i, n in enumerate([200, 37, 90])]


def prompt_logits(backend: str | None, dtype: str = "bfloat16") -> torch.Tensor:
    engine = LLMEngine("deepseek-v4-like", backend=backend, device="cuda", dtype=dtype,
                       max_num_batched_tokens=64, kv_cache_memory="512MiB")  # fmt: skip
    if backend is None:
        assert engine.backend_cls is TritonDeepseekV4Backend  # the selector's choice on CUDA
    params = SamplingParams(max_tokens=1, prompt_logits=True)
    return torch.cat([out.prompt_logits.float() for out in engine.generate(PROMPTS, params)])


def assert_as_close_as_the_reference(triton_error: torch.Tensor,
                                     reference_error: torch.Tensor) -> None:  # fmt: skip
    """bf16 logits' distance to float32 on the Triton backend: finite, and about the reference
    backends' own (mean within 1.5x, max within 2x)."""
    print(f"bf16 error: reference max {reference_error.max():.3g} mean "
          f"{reference_error.mean():.3g}; triton max {triton_error.max():.3g} mean "
          f"{triton_error.mean():.3g}")  # fmt: skip
    assert torch.isfinite(triton_error).all()
    assert triton_error.mean() <= 1.5 * reference_error.mean()
    assert triton_error.max() <= 2 * reference_error.max()


def test_bf16_prompt_logits_are_as_close_to_float32_as_the_reference_backends():
    exact = prompt_logits("deepseek-v4-reference", "float32")
    reference_error = (prompt_logits("deepseek-v4-reference") - exact).abs()
    triton_error = (prompt_logits(None) - exact).abs()
    assert_as_close_as_the_reference(triton_error, reference_error)


sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the Hopper kernel needs an sm90 GPU",
)


@sm90
@pytest.mark.parametrize(
    ("heads", "width", "rows", "dtype", "index_dtype", "config"),
    [
        (64, 512, 512, torch.bfloat16, torch.int64, None),  # V4's decode shape, the default
        (64, 512, 512, torch.bfloat16, torch.int64, Sm90GatherConfig(splits=0)),  # auto splits
        (20, 512, 300, torch.bfloat16, torch.int32, Sm90GatherConfig(64, 2, 1, 1)),  # padded heads
        (128, 512, 300, torch.bfloat16, torch.int64, Sm90GatherConfig(32, 3, 3)),  # two groups
        (64, 128, 200, torch.float16, torch.int64, Sm90GatherConfig(32, 4, 2, 1)),
        (16, 256, 70, torch.bfloat16, torch.int64, Sm90GatherConfig(64, 2, 0)),
        # two programs per token (half the outputs each)
        (64, 512, 512, torch.bfloat16, torch.int64, Sm90GatherConfig(64, 2, 1, 2)),
        (20, 512, 300, torch.bfloat16, torch.int32, Sm90GatherConfig(64, 2, 2, 2)),
        (128, 256, 200, torch.float16, torch.int64, Sm90GatherConfig(64, 3, 1, 2)),
        (64, 128, 200, torch.float16, torch.int64, Sm90GatherConfig(64, 4, 1, 2)),
        (64, 512, 40, torch.bfloat16, torch.int64, Sm90GatherConfig(32, 4, 1, 2)),
    ],
)
def test_the_hopper_kernel_matches_the_reference_partial(heads, width, rows, dtype, index_dtype,
                                                         config):  # fmt: skip
    tokens = 6
    q, cache, blocks, offsets, valid = gathered_case(1, tokens, heads, width, 40, 16, rows, dtype)
    valid[4, 64:] = False  # whole tiles (and splits) hidden
    args = [t.cuda() for t in (q, cache, blocks.to(index_dtype), offsets.to(index_dtype))]
    assert sm90_eligible(args[0], args[1], args[0])
    out, lse = torch.empty_like(args[0]), torch.empty(tokens, heads, device="cuda")
    gathered_attention(*args, valid.cuda(), width**-0.5, out, lse, config)
    want_out, want_lse = torch.empty(tokens, heads, width), torch.empty(tokens, heads)
    partial_attention(q.float(), cache.float()[blocks, offsets], valid, width**-0.5, want_out,
                      want_lse)  # fmt: skip
    torch.testing.assert_close(out.cpu().float(), want_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-3, atol=1e-3)
    assert lse[2].isneginf().all() and (out[2] == 0).all()


@sm90
def test_a_hopper_configuration_beyond_shared_memory_is_refused_with_the_reason():
    q, cache, blocks, offsets, valid = gathered_case(1, 3, 64, 512, 40, 16, 64, torch.bfloat16)
    out, lse = torch.empty_like(q).cuda(), torch.empty(3, 64, device="cuda")
    with pytest.raises(ValueError, match=r"bytes of shared memory .* use fewer stages"):
        gathered_attention(q.cuda(), cache.cuda(), blocks.cuda(), offsets.cuda(), valid.cuda(),
                           0.1, out, lse, Sm90GatherConfig(64, 3))  # fmt: skip


def sets_on_gpu(row_sets: list[GatheredRows]) -> list[GatheredRows]:
    return [GatheredRows(*(t.cuda() for t in (r.cache, r.blocks, r.offsets, r.visible)))
            for r in row_sets]  # fmt: skip


@sm90
@pytest.mark.parametrize(
    ("tokens", "heads", "width", "rows", "dtype"),
    [
        (6, 64, 512, (128, 512), torch.bfloat16),  # V4's decode lists, two programs per token
        (6, 64, 512, (128,), torch.bfloat16),  # a sliding-only layer: one set
        (80, 64, 512, (128, 200), torch.bfloat16),  # one program per token (2 x 80 > the SMs)
        (6, 20, 512, (100, 70), torch.bfloat16),  # padded heads; lists end inside a tile
        (6, 128, 256, (64, 130), torch.float16),  # two head groups
        (6, 64, 128, (0, 90), torch.float16),  # an empty first list
    ],
)
def test_the_layer_attention_is_one_launch_equal_to_the_reference(tokens, heads, width, rows,
                                                                   dtype, monkeypatch):  # fmt: skip
    q, row_sets = row_sets_case(5, tokens, heads, width, dtype, rows + (1,) * (2 - len(rows)))
    row_sets = row_sets[: len(rows)]
    row_sets[0].visible[4, 64:] = False  # whole tiles hidden
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(2)) * 3
    sinks[0], sinks[1] = 40.0, -40.0  # a sink that takes (almost) all the mass, one that none
    monkeypatch.setattr(v4_ops, "gathered_attention", None)  # the per-set path would fail
    gpu_sets, out = sets_on_gpu(row_sets), torch.empty_like(q).cuda()
    gathered_attention_sets(q.cuda(), gpu_sets, width**-0.5, sinks.cuda(), out)
    want = torch.empty(tokens, heads, width)
    attend_row_sets(q.float(), [GatheredRows(r.cache.float(), r.blocks, r.offsets, r.visible)
                                for r in row_sets], width**-0.5, sinks, want)  # fmt: skip
    torch.testing.assert_close(out.cpu().float(), want, rtol=2e-2, atol=2e-2)
    assert (out[2] == 0).all()  # token 2 sees no row: only the sink


@sm90
def test_the_one_launch_stops_the_second_list_at_each_tokens_length(monkeypatch):
    # A CUDA-graph step pads an HCA layer's entries to max_model_len's: each token sees a
    # prefix of its list (none, part of a tile, several tiles, all), the launch walks no tile
    # past it, and the result is the reference's for every length.
    q, row_sets = row_sets_case(7, 6, 64, 512, torch.bfloat16, (128, 520))
    entries = row_sets[1]
    lengths = torch.tensor([0, 5, 64, 130, 520, 300])
    entries.visible[:] &= torch.arange(520) < lengths[:, None]  # (the stale NaN row stays hidden)
    sinks = torch.randn(64, generator=torch.Generator().manual_seed(3))
    want = torch.empty(6, 64, 512)
    attend_row_sets(q.float(), [GatheredRows(r.cache.float(), r.blocks, r.offsets, r.visible)
                                for r in row_sets], 512**-0.5, sinks, want)  # fmt: skip
    monkeypatch.setattr(v4_ops, "gathered_attention", None)  # the per-set path would fail
    gpu = sets_on_gpu(row_sets)
    gpu[1] = GatheredRows(gpu[1].cache, gpu[1].blocks, gpu[1].offsets, gpu[1].visible,
                          lengths.cuda())  # fmt: skip
    out = torch.empty_like(q).cuda()
    gathered_attention_sets(q.cuda(), gpu, 512**-0.5, sinks.cuda(), out)
    torch.testing.assert_close(out.cpu().float(), want, rtol=2e-2, atol=2e-2)


@sm90
def test_the_one_launch_layer_attention_replays_in_a_cuda_graph():
    q, row_sets = row_sets_case(6, 8, 64, 512, torch.bfloat16, (128, 512))
    q, gpu_sets, out = q.cuda(), sets_on_gpu(row_sets), torch.empty_like(q).cuda()
    sinks = torch.randn(64, device="cuda")

    def step() -> None:
        gathered_attention_sets(q, gpu_sets, 512**-0.5, sinks, out)

    assert_replay_equals_eager(capture(step), step, out, "the layer attention over two sets")


@sm90
def test_an_engine_with_128_wide_heads_runs_each_layer_attention_in_one_launch(
    tmp_path, monkeypatch
):
    # head_dim 128 is a width the Hopper kernel serves: every layer's attention (window rows,
    # compressed rows, sinks) is one launch; the per-set path would fail here.
    path = str(save_hf_model(make_v4(head_dim=128, partial_rotary_factor=0.125), tmp_path))
    prompts = [[(7 * i + 3 * j) % 120 + 3 for j in range(n)] for i, n in enumerate([70, 9, 33])]
    params = SamplingParams(max_tokens=1, prompt_logits=True)

    def logits(backend: str, dtype: str) -> torch.Tensor:
        engine = LLMEngine(path, backend=backend, device="cuda", dtype=dtype, block_size=8,
                           max_num_batched_tokens=32, kv_cache_memory="64MiB")  # fmt: skip
        return torch.cat([o.prompt_logits.float() for o in engine.generate(prompts, params)])

    exact = logits("deepseek-v4-reference", "float32")
    reference_error = (logits("deepseek-v4-reference", "bfloat16") - exact).abs()
    monkeypatch.setattr(v4_ops, "merge_partials", None)
    triton_error = (logits("triton-deepseek-v4", "bfloat16") - exact).abs()
    assert_as_close_as_the_reference(triton_error, reference_error)
