"""Load checkpoints saved in Hugging Face layout (the architectures of `supported_architectures`).

`config.json` is translated by `hf_config`; the weights load as a plain state dict because the
model's parameter names are transformers' own (after the renames an architecture declares in
`hf_families.WEIGHT_RENAMES`). Every problem with the checkpoint is a `ValueError` naming the
checkpoint, what was expected, what was found and what to do; the names and shapes are checked
on a meta-device model before the real one is allocated.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from unified_attn.backend import AttentionBackend
from unified_attn.models.config import ModelConfig
from unified_attn.models.decoder import DecoderModel
from unified_attn.models.fp8_checkpoint import dequantize_fp8, fp8_blocks
from unified_attn.models.hf_config import (
    ARCHITECTURES,
    HFConfig,
    architecture_of,
    config_from_hf,
    read_hf_config,
    rearrange_weights,
    rename_weight,
    supported_architectures,
)
from unified_attn.models.layers import Attention
from unified_attn.models.moe import stack_expert_weights
from unified_attn.models.tokenizer import HFTokenizer, load_tokenizer

__all__ = [
    "HFConfig",
    "config_from_hf",
    "load_hf_model",
    "read_hf_config",
    "read_state_dict",
    "supported_architectures",
]

HF_EXTRA = "pip install 'unified_attn[hf]'"
# fp8 KV-cache scales as fp8 checkpoints name them (one number per layer): vLLM / transformers
# `self_attn.k_scale` and `v_scale`, ModelOpt's `self_attn.k_proj.k_scale` / `v_proj.v_scale`,
# and the older `self_attn.kv_scale` shared by K and V.
KV_SCALE_NAME = re.compile(
    r"^(?P<layer>.+\.self_attn)\.(?:[kv]_proj\.)?(?P<which>k_scale|v_scale|kv_scale)$"
)


def load_hf_model(
    path: str | Path,
    backend_cls: type[AttentionBackend],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    backend_options: dict[str, Any] | None = None,
) -> tuple[DecoderModel, HFTokenizer | None]:
    """Model (weights loaded, cast to `dtype`) and the checkpoint's tokenizer, if it ships one."""
    path = Path(path)
    hf = read_hf_config(path)
    config = config_from_hf(hf, name=path.name)
    tokenizer = load_tokenizer(path)
    raw, kv_scales = split_kv_scales(
        read_state_dict(path, fp8_blocks(hf, path.name)), source=str(path)
    )
    state = check_weights(raw, hf, config, backend_cls, source=str(path))
    model = DecoderModel(
        config, backend_cls, dtype=dtype, device=device, backend_options=backend_options
    )
    load_weights(model, state, source=str(path))
    load_kv_scales(model, kv_scales, source=str(path))
    return model, tokenizer


# ---- reading the weights ------------------------------------------------------------------------


def _safetensors_load_file() -> Callable[..., dict[str, torch.Tensor]]:
    try:
        from safetensors.torch import load_file  # optional dependency: the `hf` extra
    except ImportError as error:
        raise ValueError(
            f"loading a Hugging Face checkpoint needs the safetensors package, which is not "
            f"installed ({error}); install the hf extra: {HF_EXTRA}"
        ) from None
    return load_file


def read_state_dict(
    path: Path, fp8_block: tuple[int, int] | None = None
) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` or of the shards named by its index, on CPU; with
    `fp8_block` (a block-scaled fp8 checkpoint, `fp8_checkpoint.fp8_blocks`) its fp8 weights
    dequantized to float32."""
    load_file = _safetensors_load_file()
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        state.update(load_file(file))
    return state if fp8_block is None else dequantize_fp8(state, fp8_block, str(path))


def _weight_files(path: Path) -> list[Path]:
    """`model.safetensors`, or the shards its index names; a `ValueError` when they are absent."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return _shards_of(index)
    found = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
    if any(name.endswith(".bin") for name in found):
        raise ValueError(
            f"checkpoint {path} has PyTorch .bin weights ({', '.join(found[:4])}) but no "
            "model.safetensors; only safetensors checkpoints are supported: load it with "
            "transformers and save_pretrained it again (that writes safetensors)"
        )
    if found:
        raise ValueError(
            f"checkpoint {path} has {', '.join(found[:4])} but neither model.safetensors nor "
            "model.safetensors.index.json naming the shards; re-save it with save_pretrained"
        )
    raise ValueError(
        f"checkpoint {path} has no weights: expected model.safetensors or "
        "model.safetensors.index.json with its shards, found no *.safetensors or *.bin file; "
        "copy the weights next to config.json"
    )


def _shards_of(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{index} is not a safetensors index (a JSON object with a 'weight_map'): "
            f"{type(error).__name__}: {error}; re-save the checkpoint with save_pretrained"
        ) from None
    shards = [index.parent / name for name in sorted(set(weight_map.values()))]
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise ValueError(
            f"checkpoint {index.parent}: shards {missing} named by {index.name} are missing; "
            "copy every shard next to the index"
        )
    return shards


# ---- fp8 KV-cache scales ------------------------------------------------------------------------


def split_kv_scales(
    raw: dict[str, torch.Tensor], source: str
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[float, float]]]:
    """The checkpoint's tensors without its fp8 KV-cache scales, and those scales per attention
    layer name: `(k_scale, v_scale)`, each a positive finite number."""
    rest: dict[str, torch.Tensor] = {}
    found: dict[str, dict[str, float]] = {}
    for name, tensor in raw.items():
        match = KV_SCALE_NAME.match(name)
        if match is None:
            rest[name] = tensor
            continue
        found.setdefault(match["layer"], {})[match["which"]] = _scale_value(name, tensor, source)
    return rest, {layer: _kv_pair(layer, given, source) for layer, given in found.items()}


def _scale_value(name: str, tensor: torch.Tensor, source: str) -> float:
    if tensor.numel() != 1:
        raise ValueError(
            f"checkpoint {source}: {name} has shape {_shape(tensor)}; fp8 KV-cache scales are "
            "one number per layer (per-head or per-channel scales are not supported)"
        )
    value = float(tensor.float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"checkpoint {source}: {name} = {value}; a KV-cache scale must be positive and finite"
        )
    return value


def _kv_pair(layer: str, given: dict[str, float], source: str) -> tuple[float, float]:
    if "k_scale" in given and "v_scale" in given:
        return given["k_scale"], given["v_scale"]
    if "kv_scale" in given and len(given) == 1:
        return given["kv_scale"], given["kv_scale"]
    raise ValueError(
        f"checkpoint {source}: layer {layer} has KV-cache scales {sorted(given)}; give both "
        "k_scale and v_scale (or one kv_scale shared by K and V)"
    )


def load_kv_scales(
    model: DecoderModel, scales: dict[str, tuple[float, float]], source: str
) -> None:
    """Give each attention layer its checkpoint scales (`Attention.kv_scales`, `[2]` float32 on
    the model's device). Backends with `kv_cache_dtype="fp8"` use them instead of calibrating;
    others ignore them."""
    layers = {}
    for layer in model.model.layers:
        attn = layer.self_attn
        if isinstance(attn, Attention):
            layers[attn.layer_config.name] = attn
    unknown = sorted(scales.keys() - layers.keys())
    if unknown:
        raise ValueError(
            f"checkpoint {source}: KV-cache scales of {unknown[:4]}, which are not attention "
            f"layers of this model (those are {sorted(layers)[:4]}...)"
        )
    for name, pair in scales.items():
        layers[name].kv_scales = torch.tensor(pair, dtype=torch.float32, device=model.device)


# ---- checking and loading -----------------------------------------------------------------------


def check_weights(
    raw: dict[str, torch.Tensor],
    hf: HFConfig,
    config: ModelConfig,
    backend_cls: type[AttentionBackend],
    source: str,
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's names, after checking names and shapes.

    When they do not fit the architecture that `config.json` names, the error names the
    supported architectures they do fit, or says that the checkpoint's architecture is not
    supported (it has weights the named one has no place for)."""
    arch = architecture_of(hf)
    state = _as_model_names(raw, arch, config)
    expected = expected_shapes(config, backend_cls)
    missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
    wrong = sorted(n for n in expected.keys() & state.keys() if _shape(state[n]) != expected[n])
    if not (missing or unexpected or wrong):
        return state
    fits = _fitting_architectures(raw, hf, arch, backend_cls)
    if fits:
        raise ValueError(
            f"checkpoint {source}: its weights do not fit architecture {arch!r} that config.json "
            f"names ({_first_difference(missing, unexpected, wrong)}) but fit {' or '.join(fits)}; "
            f'config.json names the wrong architecture: set "architectures": ["{fits[0]}"]'
        )
    if unexpected:
        raise ValueError(
            f"checkpoint {source}: architecture {arch!r} named in config.json has no place for "
            f"its weights {_few(unexpected)} (missing {_few(missing)}), and no supported "
            f"architecture fits them: the checkpoint's architecture is not supported "
            f"(supported: {', '.join(supported_architectures())})"
        )
    if missing:
        raise ValueError(
            f"weights of {source} do not match the model config: missing {_few(missing)}; "
            "check config.json (layers, tied embeddings, experts) against the checkpoint"
        )
    name = wrong[0]
    raise ValueError(
        f"weight {name} of {source} has shape {_shape(state[name])}, the config implies "
        f"{expected[name]}; check config.json's sizes against the checkpoint"
    )


def _as_model_names(
    raw: dict[str, torch.Tensor], arch: str, config: ModelConfig
) -> dict[str, torch.Tensor]:
    state = {
        rename_weight(arch, k): v for k, v in raw.items() if not k.endswith("rotary_emb.inv_freq")
    }
    state = rearrange_weights(arch, state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    if config.moe is not None and config.moe.expert_kind == "swiglu":
        state = stack_expert_weights(state, "gate_proj", "up_proj", "down_proj")
    return state


def expected_shapes(
    config: ModelConfig, backend_cls: type[AttentionBackend]
) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the model of `config`, from a meta-device model (no memory)."""
    model = DecoderModel(config, backend_cls, device="meta")
    return {name: _shape(tensor) for name, tensor in model.state_dict().items()}


def _fitting_architectures(
    raw: dict[str, torch.Tensor],
    hf: HFConfig,
    named: str,
    backend_cls: type[AttentionBackend],
) -> list[str]:
    """The supported architectures other than `named` whose model has exactly these weights."""
    fits = []
    for arch in ARCHITECTURES:
        if arch == named:
            continue
        try:
            config = config_from_hf({**hf, "architectures": [arch]})
            expected = expected_shapes(config, backend_cls)
        except (ValueError, KeyError, TypeError):
            continue  # the config does not even translate as `arch`
        state = _as_model_names(raw, arch, config)
        if {name: _shape(t) for name, t in state.items()} == expected:
            fits.append(arch)
    return fits


def _first_difference(missing: set[str], unexpected: set[str], wrong: list[str]) -> str:
    if unexpected:
        return f"unexpected {sorted(unexpected)[0]}"
    if missing:
        return f"missing {sorted(missing)[0]}"
    return f"shape of {wrong[0]} differs"


def load_weights(model: DecoderModel, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy `state` (model names) into `model`, casting dtype; names and shapes must match."""
    expected = model.state_dict()
    missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
    if missing or unexpected:
        raise ValueError(
            f"weights of {source} do not match the model config: missing {_few(missing)}, "
            f"unexpected {_few(unexpected)}; check config.json against the checkpoint"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"weight {name} of {source} has shape {_shape(tensor)}, the config implies "
                f"{_shape(expected[name])}"
            )
    model.load_state_dict(state)


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)


def _few(names: set[str], limit: int = 8) -> str:
    shown = sorted(names)[:limit]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{shown}{more}" if names else "none"
