"""`GatedDeltaStateBackend`'s CUDA path (`gated_delta_device.py`: the Triton convolution and
rule kernels over host-planned slots) run on the CPU through Triton's interpreter, forced by
marking the backend's states as on CUDA: an engine of the tiny Qwen3-Next gives transformers'
tokens and logits with chunked prefill, "all" mode's checkpoints and prefix hits, and
speculative verify steps (a state per token)."""

import pytest

from tests.backends.kernel_path import force_kernel_path
from tests.models.hf_models import make_family_model, save_hf_model
from tests.runner.test_engine_hf_parity import PARAMS, check_against_hf, prompts
from unified_attn import LLMEngine
from unified_attn.backends.gated_delta_state import GatedDeltaStateBackend


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    hf = make_family_model("qwen3-next")
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("qwen3-next"))


@pytest.fixture
def kernel_path(monkeypatch):
    """Every forward of the backend takes the kernels; counts their calls."""
    device = "unified_attn.backends.gated_delta_device"
    return force_kernel_path(monkeypatch, GatedDeltaStateBackend, device)


def test_kernel_path_matches_transformers(qwen3_next, kernel_path):
    """Chunks of 13 rows with "all" mode's checkpoints at every 32-token boundary."""
    hf, path = qwen3_next
    engine = LLMEngine(str(path), kv_cache_memory="2MiB", block_size=8,
                       max_num_batched_tokens=13, mamba_cache_mode="all")  # fmt: skip
    first = prompts([3], seed=1, shared=64)
    second = [[*first[0][:64], 5, 6, 7], [9] * 6]  # a hit of 64 tokens (32-aligned)
    for batch in (first, second):
        check_against_hf(hf, engine.generate(batch, PARAMS), batch, prompt_logits=False)
    assert kernel_path["decode"] > 0 and kernel_path["varlen"] > 0
    hits = engine.kv_cache_manager.group_stats()
    assert all(g["hit_blocks"] > 0 for g in hits), hits


def test_kernel_path_verifies_drafts(qwen3_next, kernel_path):
    hf, path = qwen3_next
    batch = prompts([23, 5], seed=3)
    engine = LLMEngine(str(path), kv_cache_memory="2MiB", max_model_len=80,
                       max_num_batched_tokens=48, speculative_method="ngram",
                       num_speculative_tokens=3)  # fmt: skip
    check_against_hf(hf, engine.generate([p * 2 for p in batch], PARAMS), [p * 2 for p in batch],
                     prompt_logits=False)  # fmt: skip
    assert engine.stats.spec_drafted > 0 and kernel_path["varlen"] > 0


def test_all_mode_on_64_token_blocks_takes_the_chunked_form(qwen3_next, kernel_path, monkeypatch):
    """Blocks of 64 tokens: every checkpoint ends a chunk of the WY form, so prefill chunks of
    64 rows or more run it ("auto") and the state it saves at 64 serves a prefix hit; shorter
    chunks run the token-by-token kernel."""
    from unified_attn.backends import gated_delta_device
    from unified_attn.backends.triton import gated_delta_ops as ops

    assert gated_delta_device.CHUNKED_GRID == ops.CHUNK
    paths = {"chunked": 0, "tokens": 0}
    for name, attr in (("chunked", "launch_chunked"), ("tokens", "_launch_varlen")):
        monkeypatch.setattr(ops, attr, _counted(getattr(ops, attr), paths, name))
    hf, path = qwen3_next
    engine = LLMEngine(str(path), kv_cache_memory="8MiB", block_size=64,
                       max_num_batched_tokens=100, mamba_cache_mode="all")  # fmt: skip
    first = prompts([20], seed=2, shared=128)
    second = [[*first[0][:100], 7, 8, 9]]  # shares the first 100-row chunk
    for batch in (first, second):
        outputs = engine.generate(batch, PARAMS)
        check_against_hf(hf, outputs, batch, prompt_logits=False)
    assert paths["chunked"] > 0 and paths["tokens"] > 0, paths
    assert outputs[0].num_cached_tokens == 64  # the state the chunked form saved at 64


def _counted(run, counts, name):
    def wrapper(*args, **kwargs):
        counts[name] += 1
        return run(*args, **kwargs)

    return wrapper
