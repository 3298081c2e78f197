"""`kv_cache_dtype="fp8"` end to end on CPU: the engine option and its errors, the doubled
capacity (`run`, `plan`), scales from a checkpoint, prompt logits of presets within the
documented tolerance of the unquantized cache, and batch-invariant mode."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from unified_attn import LLMEngine, SamplingParams
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.cli import main
from unified_attn.models import DecoderModel
from unified_attn.models.hf import load_hf_model, split_kv_scales
from unified_attn.models.hf_config import config_from_hf

PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(40 + 23 * i)] for i in range(3)]
LOGITS = SamplingParams(max_tokens=1, prompt_logits=True)


def prompt_logits(preset: str, **kwargs) -> torch.Tensor:
    engine = LLMEngine(preset, dtype="float32", kv_cache_memory="16MiB", **kwargs)
    return torch.cat([out.prompt_logits for out in engine.generate(PROMPTS, LOGITS)])


# ---- the option -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["fp4", "fp8_e5m2", "float16", "FP8"])
def test_unsupported_cache_dtypes_are_a_clear_value_error(bad):
    with pytest.raises(ValueError, match=rf"kv_cache_dtype={bad!r} is not supported; use 'auto'"):
        LLMEngine("tiny-llama", kv_cache_dtype=bad)


@pytest.mark.parametrize(
    "model, backend, reason",
    [
        ("tiny-llama", "legacy-reference", "KV-cache dtype fp8 must equal the model dtype"),
        ("deepseek-v4-like", None, "KV-cache dtype fp8 must equal the model dtype"),
    ],
)
def test_backends_without_fp8_refuse_it_naming_themselves(model, backend, reason):
    with pytest.raises(ValueError, match=reason) as error:
        LLMEngine(model, backend=backend, kv_cache_dtype="fp8")
    if backend is not None:
        assert repr(backend) in str(error.value)


def test_an_fp8_latent_page_doubles_the_capacity_of_a_16_bit_mla_cache():
    """MLA's one latent per token (mla-reference): the page halves, the blocks double."""
    reports = {
        kv: LLMEngine(
            "deepseek-v3-like", dtype="float16", kv_cache_dtype=kv, kv_cache_memory="4MiB"
        )
        for kv in ("auto", "fp8")
    }
    auto, fp8 = (e.kv_cache_report for e in reports.values())
    assert fp8.num_blocks == pytest.approx(2 * auto.num_blocks, abs=1)
    backend = next(iter(reports["fp8"].model.attention_layers()))[1]
    assert backend.name == "mla-reference" and backend.kv_scales is not None


def test_the_fp8_page_doubles_the_capacity_of_a_16_bit_cache():
    reports = {
        kv: LLMEngine("tiny-llama", dtype="float16", kv_cache_dtype=kv).kv_cache_report
        for kv in ("auto", "fp8")
    }
    assert reports["fp8"].bytes_per_block * 2 == reports["auto"].bytes_per_block
    assert reports["fp8"].num_blocks == 2 * reports["auto"].num_blocks
    assert reports["fp8"].capacity_tokens == 2 * reports["auto"].capacity_tokens


# ---- the command line -------------------------------------------------------------------------

FAST = ["--num-requests", "2", "--max-tokens", "2"]


@pytest.mark.parametrize("command", [["run", *FAST], ["plan"]])
def test_a_bad_cache_dtype_is_one_line_and_exit_code_2(capsys, command):
    assert main([*command, "--kv-cache-dtype", "fp4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "--kv-cache-dtype: kv_cache_dtype='fp4' is not supported; use 'auto'" in err


def test_run_reports_the_fp8_cache_and_its_doubled_capacity(capsys):
    reports = {}
    for kv in ("auto", "fp8"):
        argv = ["run", *FAST, "--dtype", "float16", "--kv-cache-dtype", kv, "--json"]
        assert main(argv) == 0
        reports[kv] = json.loads(capsys.readouterr().out)
    assert reports["fp8"]["kv_cache_dtype"] == "fp8"
    fp8, auto = reports["fp8"]["kv_cache"], reports["auto"]["kv_cache"]
    assert fp8["capacity_tokens"] == 2 * auto["capacity_tokens"]
    assert fp8["bytes_per_block"] * 2 == auto["bytes_per_block"]


def test_plan_reports_the_fp8_cache_and_its_doubled_capacity(capsys):
    reports = {}
    for kv in ("auto", "fp8"):
        argv = ["plan", "--model", "gemma2-like", "--dtype", "bfloat16", "--kv-cache-dtype", kv]
        assert main([*argv, "--json"]) == 0
        reports[kv] = json.loads(capsys.readouterr().out)
    fp8, auto = reports["fp8"]["hybrid"], reports["auto"]["hybrid"]
    assert fp8["bytes_per_block"] * 2 == auto["bytes_per_block"]
    assert fp8["capacity_tokens"] == pytest.approx(2 * auto["capacity_tokens"], rel=1e-3)
    assert reports["fp8"]["settings"]["kv_cache_dtype"] == "fp8"
    assert main(["plan", "--kv-cache-dtype", "fp8"]) == 0
    assert "with an fp8 KV cache" in capsys.readouterr().out


# ---- scales from a checkpoint -----------------------------------------------------------------

TINY_LLAMA_HF = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def write_checkpoint(path, extra: dict[str, torch.Tensor]) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA_HF))
    model = DecoderModel(config_from_hf(TINY_LLAMA_HF), ReferenceAttentionBackend)
    model.init_random_weights(0)
    state = {k: v.contiguous() for k, v in model.state_dict().items()} | extra
    save_file(state, path / "model.safetensors")
    return str(path)


def layer_scales(index: int, k: float, v: float) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{index}.self_attn"
    return {f"{prefix}.k_scale": torch.tensor(k), f"{prefix}.v_scale": torch.tensor([v])}


def test_checkpoint_scales_reach_every_attention_layer(tmp_path):
    scales = layer_scales(0, 0.5, 0.25) | {"model.layers.1.self_attn.kv_scale": torch.tensor(2.0)}
    path = write_checkpoint(tmp_path / "ckpt", scales)
    model, _ = load_hf_model(path, ReferenceAttentionBackend)
    attn = [layer.self_attn for layer in model.model.layers]
    assert attn[0].kv_scales.tolist() == [0.5, 0.25] and attn[1].kv_scales.tolist() == [2.0, 2.0]
    assert attn[0].kv_scales.dtype == torch.float32
    assert "model.layers.0.self_attn.k_scale" not in model.state_dict()


def test_an_engine_uses_the_checkpoint_scales_instead_of_calibrating(tmp_path):
    # tiny scales make every stored key and value saturate at +-448: only if they are used
    tiny = layer_scales(0, 1e-6, 1e-6) | layer_scales(1, 1e-6, 1e-6)
    saturated = {}
    for name, extra in (("calibrated", {}), ("checkpoint", tiny)):
        path = write_checkpoint(tmp_path / name, extra)
        engine = LLMEngine(path, kv_cache_dtype="fp8", kv_cache_memory="4MiB")
        engine.generate([PROMPTS[0][:30]], SamplingParams(max_tokens=2))
        cache = engine.worker.kv_buffer.view(torch.float8_e4m3fn).float()
        saturated[name] = int((cache.abs() == 448).sum())
    assert saturated["checkpoint"] > 2 * 2 * 30 * 2 * 16  # layers x K,V x tokens x heads x dims
    assert saturated["calibrated"] < 16  # calibration maps each amax, and little else, to 448


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"model.layers.0.self_attn.k_scale": torch.tensor(0.5)}, "give both k_scale and v_scale"),
        (layer_scales(0, -1.0, 0.5), "must be positive and finite"),
        ({"model.layers.0.self_attn.k_scale": torch.ones(2),
          "model.layers.0.self_attn.v_scale": torch.ones(2)}, "one number per layer"),
        (layer_scales(7, 0.5, 0.5), "not attention layers of this model"),
    ],
)  # fmt: skip
def test_bad_checkpoint_scales_are_a_clear_error(tmp_path, extra, message):
    path = write_checkpoint(tmp_path / "bad", extra)
    with pytest.raises(ValueError, match=message):
        load_hf_model(path, ReferenceAttentionBackend)


def test_modelopt_names_of_the_scales_are_read_too():
    raw = {
        "model.layers.3.self_attn.k_proj.k_scale": torch.tensor(0.5),
        "model.layers.3.self_attn.v_proj.v_scale": torch.tensor(0.25),
        "model.layers.3.self_attn.k_proj.weight": torch.zeros(1),
    }
    rest, scales = split_kv_scales(raw, "ckpt")
    assert scales == {"model.layers.3.self_attn": (0.5, 0.25)}
    assert list(rest) == ["model.layers.3.self_attn.k_proj.weight"]


# ---- accuracy and batch invariance ------------------------------------------------------------

# The documented tolerance (docs/kv-cache.md): relative to the largest |logit|, the mean |Δ| of
# the prompt logits <= 2% and the 90th percentile of each token's max |Δ| <= 10%; dense presets
# also keep every token's max |Δ| <= 10% (a MoE router may flip experts on a few tokens).
DENSE = {"tiny-llama": True, "gemma2-like": True, "gpt-oss-like": False, "deepseek-v3-like": False}


@pytest.mark.parametrize("preset", DENSE)
def test_prompt_logits_with_an_fp8_cache_stay_within_the_documented_tolerance(preset):
    exact, fp8 = prompt_logits(preset), prompt_logits(preset, kv_cache_dtype="fp8")
    largest = exact.abs().max()
    per_token = (fp8 - exact).abs().amax(-1) / largest
    assert (fp8 - exact).abs().mean() / largest <= 0.02
    assert per_token.quantile(0.9) <= 0.10
    if DENSE[preset]:
        assert per_token.max() <= 0.10
    assert not torch.equal(fp8, exact)  # the cache really is quantized


def test_batch_invariant_mode_with_an_fp8_cache_is_bitwise_invariant():
    engine = LLMEngine(
        "tiny-llama", batch_invariant=True, kv_cache_dtype="fp8", enable_prefix_caching=False
    )
    target = PROMPTS[1]
    alone = engine.generate([target], LOGITS)[0].prompt_logits
    in_batch = engine.generate([PROMPTS[0], target, PROMPTS[2]], LOGITS)[1].prompt_logits
    assert torch.equal(alone, in_batch)
    for layer, backend in engine.model.attention_layers():
        assert backend.kv_scales.tensors[layer.name].tolist() == [1.0, 1.0]
