"""Block-scaled fp8 checkpoints: `quantization_config = {"quant_method": "fp8",
"weight_block_size": [bo, bi], ...}`, the format of DeepSeek-V3 / R1's released weights and of
transformers' `FineGrainedFP8Config`.

A quantized linear weight `W [out, in]` is stored as `float8_e4m3fn` together with
`W_scale_inv [ceil(out / bo), ceil(in / bi)]` (float32), one scale per block of `bo x bi`
weights: the weight is `W_q * scale` block by block. Loading dequantizes every such weight to
float32 (the loaders then cast to the model's dtype) and drops the scales: the model computes in
its dtype, as transformers does with `FineGrainedFP8Config(dequantize=True)`. Activations are
not quantized (`activation_scheme` "dynamic" is what the checkpoints use, and it only concerns
fp8 matmuls). Any other quantization raises a ValueError saying what to do.
"""

from __future__ import annotations

from typing import Any

import torch

FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_SUFFIX = "_scale_inv"


def fp8_blocks(hf: dict[str, Any], name: str) -> tuple[int, int] | None:
    """`(bo, bi)` of a block-scaled fp8 checkpoint, None for an unquantized one; a ValueError
    naming the checkpoint and the setting for any quantization this loader does not read."""
    quantization = hf.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method")
    block = quantization.get("weight_block_size")
    fmt = quantization.get("fmt", "e4m3")
    scale_fmt = quantization.get("scale_fmt", "float")
    experts = quantization.get("expert_dtype", "fp8")
    readable = (
        method == "fp8"
        and isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
        and (fmt, scale_fmt, experts) == ("e4m3", "float", "fp8")
    )
    if not readable:
        raise ValueError(
            f"checkpoint {name}: quantization_config {quantization!r} is not supported; "
            "supported: quant_method 'fp8' with weight_block_size [rows, columns] (e4m3 "
            "weights, float32 '_scale_inv' scales per block), which loading dequantizes. "
            "Dequantize other checkpoints first, e.g. load with transformers in bfloat16 and "
            "save_pretrained"
        )
    return int(block[0]), int(block[1])


def dequantize_fp8(
    state: dict[str, torch.Tensor], block: tuple[int, int], source: str
) -> dict[str, torch.Tensor]:
    """`state` with every fp8 weight `W` and its `W_scale_inv` replaced by the float32 weight;
    other tensors unchanged. A ValueError names a weight without its scale, a scale without
    its weight, or a scale whose shape does not tile the weight in `block`."""
    out: dict[str, torch.Tensor] = {}
    scales = {k for k in state if k.endswith(SCALE_SUFFIX)}
    for key, tensor in state.items():
        if key in scales:
            if key[: -len(SCALE_SUFFIX)] not in state:
                raise ValueError(
                    f"{source}: {key} scales no weight ({key[: -len(SCALE_SUFFIX)]} is "
                    "missing); the checkpoint is incomplete"
                )
            continue
        scale = state.get(key + SCALE_SUFFIX)
        if tensor.dtype in FP8_DTYPES:
            if scale is None:
                raise ValueError(
                    f"{source}: {key} is {tensor.dtype} without {key + SCALE_SUFFIX}; a "
                    "block-scaled fp8 checkpoint stores one scale per weight block"
                )
            out[key] = _dequantized(key, tensor, scale, block, source)
        else:
            out[key] = tensor
    return out


def _dequantized(
    key: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], source: str
) -> torch.Tensor:
    rows, cols = weight.shape[-2:] if weight.dim() >= 2 else (0, 0)
    want = (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    if weight.dim() < 2 or tuple(scale.shape) != want:
        raise ValueError(
            f"{source}: {key + SCALE_SUFFIX} has shape {tuple(scale.shape)}, expected {want} "
            f"for {key} {tuple(weight.shape)} in blocks of {block[0]} x {block[1]}"
        )
    full = scale.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return weight.float() * full[..., :rows, :cols]
