"""What a state layer's model hands its backend besides the contract's `forward` arguments:
the layer's own parameters that the recurrence needs (the projections stay in the model)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Mamba2Weights(NamedTuple):
    """A Mamba-2 layer's convolution and SSM parameters (the `mixer` kwarg of
    `Mamba2StateBackend.forward`)."""

    conv_weight: torch.Tensor  # [conv_dim, K]
    conv_bias: torch.Tensor | None  # [conv_dim]
    A: torch.Tensor  # [H] float32, negative
    D: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H]
