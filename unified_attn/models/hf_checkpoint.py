"""How the checkpoint loaders of the families apart from the Llama line (BERT, BART, DeepSeek
V2/V3, V3.2 and V4, the state-space hybrids) read a Hugging Face checkpoint: `config.json` into
the family's config, the weights into the model's names, checked against a meta-device model
before the real one is allocated, and the checkpoint's tokenizer. Each family states its steps
in one `CheckpointFormat`; the Llama line's loader (`hf.load_hf_model`) also reads KV-cache scales
and names the architecture the weights fit, so it has its own. `check_state` is the check most
formats use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import attrs
import torch
from torch import nn

from unified_attn.backend import AttentionBackend
from unified_attn.models.fp8_checkpoint import fp8_blocks
from unified_attn.models.hf import read_state_dict
from unified_attn.models.hf_config import read_hf_config
from unified_attn.models.tokenizer import HFTokenizer, load_tokenizer

ModelT = TypeVar("ModelT", bound=nn.Module)
State = dict[str, torch.Tensor]


@attrs.frozen(kw_only=True)
class CheckpointFormat(Generic[ModelT]):
    """One family's checkpoint: `read_config(config.json, name=)` -> its config,
    `model_names(tensors, config)` -> the state under the model's names, `check(state, expected,
    source)` a `ValueError` when the state does not fit `expected` (the meta model's state dict),
    `fp8`: block-scaled fp8 weights are dequantized on reading (`fp8_checkpoint`)."""

    model_cls: Callable[..., ModelT]
    read_config: Callable[..., Any]
    model_names: Callable[[State, Any], State]
    check: Callable[[State, State, str], None]
    fp8: bool = False

    def load(
        self, path: str | Path, backend_cls: type[AttentionBackend], **model_kwargs: Any
    ) -> tuple[ModelT, HFTokenizer | None]:
        """The model (`model_cls(config, backend_cls, **model_kwargs)`, weights loaded) and the
        checkpoint's tokenizer (None without one)."""
        path = Path(path)
        hf = read_hf_config(path)
        config = self.read_config(hf, name=path.name)
        fp8_block = fp8_blocks(hf, path.name) if self.fp8 else None
        state = self.model_names(read_state_dict(path, fp8_block), config)
        expected = self.model_cls(config, backend_cls, device="meta").state_dict()
        self.check(state, expected, str(path))
        model = self.model_cls(config, backend_cls, **model_kwargs)
        model.load_state_dict(state)
        return model, load_tokenizer(path)


def check_state(
    state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], source: str, hint: str
) -> None:
    """A `ValueError` naming the missing, unexpected or misshapen weights; `hint` names the
    config.json fields that decide them."""
    missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
    if missing or unexpected:
        raise ValueError(
            f"weights of {source} do not match its config.json: missing {_few(missing)}, "
            f"unexpected {_few(unexpected)}; check config.json ({hint}) against the checkpoint"
        )
    for name in sorted(expected):
        if state[name].shape != expected[name].shape:
            raise ValueError(
                f"weight {name} of {source} has shape {tuple(state[name].shape)}, the config "
                f"implies {tuple(expected[name].shape)}; check config.json's sizes"
            )


def _few(names: set[str], limit: int = 6) -> str:
    shown = sorted(names)[:limit]
    return f"{shown}{f' and {len(names) - limit} more' if len(names) > limit else ''}"
