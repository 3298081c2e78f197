"""Load Llama, Qwen2, Mistral, Gemma 2 and GPT-OSS checkpoints saved in Hugging Face layout.

`config.json` is translated by `hf_config`; the weights load as a plain state dict because the
model's parameter names are transformers' own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from unified_attn.backend import AttentionBackend
from unified_attn.models.decoder import DecoderModel
from unified_attn.models.hf_config import HFConfig, config_from_hf, read_hf_config
from unified_attn.models.tokenizer import HFTokenizer, load_tokenizer

__all__ = ["HFConfig", "config_from_hf", "load_hf_model", "read_hf_config", "read_state_dict"]


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
    config = config_from_hf(read_hf_config(path), name=path.name)
    model = DecoderModel(
        config, backend_cls, dtype=dtype, device=device, backend_options=backend_options
    )
    load_weights(model, read_state_dict(path), source=str(path))
    return model, load_tokenizer(path)


# ---- weights ------------------------------------------------------------------------------------


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` or of the shards named by its index, on CPU."""
    from safetensors.torch import load_file  # optional dependency: pip install .[hf]

    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        raise FileNotFoundError(
            f"{path} has neither model.safetensors nor model.safetensors.index.json; only "
            "safetensors checkpoints are supported (re-save with save_pretrained)"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(path / file))
    return state


def load_weights(model: DecoderModel, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy `state` into `model` (casting dtype); every weight must be present and expected."""
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
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
                f"weight {name} of {source} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict(state)


def _few(names: set[str], limit: int = 8) -> str:
    shown = sorted(names)[:limit]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{shown}{more}" if names else "none"
