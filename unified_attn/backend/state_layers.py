"""What a state layer's model hands its backend besides the contract's `forward` arguments:
the layer's own parameters that the recurrence needs (the projections stay in the model)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class Mamba2Weights(NamedTuple):
    """A Mamba-2 layer's convolution and SSM parameters (the `mixer` kwarg of
    `Mamba2StateBackend.forward`)."""

    conv_weight: torch.Tensor  # [conv_dim, K]
    conv_bias: torch.Tensor | None  # [conv_dim]
    A: torch.Tensor  # [H] float32, negative
    D: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H]


class GatedDeltaWeights(NamedTuple):
    """A gated delta-net layer's convolution and decay parameters (the `mixer` kwarg of
    `GatedDeltaStateBackend.forward`)."""

    conv_weight: torch.Tensor  # [conv_dim, K]
    conv_bias: torch.Tensor | None  # [conv_dim]
    A: torch.Tensor  # [Hv] float32, negative: -exp(A_log)
    dt_bias: torch.Tensor  # [Hv]


# Backend options only state backends take (a model strips them for its attention backends).
STATE_OPTIONS = ("mamba_cache_mode", "num_speculative_blocks")


def state_options(mamba_cache_mode: str, num_speculative_blocks: int) -> dict[str, Any]:
    """The state backends' options: the cache mode, and with speculative decoding one state
    slot per draft token (`StateManager.Config.num_speculative_blocks`)."""
    options: dict[str, Any] = {"mamba_cache_mode": mamba_cache_mode}
    if num_speculative_blocks:
        options["num_speculative_blocks"] = num_speculative_blocks
    return options
