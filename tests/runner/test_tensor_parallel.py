"""Tensor parallelism on CPU (gloo, one process per rank): greedy tokens equal one device in
float32, every rank sizes its own cache and all use the minimum, a dead rank is reported, and
what cannot be split is refused before any process starts."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.backends.test_fp8_engine import LOGITS, prompt_logits, write_checkpoint
from tests.backends.test_fp8_engine import PROMPTS as FP8_PROMPTS
from tests.models.hf_models import make_family_model, make_hf_model, save_hf_model
from tests.models.test_deepseek_hf import make_deepseek
from tests.models.test_deepseek_v4_hf import make_v4
from unified_attn import LLMEngine, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 6, list(range(40, 90)), [3, 4] * 12]
PARAMS = [
    SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=24, ignore_eos=True),
    SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.2),
]
SPEC_PARAMS = [
    SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=7),
    SamplingParams(max_tokens=16, ignore_eos=True),
]


def check_equal_to_one_device(
    model: str, size: int, params: list[SamplingParams] = PARAMS, **options
) -> LLMEngine:
    """Build a `size`-rank engine, check its outputs against one device, return it (shut down)."""
    want = LLMEngine(model, **options).generate(PROMPTS, params)
    engine = LLMEngine(model, tensor_parallel_size=size, **options)
    try:
        got = engine.generate(PROMPTS, params)
    finally:
        engine.shutdown()
    for a, b in zip(got, want, strict=True):
        assert a.output_token_ids == b.output_token_ids, model
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in y)
    return engine


@pytest.mark.parametrize(
    "preset, size",
    [
        ("tiny-hybrid", 2),
        ("mistral-like", 2),
        ("llama4-like", 2),
        ("gemma2-like", 2),
        ("streaming-llm", 2),
        ("gpt-oss-like", 2),
        ("hybrid-linear", 2),
        ("tiny-llama", 4),
        ("deepseek-v3-like", 2),
        ("deepseek-v3-like", 4),
        ("deepseek-v4-like", 2),
    ],
)
def test_ranks_give_the_tokens_of_one_device(preset, size):
    """Full, sliding, chunked and sink layers; soft caps; experts; linear-state layers (split
    by heads); TP=4 with 2 KV heads (replicated); MLA (heads split, the latent replicated)
    with DeepSeekMoE, TP=4 down to one head per rank; DeepSeek-V4's five cache users per layer,
    compressors and indexer replicated, hash and top-k routing."""
    engine = check_equal_to_one_device(preset, size, max_num_batched_tokens=48)
    assert len(engine.rank_num_blocks) == size


CHECKPOINTS = {
    "qwen2": lambda: make_hf_model("qwen2", num_hidden_layers=2),  # q/k/v biases
    "phi3": lambda: make_family_model("phi3"),  # fused qkv and gate-up projections
    # a vocabulary that 2 ranks do not divide: the last rank's rows are padded
    "llama": lambda: make_hf_model("llama", num_hidden_layers=2, vocab_size=301),
    "mistral-window": lambda: make_hf_model("mistral", num_hidden_layers=2, sliding_window=12),
    "gemma2": lambda: make_family_model("gemma2"),  # soft caps, window, Gemma norms
    "gpt-oss": lambda: make_family_model("gpt-oss"),  # sinks, batched experts with biases
    "mixtral": lambda: make_family_model("mixtral"),  # top-2 of 4 SwiGLU experts
    "qwen2-moe": lambda: make_family_model("qwen2-moe"),  # a shared expert, a dense layer
    # MLA with q_lora, YaRN, grouped sigmoid routing; V2: no q_lora, pair RoPE, 2 shared experts
    "deepseek-v3": lambda: make_deepseek("v3"),
    "deepseek-v2": lambda: make_deepseek("v2"),
    "deepseek-v4": make_v4,  # sliding, CSA and HCA layers; sinks; grouped output projection
}


@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_checkpoints_split_by_heads_and_features(family, tmp_path):
    """Transformers checkpoints of every family with attention layers only."""
    path = save_hf_model(CHECKPOINTS[family](), tmp_path / family)
    check_equal_to_one_device(str(path), 2, kv_cache_memory="2MiB")


def test_an_fp8_cache_with_checkpoint_scales_gives_the_tokens_of_one_device(tmp_path):
    """The checkpoint's one K and one V scale per layer reach every rank unsplit, so each rank
    stores its heads' keys and values exactly as one device does."""
    scales = {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(0.01)
              for i in range(2) for kind in "kv"}  # fmt: skip
    path = write_checkpoint(tmp_path / "fp8-scales", scales)
    check_equal_to_one_device(path, 2, kv_cache_dtype="fp8", kv_cache_memory="2MiB")
    # ... and the quantization is visible: one device's fp8 logits differ from its 32-bit ones
    fp8, exact = (prompt_logits(path, kv_cache_dtype=d) for d in ("fp8", "auto"))
    assert (fp8 - exact).abs().max() > 1e-3


def test_an_fp8_latent_cache_gives_the_tokens_of_one_device():
    """MLA's latent is replicated, so every rank calibrates the same scale from the same
    latents as one device."""
    check_equal_to_one_device(
        "deepseek-v3-like", 2, kv_cache_dtype="fp8", max_num_batched_tokens=48
    )


def test_calibrated_fp8_scales_per_rank_keep_the_documented_tolerance():
    """Without checkpoint scales each rank calibrates from its own heads (as vLLM does per rank),
    so its bytes may differ from one device's; the logits keep the fp8 tolerance of
    docs/kv-cache.md against the unquantized single-device run."""
    exact = prompt_logits("tiny-llama")
    engine = LLMEngine("tiny-llama", dtype="float32", kv_cache_memory="16MiB",
                       kv_cache_dtype="fp8", tensor_parallel_size=2)  # fmt: skip
    try:
        fp8 = torch.cat([out.prompt_logits for out in engine.generate(FP8_PROMPTS, LOGITS)])
    finally:
        engine.shutdown()
    largest = exact.abs().max()
    per_token = (fp8 - exact).abs().amax(-1) / largest
    assert (fp8 - exact).abs().mean() / largest <= 0.02 and per_token.max() <= 0.10
    assert (fp8 - exact).abs().max() / largest > 1e-3  # the ranks' caches really are quantized


@pytest.mark.parametrize("preset", ["tiny-llama", "mistral-like", "hybrid-linear"])
def test_ngram_speculative_decoding_gives_the_tokens_of_one_device(preset):
    """Rank 0 proposes and verifies (greedy and rejection-sampled requests); the step messages
    carry the drafts, so every rank runs the same verification rows and appends the accepted
    tokens (and, over state layers, resumes from the same state slot)."""
    options = dict(speculative_method="ngram", num_speculative_tokens=3, max_num_batched_tokens=48)
    engine = check_equal_to_one_device(preset, 2, params=SPEC_PARAMS, **options)
    assert engine.stats.spec_accepted > 0
    assert engine.stats.spec_drafted > engine.stats.spec_accepted or preset == "tiny-llama"


@pytest.mark.parametrize("preset", ["tiny-llama", "mistral-like"])
def test_draft_model_speculative_decoding_gives_the_tokens_of_one_device(preset):
    """The draft model runs whole on rank 0 (it proposes there, as the n-gram method does) and
    takes its share of rank 0's KV budget, so rank 0 has fewer blocks and every rank uses its
    count."""
    options = dict(speculative_method="draft", draft_model="tiny-llama",
                   num_speculative_tokens=3, max_num_batched_tokens=48)  # fmt: skip
    engine = check_equal_to_one_device(preset, 2, params=SPEC_PARAMS, **options)
    assert engine.stats.spec_drafted > 0
    assert engine.stats.spec_accepted > 0 or preset == "mistral-like"
    assert engine.rank_num_blocks[0] < engine.rank_num_blocks[1]


def test_every_rank_sizes_its_cache_and_all_use_the_minimum():
    engine = LLMEngine(
        "tiny-llama", tensor_parallel_size=2, kv_cache_memory=["4MiB", "2MiB"], max_model_len=512
    )
    try:
        first, second = engine.rank_num_blocks
        assert first == 2 * second  # the same shard, half the memory
        assert engine.worker.num_blocks == second == engine.kv_cache_report.num_blocks
        (out,) = engine.generate([PROMPTS[0]], PARAMS[0])
        assert len(out.output_token_ids) == 16
    finally:
        engine.shutdown()
    one = LLMEngine("tiny-llama", kv_cache_memory="4MiB", max_model_len=512)
    assert first == 2 * one.worker.num_blocks  # a rank holds half the KV heads


def test_a_step_message_larger_than_the_fixed_broadcast_takes_a_second_one(monkeypatch):
    """Six new 1,500-token prompts scheduled in one step encode to more than `MESSAGE_BYTES`."""
    from unified_attn.distributed import tp_group as tensor_parallel
    from unified_attn.distributed.tp_codec import encode
    from unified_attn.distributed.tp_messages import MESSAGE_BYTES

    sizes = []
    monkeypatch.setattr(
        tensor_parallel, "encode", lambda m: sizes.append(len(encode(m))) or encode(m)
    )
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(1500)] for i in range(6)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    options = dict(max_model_len=2048, max_num_batched_tokens=9000, kv_cache_memory="32MiB")
    want = LLMEngine("tiny-llama", **options).generate(prompts, params)
    engine = LLMEngine("tiny-llama", tensor_parallel_size=2, **options)
    try:
        got = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    assert max(sizes) > MESSAGE_BYTES > min(sizes)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]


def test_an_idle_engine_keeps_its_ranks_past_the_collective_timeout(monkeypatch):
    """The other ranks wait for rank 0's next step however long the engine sits idle (here
    longer than the 6 s collective timeout the spawned ranks inherit)."""
    monkeypatch.setenv("UNIFIED_ATTN_TP_TIMEOUT_S", "6")
    want = LLMEngine("tiny-llama").generate([PROMPTS[0]], PARAMS[0])
    engine = LLMEngine("tiny-llama", tensor_parallel_size=2)
    try:
        time.sleep(8)
        got = engine.generate([PROMPTS[0]], PARAMS[0])
    finally:
        engine.shutdown()
    assert got[0].output_token_ids == want[0].output_token_ids


def test_a_bad_collective_timeout_is_refused_before_any_process_starts(monkeypatch):
    monkeypatch.setenv("UNIFIED_ATTN_TP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="UNIFIED_ATTN_TP_TIMEOUT_S='soon': expected a positive"):
        LLMEngine("tiny-llama", tensor_parallel_size=2)


def test_a_killed_rank_is_reported_within_30_seconds():
    engine = LLMEngine("tiny-llama", tensor_parallel_size=2)
    try:
        engine.add_request(None, PROMPTS[0], PARAMS[0])
        engine.step()
        os.kill(engine._tp.pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor parallelism: rank 1 died"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 30
        with pytest.raises(RuntimeError, match="was shut down"):
            engine.step()
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "model, options, message",
    [
        ("tiny-llama", dict(tensor_parallel_size=3), "does not divide the 4 query heads"),
        ("tiny-llama", dict(tensor_parallel_size=0), "must be a positive int"),
        ("deepseek-v3-like", dict(tensor_parallel_size=3), "does not divide num_heads=4"),
        ("deepseek-v4-like", dict(tensor_parallel_size=4), "does not divide o_groups=2"),
        (
            "tiny-llama",
            dict(tensor_parallel_size=2, kv_cache_memory=["1MiB"]),
            "kv_cache_memory has 1 entries for tensor_parallel_size=2",
        ),
        (
            "tiny-llama",
            dict(tensor_parallel_size=2, speculative_method="draft", num_speculative_tokens=2),
            "speculative_method='draft' needs draft_model",
        ),
        (
            "tiny-llama",
            dict(
                tensor_parallel_size=2,
                speculative_method="draft",
                draft_model="no-such-model",
                num_speculative_tokens=2,
            ),
            "'no-such-model' is neither a preset",
        ),
    ],
)
def test_what_cannot_be_split_is_refused_before_any_process_starts(model, options, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(model, **options)


def test_a_bad_option_found_while_building_is_raised_as_itself_and_the_ranks_stop():
    """Speculation over state layers in a prefix-caching mode: rank 0 finds it while planning
    its cache, after the ranks started; the engine raises that ValueError (not a rank failure)
    and stops them."""
    with pytest.raises(ValueError, match="needs mamba_cache_mode='none'"):
        LLMEngine("hybrid-linear", tensor_parallel_size=2, speculative_method="ngram",
                  num_speculative_tokens=2, mamba_cache_mode="align")  # fmt: skip
    assert not multiprocessing.active_children()


UNGUARDED = """
from unified_attn import LLM, SamplingParams

llm = LLM("tiny-llama", tensor_parallel_size=2)
print(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].output_token_ids)
"""


def test_an_unguarded_script_is_told_to_add_a_main_guard(tmp_path):
    """Each spawned rank imports the script again; unguarded, it would build another engine
    there. The rank refuses, and rank 0 says what to add."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    env = os.environ | {"UNIFIED_ATTN_TP_TIMEOUT_S": "5"}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: tensor parallelism: rank 1 died")
    assert 'put that code under `if __name__ == "__main__":`' in last
