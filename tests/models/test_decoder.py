"""DecoderModel: backend sharing, parameter names, deterministic init, and paged-cache runs."""

import pytest
import torch

from tests.models.prefill import PagedRunner, greedy_decode, prefill_logits
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.models import DecoderModel, get_preset


def make_model(preset: str = "tiny-hybrid", seed: int = 0) -> DecoderModel:
    model = DecoderModel(get_preset(preset), ReferenceAttentionBackend)
    model.init_random_weights(seed)
    return model


def test_one_backend_instance_per_attention_kind():
    model = make_model()
    layers = list(model.attention_layers())
    assert [lc.name for lc, _ in layers] == [f"model.layers.{i}.self_attn" for i in range(4)]
    assert [(lc.sliding_window, lc.chunk_size) for lc, _ in layers] == [
        (None, None),
        (32, None),
        (None, 64),
        (32, None),
    ]
    backends = [b for _, b in layers]
    assert backends[1] is backends[3] and len({id(b) for b in backends}) == 3
    for lc, backend in layers:
        backend.check_layer(lc)
        assert lc.scale == 32**-0.5


def test_hf_llama_parameter_names_and_tied_head():
    names = set(make_model("tiny-llama").state_dict())
    assert "lm_head.weight" not in names
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= names
    layer = "model.layers.3."
    assert {
        layer + "self_attn.q_proj.weight",
        layer + "mlp.gate_proj.weight",
        layer + "input_layernorm.weight",
        layer + "post_attention_layernorm.weight",
    } <= names
    assert len(names) == 2 + 4 * 9


def test_init_random_weights_is_deterministic():
    a, b, c = make_model(seed=3), make_model(seed=3), make_model(seed=4)
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb)
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa))
        else:
            assert not torch.equal(pa, pc) and 0.015 < pa.std() < 0.025


def test_bf16_model_keeps_float32_rope_and_returns_float32_logits():
    model = DecoderModel(get_preset("tiny-llama"), ReferenceAttentionBackend, dtype=torch.bfloat16)
    model.init_random_weights(0)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    logits = prefill_logits(model, [[1, 2, 3]])[0]
    assert logits.dtype == torch.float32 and logits.shape == (3, 384)


def prompts(lengths, seed=0, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-hybrid"])
def test_batched_prefill_equals_single_prefills(preset):
    model = make_model(preset)
    batch = prompts([70, 3, 1, 41])
    together = prefill_logits(model, batch, block_size=16)
    for prompt, logits in zip(batch, together, strict=True):
        torch.testing.assert_close(logits, prefill_logits(model, [prompt])[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("split", [1, 33, 64])
def test_prefill_then_cached_steps_equal_one_prefill(split):
    # The continuation crosses the sliding window (32) and the chunk boundary (64).
    model = make_model()
    full = prompts([90], seed=1)[0]
    expected = prefill_logits(model, [full], block_size=8)[0]
    runner = PagedRunner(model, num_reqs=1, max_len=len(full), block_size=8)
    got = [runner.step([full[:split]])]
    pos = split
    while pos < len(full):
        step = min(7, len(full) - pos)
        got.append(runner.step([full[pos : pos + step]]))
        pos += step
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-5, rtol=0)


def test_greedy_decode_matches_recompute():
    model = make_model()
    batch = prompts([5, 40], seed=2)
    tokens = greedy_decode(model, batch, num_tokens=6, block_size=8)
    for prompt, new in zip(batch, tokens, strict=True):
        seq = list(prompt)
        for _ in range(6):
            seq.append(int(prefill_logits(model, [seq])[0][-1].argmax()))
        assert new == seq[len(prompt) :]


def test_gemma_style_norms_init_to_zero_and_sinks_stay_float32():
    gemma = make_model("gemma2-like")
    norms = [p for n, p in gemma.named_parameters() if n.endswith("norm.weight")]
    assert len(norms) == 4 * 4 + 1 and all(torch.equal(p, torch.zeros_like(p)) for p in norms)
    oss = DecoderModel(get_preset("gpt-oss-like"), ReferenceAttentionBackend, dtype=torch.bfloat16)
    params = dict(oss.named_parameters())
    assert params["model.layers.0.self_attn.sinks"].dtype == torch.float32
    assert params["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128, 256)
    assert params["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16


def test_sinks_reach_the_backend():
    model = make_model("gpt-oss-like")
    prompt = prompts([40])[0]
    before = prefill_logits(model, [prompt])[0]
    with torch.no_grad():
        model.model.layers[1].self_attn.sinks.add_(3.0)
    assert (prefill_logits(model, [prompt])[0] - before).abs().max() > 1e-3


def test_embed_scale_is_rounded_to_the_model_dtype_as_gemma2():
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    model = DecoderModel(get_preset("gemma2-like"), ReferenceAttentionBackend, dtype=torch.bfloat16)
    model.init_random_weights(0)
    theirs = gemma2.Gemma2TextScaledWordEmbedding(384, 128, 0, embed_scale=128**0.5)
    theirs = theirs.to(torch.bfloat16)
    theirs.weight.data.copy_(model.model.embed_tokens.weight)
    ids = torch.arange(384)
    ours = model.model.embed_tokens(ids) * model.embed_scale
    assert model.embed_scale != 128**0.5 and torch.equal(ours, theirs(ids))
