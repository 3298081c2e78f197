"""What every model class shares: the constructor (`AttentionModel`, a template method) and,
for the decoders with an LM head, the head, its logits and the materializing steps
(`CausalLM`).

Every model is built as `Model(config, backend_cls, dtype=, device=, backend_options=)` (the
families' `build`, the checkpoint loaders and tensor parallelism rely on it): the backends come
first, then the modules are built on "meta" (no init cost, no global RNG use) and only then
allocated on `device`, with constant weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from unified_attn.backend import AttentionBackend

ConfigT = TypeVar("ConfigT")
KeyT = TypeVar("KeyT")  # what names a backend in `model.backends`


class AttentionModel(nn.Module, Generic[ConfigT, KeyT]):
    """A model whose attention layers run in backend instances of one selected class. Subclasses
    fill in `_make_backends`, `_build` and `_materialize` (and `_prepare` when something must
    exist before the modules)."""

    config: ConfigT
    dtype: torch.dtype
    backends: dict[KeyT, AttentionBackend]

    def __init__(
        self,
        config: ConfigT,
        backend_cls: type[AttentionBackend],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        options = backend_options or {}
        self.backends = self._make_backends(backend_cls, options, torch.device(device))
        self._prepare()
        with torch.device("meta"):  # no init cost, no global RNG use
            self._build()
        self._materialize(device, options)

    def _make_backends(
        self,
        backend_cls: type[AttentionBackend],
        options: dict[str, Any],
        device: torch.device,
    ) -> dict[KeyT, AttentionBackend]:
        """The backend instances the layers attend through (`options`: `backend_options`)."""
        raise NotImplementedError

    def _prepare(self) -> None:
        """What is computed rather than allocated and must be on a real device (RoPE tables),
        before `_build`; nothing by default."""

    def _build(self) -> None:
        """Create the modules (runs on "meta")."""
        raise NotImplementedError

    def _materialize(self, device: torch.device | str, options: dict[str, Any]) -> None:
        """Allocate the modules on `device` in `self.dtype`, weights constant, frozen."""
        raise NotImplementedError


class LMConfig(Protocol):
    """What `CausalLM` reads of a config."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def tie_word_embeddings(self) -> bool: ...


LMConfigT = TypeVar("LMConfigT", bound=LMConfig)


class CausalLM(AttentionModel[LMConfigT, KeyT]):
    """A decoder whose backbone is `model` (with `model.embed_tokens`) and whose LM head is its
    own `lm_head` or, with `tie_word_embeddings`, the embedding (`lm_head` None)."""

    model: Any
    lm_head: nn.Linear | None
    # Tensor parallelism: the LM head holds a slice of the vocabulary, and this joins the ranks'
    # logits into the full vocabulary (`models/tensor_parallel.py`).
    gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _build_lm_head(self) -> None:
        config = self.config
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def _materialize(self, device: torch.device | str, options: dict[str, Any]) -> None:
        self._cast()
        self.to_empty(device=device)
        self._reset_rotary(device)
        self._fill_constant()
        self.requires_grad_(False)

    def _cast(self) -> None:
        """Parameters and buffers in `self.dtype` (a family keeps some in float32)."""
        self.to(dtype=self.dtype)

    def _reset_rotary(self, device: torch.device | str) -> None:
        """Recompute the RoPE tables (not parameters) on `device`."""
        raise NotImplementedError

    def _fill_constant(self) -> None:
        """The constant starting weights (norms the identity, the rest 0)."""
        raise NotImplementedError

    @torch.no_grad()
    def _init_random_parameters(
        self, seed: int, constant: Callable[[str], float | None]
    ) -> torch.Generator:
        """Deterministic on any device: in `named_parameters()` order, each parameter the value
        `constant(name)` gives it, else normal(0, 0.02) drawn on CPU in float32. Returns the
        generator, for what else the family draws."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            value = constant(name)
            if value is None:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
            else:
                param.fill_(value)
        return gen

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _head_weight(self) -> torch.Tensor:
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return head.weight

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden `[N, hidden_size]` -> logits `[N, vocab_size]` float32."""
        logits = nn.functional.linear(hidden, self._head_weight()).float()
        return logits if self.gather_logits is None else self.gather_logits(logits)


@torch.no_grad()
def fill_ones_and_zeros(model: nn.Module, starts_at_one: Callable[[str], bool]) -> None:
    """Every parameter and buffer of `model` 1 where `starts_at_one(name)` (norms), else 0: the
    DeepSeek models' constant starting weights."""
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        tensor.fill_(1.0 if starts_at_one(name) else 0.0)
