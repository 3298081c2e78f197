"""Block-scaled fp8 checkpoints (DeepSeek-V3's released format, transformers'
`FineGrainedFP8Config`): a tiny random model's linear weights are quantized to e4m3 with one
scale per block and saved as such; loading dequantizes them, and the engine's prompt logits and
greedy tokens must equal transformers' on the same checkpoint, loaded with
`FineGrainedFP8Config(dequantize=True)` (CPU, float32)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.hf_models import hf_greedy, hf_logits, make_hf_model, save_hf_model
from tests.models.test_deepseek_hf import make_deepseek
from tests.models.test_deepseek_v4_hf import make_v4
from unified_attn import LLMEngine, SamplingParams
from unified_attn.models.fp8_checkpoint import dequantize_fp8, fp8_blocks

transformers = pytest.importorskip("transformers")

BLOCK = [32, 64]  # rows x columns of weights per scale (not square)


def quantize(weight: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weights and one float32 scale per block (the block's largest magnitude over 448)."""
    rows, cols = weight.shape
    nb = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(nb[0] * block[0], nb[1] * block[1])
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(nb[0], block[0], nb[1], block[1])
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(nb[0] * block[0], nb[1] * block[1])[:rows, :cols].contiguous(), scale


KEEP = ("norm", "embed", "head", "gate.weight")  # norms, embeddings, LM head, routers


def save_fp8(model, path, block):
    """`model` saved with its linear weights (every 2-D `.weight` but the `KEEP` ones)
    quantized in `block` blocks."""
    from safetensors.torch import load_file, save_file

    save_hf_model(model, path)
    state = load_file(path / "model.safetensors")
    out = {}
    for name, tensor in state.items():
        if name.endswith(".weight") and tensor.dim() == 2 and not any(k in name for k in KEEP):
            out[name], out[name + "_scale_inv"] = quantize(tensor, block)
        else:
            out[name] = tensor
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": block,
                                     "activation_scheme": "dynamic"}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    assert sum(t.dtype == torch.float8_e4m3fn for t in out.values()) > 4
    return path


def transformers_fp8(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
        dtype=torch.float32, attn_implementation="eager",
    ).eval()  # fmt: skip


@pytest.mark.parametrize(
    ("make", "block"),
    [
        # (transformers' dequantization needs every weight to be whole blocks; ours does not:
        # test_dequantized_weights_are_the_blocks_times_their_scales)
        (lambda: make_hf_model("llama", num_hidden_layers=2, hidden_size=128,
                               intermediate_size=192), BLOCK),
        (lambda: make_deepseek("v3"), [16, 16]),  # MLA's 48-wide ranks
        (lambda: make_v4(), [16, 16]),
    ],
    ids=["llama", "deepseek-v3", "deepseek-v4"],
)  # fmt: skip
def test_an_fp8_checkpoint_gives_transformers_logits_and_tokens(make, block, tmp_path):
    path = save_fp8(make(), tmp_path / "fp8", block)
    hf = transformers_fp8(path)
    prompts = [[(7 * i + 3 * j) % 100 + 3 for j in range(n)] for i, n in enumerate([21, 6])]
    engine = LLMEngine(str(path), kv_cache_memory="2MiB", block_size=8)
    params = SamplingParams(max_tokens=12, ignore_eos=True, prompt_logits=True)
    for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
        assert (out.prompt_logits - hf_logits(hf, prompt)).abs().max() < 1e-4
        assert out.output_token_ids == hf_greedy(hf, prompt, 12)


def test_dequantized_weights_are_the_blocks_times_their_scales():
    weight = torch.randn(70, 150)
    q, scale = quantize(weight, BLOCK)
    out = dequantize_fp8({"a.weight": q, "a.weight_scale_inv": scale, "b": weight}, (32, 64), "ck")
    assert set(out) == {"a.weight", "b"} and out["b"] is weight
    for r in range(70):
        for c in (0, 63, 64, 149):
            assert out["a.weight"][r, c] == q[r, c].float() * scale[r // 32, c // 64]
    assert (out["a.weight"] - weight).abs().max() <= weight.abs().max() / 8  # e4m3's rounding


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (lambda q, s: {"a.weight": q}, r"ck: a\.weight is torch.float8_e4m3fn without "
                                       r"a\.weight_scale_inv"),
        (lambda q, s: {"a.weight_scale_inv": s}, r"a\.weight_scale_inv scales no weight"),
        (lambda q, s: {"a.weight": q, "a.weight_scale_inv": s[:, :1]},
         r"has shape \(3, 1\), expected \(3, 3\) for a\.weight \(70, 150\) in blocks of 32 x 64"),
    ],
)  # fmt: skip
def test_an_incomplete_fp8_checkpoint_is_refused_naming_the_tensor(state, message):
    q, scale = quantize(torch.randn(70, 150), BLOCK)
    with pytest.raises(ValueError, match=message):
        dequantize_fp8(state(q, scale), (32, 64), "ck")


@pytest.mark.parametrize(
    "quantization",
    [
        {"quant_method": "mxfp4"},
        {"quant_method": "fp8"},  # no weight_block_size
        {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
        {"quant_method": "fp8", "weight_block_size": [128, 0]},
    ],
)
def test_quantizations_the_loader_cannot_read_are_refused_with_what_to_do(quantization):
    assert fp8_blocks({}, "ck") is None
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 64]}
    assert fp8_blocks({"quantization_config": fp8}, "ck") == (128, 64)
    with pytest.raises(ValueError, match=r"checkpoint ck: quantization_config .* is not supported;"
                                         r" supported: quant_method 'fp8' with weight_block_size"
                                         r".* Dequantize other checkpoints first"):  # fmt: skip
        fp8_blocks({"quantization_config": quantization}, "ck")
