"""The fused layers switch (`models/fused.py`) on a `DecoderModel`: packed projections, and every
family feature's fused path (CPU: the Triton interpreter) against the torch path the model runs
off CUDA, which the HF parity tests check against transformers."""

from __future__ import annotations

from collections import Counter

import attrs
import pytest
import torch
from torch import nn

from tests.models.hf_models import hf_logits, make_family_model, save_hf_model
from tests.models.prefill import prefill_logits
from unified_attn import LLMEngine, SamplingParams
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.models import DecoderModel, get_preset
from unified_attn.models import layers as layers_module
from unified_attn.models import mlp as mlp_module
from unified_attn.models import rope as rope_module
from unified_attn.models.config import AttnTemperature
from unified_attn.models.fused import PackedLinear
from unified_attn.models.invariant import make_batch_invariant

LLAMA = get_preset("tiny-llama")
# Qwen3-Next's attention: gated output, partial RoPE, zero-centred q/k norms
QWEN3_NEXT_ATTN = attrs.evolve(
    LLAMA, name="qwen3-next-attn", qk_norm=True, norm_style="gemma", attn_output_gate=True,
    partial_rotary_factor=0.25,
)  # fmt: skip
# Llama 4's attention: interleaved RoPE, L2 q/k norms, a NoPE layer with temperature
LLAMA4_ATTN = attrs.evolve(
    get_preset("llama4-like"), name="llama4-attn", rope_style="interleaved", qk_l2_norm=True,
    nope_layers=(2,), attn_temperature=AttnTemperature(floor_scale=2, attn_scale=0.5),
)  # fmt: skip
CONFIGS = {
    "llama": LLAMA,
    "gemma2": get_preset("gemma2-like"),  # Gemma norms, GeGLU, post norms, soft caps
    "gpt-oss": get_preset("gpt-oss-like"),  # float32-style norms, sinks, MoE (torch experts)
    "qwen2": attrs.evolve(LLAMA, name="qwen2", attention_bias=True),  # packed biases
    "qwen3": attrs.evolve(LLAMA, name="qwen3", qk_norm=True),  # q/k norms of strided heads
    "phi3": attrs.evolve(LLAMA, name="phi3", fused_qkv=True, fused_gate_up=True),
    "qwen3-next-attn": QWEN3_NEXT_ATTN,
    "llama4-attn": LLAMA4_ATTN,
}
PROMPTS = [[1, 5, 9, 33, 7, 100, 2], [3, 4], [250]]


def make_model(config, dtype=torch.float32, fused=False, seed=0) -> DecoderModel:
    model = DecoderModel(config, ReferenceAttentionBackend, dtype=dtype)
    model.init_random_weights(seed)
    if fused:
        model.use_fused_layers()
    return model


def make_linears(bias: bool) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(16, n, bias=bias) for n in (8, 4, 4)]


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_one_gemm_that_follows_in_place_updates(bias):
    linears = make_linears(bias)
    packed = PackedLinear(linears)
    x = torch.randn(5, 16)
    torch.testing.assert_close(packed(x), torch.cat([lin(x) for lin in linears], dim=-1))
    storage = packed.weight.untyped_storage().data_ptr()
    assert all(lin.weight.untyped_storage().data_ptr() == storage for lin in linears)
    with torch.no_grad():  # a checkpoint loads into the parameters in place
        linears[1].load_state_dict({k: v + 1 for k, v in linears[1].state_dict().items()})
        linears[2].weight.mul_(-2)
    assert packed.is_current()
    torch.testing.assert_close(packed(x), torch.cat([lin(x) for lin in linears], dim=-1))


def test_a_replaced_parameter_is_packed_again():
    linears = make_linears(bias=True)
    packed = PackedLinear(linears)
    linears[0].weight.data = torch.ones(8, 16)  # as module.to() would: a new tensor
    assert not packed.is_current()
    x = torch.randn(2, 16)
    torch.testing.assert_close(packed(x), torch.cat([lin(x) for lin in linears], dim=-1))
    assert packed.is_current() and linears[0].weight.data_ptr() == packed.weight.data_ptr()


def test_layers_with_and_without_a_bias_do_not_pack():
    with pytest.raises(ValueError, match="must all have a bias or none"):
        PackedLinear([nn.Linear(4, 4), nn.Linear(4, 4, bias=False)])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_fused_decoder_matches_the_torch_path(name):
    torch_model, fused_model = (make_model(CONFIGS[name], fused=f) for f in (False, True))
    for want, got in zip(prefill_logits(torch_model, PROMPTS),
                         prefill_logits(fused_model, PROMPTS), strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_float16_fused_decoder_stays_within_rounding():
    want, got = (prefill_logits(make_model(LLAMA, torch.float16, fused=f), PROMPTS)
                 for f in (False, True))  # fmt: skip
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


def spy_on(monkeypatch, targets, calls: Counter) -> Counter:
    """Count the calls of each `(owner, name)` of `targets` in `calls`."""
    for owner, name in targets:
        original = getattr(owner, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    return calls


def count_launches(monkeypatch) -> Counter:
    """Calls of each fused launcher the model layers make."""
    targets = [(layers_module.norm_kernels, "rms_norm"), (layers_module.norm_kernels,
               "add_rms_norm"), (mlp_module, "act_and_mul"), (rope_module, "apply_rotary"),
               (rope_module.RotaryEmbedding, "cos_sin_table")]  # fmt: skip
    return spy_on(monkeypatch, targets, Counter())


def test_one_kernel_per_norm_activation_and_rope_and_one_rope_table_per_step(monkeypatch):
    model = make_model(LLAMA, fused=True)
    calls = count_launches(monkeypatch)
    prefill_logits(model, PROMPTS)
    layers = LLAMA.num_layers
    # the first layer's input norm alone has no residual to add; the final norm adds the last
    assert calls == Counter(rms_norm=1, add_rms_norm=2 * layers, act_and_mul=layers,
                            apply_rotary=layers, cos_sin_table=1)  # fmt: skip
    attn = model.model.layers[0].self_attn
    assert attn.packed is not None and attn.packed.sizes == [128, 64, 64]


def test_fused_models_keep_checkpoint_names_and_load_into_the_packed_weights():
    plain, fused = make_model(LLAMA, seed=1), make_model(LLAMA, fused=True, seed=2)
    assert plain.state_dict().keys() == fused.state_dict().keys()
    fused.load_state_dict(plain.state_dict())
    for want, got in zip(prefill_logits(plain, PROMPTS), prefill_logits(fused, PROMPTS),
                         strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(layer.self_attn.packed.is_current() for layer in fused.model.layers)


def test_batch_invariant_mode_keeps_the_torch_layers():
    invariant = DecoderModel(LLAMA, ReferenceAttentionBackend,
                             backend_options={"batch_invariant": True})  # fmt: skip
    with pytest.raises(ValueError, match="batch-invariant mode, which keeps its invariant"):
        invariant.use_fused_layers()
    fused = make_model(LLAMA, fused=True)
    make_batch_invariant(fused)
    fusable = [m for m in fused.modules() if hasattr(m, "set_fused")]
    assert fusable and not any(m.fused for m in fusable)


@pytest.mark.parametrize("family", ["qwen3-next", "llama4"])
def test_the_engine_on_fused_layers_gives_transformers_logits(family, tmp_path, monkeypatch):
    # as on CUDA, where the model fuses its layers when built: here through the interpreter
    materialize = DecoderModel._materialize

    def fused_materialize(self, device, options):
        materialize(self, device, options)
        self.use_fused_layers()

    monkeypatch.setattr(DecoderModel, "_materialize", fused_materialize)
    hf = make_family_model(family)
    engine = LLMEngine(str(save_hf_model(hf, tmp_path / family)), device="cpu", dtype="float32",
                       kv_cache_memory="2MiB", max_num_batched_tokens=32)  # fmt: skip
    prompts = [[(5 * i + 3 * j) % 90 + 4 for j in range(n)] for i, n in enumerate([37, 12])]
    params = SamplingParams(max_tokens=6, ignore_eos=True, return_logits=True)
    for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
        want = hf_logits(hf, prompt + out.output_token_ids)[len(prompt) - 1 : -1]
        torch.testing.assert_close(torch.stack(list(out.logits)), want, rtol=1e-4, atol=1e-4)


def test_fused_layers_are_on_unless_the_environment_turns_them_off(monkeypatch):
    from unified_attn.models.fused import fused_by_default

    monkeypatch.delenv("UNIFIED_ATTN_FUSED_LAYERS", raising=False)
    assert fused_by_default()
    monkeypatch.setenv("UNIFIED_ATTN_FUSED_LAYERS", "0")
    assert not fused_by_default()
    monkeypatch.setenv("UNIFIED_ATTN_FUSED_LAYERS", "1")
    assert fused_by_default()
    monkeypatch.setenv("UNIFIED_ATTN_FUSED_LAYERS", "yes")
    with pytest.raises(ValueError, match="UNIFIED_ATTN_FUSED_LAYERS='yes': expected 0 or 1"):
        fused_by_default()


def test_a_bad_fused_layers_setting_is_refused_on_every_device(monkeypatch):
    monkeypatch.setenv("UNIFIED_ATTN_FUSED_LAYERS", "yes")
    config = get_preset("tiny-llama")
    with pytest.raises(ValueError, match="UNIFIED_ATTN_FUSED_LAYERS='yes'"):
        DecoderModel(config, ReferenceAttentionBackend, device="cpu")
