"""load_hf_model against transformers: prompt logits and greedy tokens, plus loading errors."""

import json

import pytest
import torch

from tests.models.hf_models import hf_greedy, hf_logits, make_hf_model, save_hf_model
from tests.models.prefill import greedy_decode, prefill_logits
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.models import LayerKind, RopeScaling, load_hf_model

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES = {
    "llama3": ("llama", dict(num_hidden_layers=2, rope_parameters=LLAMA3)),
    "llama-bias": ("llama", dict(num_hidden_layers=2, attention_bias=True, mlp_bias=True)),
    "qwen2-sliding-tied": (
        "qwen2",
        dict(
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
    ),
    "mistral-sliding": ("mistral", dict(num_hidden_layers=2, sliding_window=8)),
}
LENGTHS = [23, 5, 31, 1, 20]


def prompts(lengths=LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    model_type, overrides = CASES[request.param]
    hf = make_hf_model(model_type, **overrides)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    ours, tokenizer = load_hf_model(path, ReferenceAttentionBackend)
    return request.param, hf, ours, tokenizer


def test_prompt_logits_match_transformers(checkpoint):
    _, hf, ours, tokenizer = checkpoint
    assert tokenizer is None
    batch = prompts()
    for prompt, logits in zip(batch, prefill_logits(ours, batch), strict=True):
        assert (logits - hf_logits(hf, prompt)).abs().max() < 1e-4


def test_greedy_tokens_match_transformers(checkpoint):
    _, hf, ours, _ = checkpoint
    batch = prompts([21, 4, 12], seed=1)
    got = greedy_decode(ours, batch, num_tokens=8)
    assert got == [hf_greedy(hf, prompt, 8) for prompt in batch]


def test_configs_translate(checkpoint):
    name, _, ours, _ = checkpoint
    cfg = ours.config
    expected_kinds = {
        "llama3": [LayerKind.full()] * 2,
        "llama-bias": [LayerKind.full()] * 2,
        "qwen2-sliding-tied": [LayerKind.full(), LayerKind.sliding(8), LayerKind.sliding(8)],
        "mistral-sliding": [LayerKind.sliding(8)] * 2,
    }[name]
    assert list(cfg.layer_kinds) == expected_kinds
    assert cfg.tie_word_embeddings == (name == "qwen2-sliding-tied")
    assert cfg.attention_bias == (name in ("llama-bias", "qwen2-sliding-tied"))
    if name == "llama3":
        assert cfg.rope_scaling == RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        )


@pytest.mark.parametrize("window", [7, 9])
def test_window_off_by_one_would_be_caught(tmp_path, window):
    # transformers' W=8 is our W=8: loading it as 7 or 9 changes the logits.
    hf = make_hf_model("mistral", num_hidden_layers=2, sliding_window=8)
    path = save_hf_model(hf, tmp_path)
    edit_config(path, sliding_window=window)
    ours, _ = load_hf_model(path, ReferenceAttentionBackend)
    prompt = prompts([20])[0]
    assert (prefill_logits(ours, [prompt])[0] - hf_logits(hf, prompt)).abs().max() > 1e-3


def test_qwen2_window_ignored_without_use_sliding_window(tmp_path):
    hf = make_hf_model("qwen2", num_hidden_layers=2, sliding_window=4, max_window_layers=0)
    ours, _ = load_hf_model(save_hf_model(hf, tmp_path), ReferenceAttentionBackend)
    assert ours.config.layer_kinds == (LayerKind.full(),) * 2
    prompt = prompts([20])[0]
    assert (prefill_logits(ours, [prompt])[0] - hf_logits(hf, prompt)).abs().max() < 1e-4


def test_sharded_checkpoint_loads_and_casts_to_bf16(tmp_path):
    hf = make_hf_model("llama", num_hidden_layers=2)
    path = save_hf_model(hf, tmp_path, max_shard_size="50KB")
    assert (path / "model.safetensors.index.json").exists()
    ours, _ = load_hf_model(path, ReferenceAttentionBackend, dtype=torch.bfloat16)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor.to(torch.bfloat16)), name


def test_checkpoint_with_tokenizer_files(tmp_path):
    from tests.models.test_tokenizer import save_word_tokenizer

    path = save_hf_model(make_hf_model("llama", num_hidden_layers=1), tmp_path)
    save_word_tokenizer(path)
    _, tokenizer = load_hf_model(path, ReferenceAttentionBackend)
    assert tokenizer is not None and tokenizer.encode("hello") == [3]


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
