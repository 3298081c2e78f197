"""Batch-invariant mode on CUDA, bf16 (run through the device tool): the Triton ops, then every
preset, two bench-size models (a 1.2B Llama and a ~1.1B GPT-OSS-shaped MoE) and a tiny random
checkpoint of every Hugging Face family (tests/models/hf_models.FAMILIES) end to end. One
request's prompt logits and 8 generated-token logits must be bitwise the same alone, inside
batches of 8, 64 and 256 mixed requests, under two chunked-prefill budgets, and after a
prefix-cache hit. The engine picks its backends as a user's would (Triton attention, CUDA
graphs for decode steps)."""

from __future__ import annotations

import functools
import gc
import tempfile
from pathlib import Path

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.models.hf_models import FAMILIES, make_family_model, save_hf_model
from unified_attn import LLMEngine, SamplingParams
from unified_attn.kernels.invariant import invariant_launch as triton_ops
from unified_attn.models import PRESETS, LayerKind, MoEConfig, get_preset
from unified_attn.models.invariant.model import make_batch_invariant
from unified_attn.models.moe import Experts, RoutedExperts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BENCH_LLAMA = attrs.evolve(
    get_preset("tiny-llama"), name="bench-llama-1b", vocab_size=32000, hidden_size=2048,
    intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, head_size=64,
    max_position_embeddings=4096, layer_kinds=(LayerKind.full(),) * 16,
)  # fmt: skip
BENCH_MOE = attrs.evolve(
    get_preset("gpt-oss-like"), name="bench-moe-1b", vocab_size=32000, hidden_size=2048,
    intermediate_size=1024, num_layers=16, num_heads=32, num_kv_heads=8, head_size=64,
    moe=MoEConfig(num_experts=8, top_k=2), max_position_embeddings=4096,
    layer_kinds=(LayerKind.sliding(128, has_sinks=True), LayerKind.full(has_sinks=True)) * 8,
)  # fmt: skip
BENCH = {c.name: c for c in (BENCH_LLAMA, BENCH_MOE)}


@pytest.fixture(scope="module", autouse=True)
def bench_presets():
    PRESETS.update(BENCH)
    yield
    for name in BENCH:
        PRESETS.pop(name, None)


@pytest.fixture(autouse=True)
def free_engines():
    """Each bench-size engine holds its weights and an 8 GiB cache: release them between
    tests."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


# ---- ops -------------------------------------------------------------------------------------

SHAPES = [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192), (32000, 2048), (77, 100)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_triton_matmul_rows_do_not_depend_on_the_batch(n, k, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(n, k, device="cuda", generator=gen).to(dtype) * k**-0.5
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype)
    x = torch.randn(4096, k, device="cuda", generator=gen).to(dtype)
    alone = triton_ops.matmul(x[:1], weight.t(), bias)[0]
    for m in [*range(1, 301), 512, 1000, 1023, 1024, 4096]:
        assert torch.equal(triton_ops.matmul(x[:m], weight.t(), bias)[0], alone), m
        if m > 1:
            moved = torch.cat([x[1:m], x[:1]])  # the row last, behind m - 1 others
            assert torch.equal(triton_ops.matmul(moved, weight.t(), bias)[-1], alone), m
    want = F.linear(x[:256].double(), weight.double(), bias.double())
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    torch.testing.assert_close(triton_ops.matmul(x[:256], weight.t(), bias).double(), want,
                               rtol=tol, atol=tol)  # fmt: skip


ROW_OPS = {
    "rms_norm": lambda x, w: triton_ops.rms_norm(x, w, 1e-6, "llama"),
    "l2_normalize": lambda x, w: triton_ops.l2_normalize(x, 1e-12),
    "softmax": lambda x, w: triton_ops.softmax(x, dtype=torch.float32),
    "log_softmax": lambda x, w: triton_ops.softmax(x, log=True, dtype=torch.float32),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [64, 2048, 32000])
@pytest.mark.parametrize("name", list(ROW_OPS))
def test_triton_row_ops_do_not_depend_on_the_batch(name, n, dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1024, n, device="cuda", generator=gen).to(dtype)
    w = torch.randn(n, device="cuda", generator=gen).to(dtype)
    op = ROW_OPS[name]
    alone = op(x[:1], w)[0]
    for m in [*range(1, 301), 1024]:
        assert torch.equal(op(x[:m], w)[0], alone), m
        assert torch.equal(op(torch.cat([x[1:m], x[:1]]), w)[-1], alone), m


def _moe_case(gpt_oss: bool, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:  # fmt: skip
    """DeepSeek-like SwiGLU experts (64 of 2048 x 1408, 6 chosen) or GPT-OSS-like ones (32 of
    1024 x 512, interleaved, biases, 4 chosen), with 4096 tokens' routing."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    num, k, hidden, inter = (32, 4, 1024, 512) if gpt_oss else (64, 6, 2048, 1408)
    if gpt_oss:
        experts: nn.Module = Experts(hidden, inter, MoEConfig(num_experts=num, top_k=k))
    else:
        experts = RoutedExperts(num, hidden, inter, None)
    experts = experts.to("cuda", dtype)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0.0, hidden**-0.5, generator=gen)
    x = torch.randn(4096, hidden, device="cuda", generator=gen).to(dtype)
    ids = torch.rand(4096, num, device="cuda", generator=gen).argsort(dim=1)[:, :k]
    weights = torch.rand(4096, k, device="cuda", generator=gen).softmax(dim=1)
    return experts, x, weights, ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["row-blocks", "gpt-oss"])
def test_grouped_experts_rows_do_not_depend_on_the_batch(gpt_oss, dtype):
    # The mode's experts (the grouped kernels with one tile configuration): a token's output is
    # the same alone, first or last in batches from decode to prefill sizes (past the size at
    # which the default configuration changes tiles four times).
    experts, x, weights, ids = _moe_case(gpt_oss, dtype)
    make_batch_invariant(experts)
    with torch.no_grad():
        alone = experts(x[:1], weights[:1], ids[:1])[0]
        for m in [*range(2, 80), 100, 257, 512, 1000, 4096]:
            assert torch.equal(experts(x[:m], weights[:m], ids[:m])[0], alone), m
            moved = [torch.cat([t[1:m], t[:1]]) for t in (x, weights, ids)]
            assert torch.equal(experts(*moved)[-1], alone), m
        plain = type(experts).__mro__[1].forward(experts, x[:300], weights[:300], ids[:300])
        got = experts(x[:300], weights[:300], ids[:300])
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    torch.testing.assert_close(got.float(), plain.float(), rtol=tol, atol=tol)


# ---- engines ---------------------------------------------------------------------------------


@attrs.frozen
class Case:
    """The target request and its surroundings for one model."""

    prompt_len: int
    budgets: tuple[int, int]  # two chunked-prefill budgets that split the prompt differently
    vocab: int
    memory: str


# 150 + 8 tokens: longer than every preset's window (64, 128) and chunk (64)
TINY = Case(prompt_len=150, budgets=(16, 40), vocab=250, memory="512MiB")
LARGE = Case(prompt_len=300, budgets=(128, 200), vocab=31000, memory="8GiB")
HF = Case(prompt_len=45, budgets=(16, 37), vocab=124, memory="512MiB")  # vocabulary 128
HF_PREFIX = "hf-"
CHECKPOINTS = tempfile.TemporaryDirectory(prefix="bi-gpu-hf-")


def case_of(preset: str) -> Case:
    if preset.startswith(HF_PREFIX):
        return HF
    return LARGE if preset in BENCH else TINY


@functools.cache
def model_of(preset: str) -> str:
    """A preset's name, or the path of an HF family's tiny random checkpoint (saved once)."""
    if not preset.startswith(HF_PREFIX):
        return preset
    family = preset.removeprefix(HF_PREFIX)
    return str(save_hf_model(make_family_model(family), Path(CHECKPOINTS.name) / family))


def target(case: Case) -> list[int]:
    return [(99 * 31 + j * 7) % case.vocab + 1 for j in range(case.prompt_len)]


def make_engine(preset: str, budget: int = 2048, max_num_seqs: int = 16) -> LLMEngine:
    """Engines of different `max_num_seqs` capture different decode graph sizes: the target's
    decode rows are padded to other batch sizes from one engine to the next."""
    return LLMEngine(
        model_of(preset), device="cuda", batch_invariant=True, max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs, block_size=16, kv_cache_memory=case_of(preset).memory,
    )  # fmt: skip


def companions(case: Case, count: int, seed: int):
    """Prompts of 3 .. 2 * prompt_len tokens generating 1-12 tokens each."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 2 * case.prompt_len, (count,), generator=gen).tolist()
    prompts = [torch.randint(1, case.vocab, (n,), generator=gen).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True)
              for m in torch.randint(1, 13, (count,), generator=gen)]  # fmt: skip
    return prompts, params


def target_logits(engine: LLMEngine, preset: str, others: int = 0, seed: int = 0, **params):
    case = case_of(preset)
    prompts, companion_params = companions(case, others, seed)
    wanted = SamplingParams(
        **{"max_tokens": 8, "ignore_eos": True, "prompt_logits": True, "return_logits": True,
           **params}
    )  # fmt: skip
    out = engine.generate([target(case), *prompts], [wanted, *companion_params])[0]
    return out.prompt_logits, out.logits


@functools.cache
def alone(preset: str):
    return target_logits(make_engine(preset), preset)


def assert_same(got, want) -> None:
    (got_prompt, got_generated), (want_prompt, want_generated) = got, want
    if got_prompt is not None:
        assert torch.equal(got_prompt, want_prompt), "prompt logits differ"
    assert torch.equal(got_generated, want_generated), "generated-token logits differ"


ALL = [*sorted(PRESETS), *BENCH, *(HF_PREFIX + family for family in sorted(FAMILIES))]


@pytest.mark.parametrize("preset", ALL)
def test_logits_alone_equal_logits_in_batches_of_8_64_and_256(preset):
    engine = make_engine(preset, max_num_seqs=256)
    for size in (8, 64, 256):
        assert_same(target_logits(engine, preset, others=size - 1, seed=size), alone(preset))
    assert engine.runner.graphs is None or engine.runner.graphs.num_replays > 0


@pytest.mark.parametrize("preset", ALL)
def test_prompt_chunking_and_prefix_hits_keep_the_logits(preset):
    want = alone(preset)
    first, second = case_of(preset).budgets
    engine = make_engine(preset, first)
    assert_same(target_logits(engine, preset), want)
    hits = engine.kv_cache_manager.prefix_cache_stats.hits
    hit = target_logits(engine, preset, prompt_logits=False)
    assert engine.kv_cache_manager.prefix_cache_stats.hits > hits
    assert_same(hit, want)
    assert_same(target_logits(make_engine(preset, second), preset, others=7, seed=3), want)
