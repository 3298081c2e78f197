"""Deliberately wrong native backends: the migration harness and the conformance suite must
catch both. Reached as `tests.harness.wrong_backends:WrongScaleBackend` (never registered)."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from unified_attn.backend import LayerConfig
from unified_attn.backends.reference import ReferenceAttentionBackend


class WrongScaleBackend(ReferenceAttentionBackend):
    """Scales scores by 1.25 / sqrt(D) instead of the layer's scale."""

    name = "wrong-scale"

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        wrong = attrs.evolve(layer, scale=layer.scale * 1.25)
        return super().forward(wrong, output, query, key, value, **kwargs)


class IgnoresWindowBackend(ReferenceAttentionBackend):
    """Attends to every cached key of a sliding-window layer (the window is never applied)."""

    name = "ignores-window"

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        unwindowed = attrs.evolve(layer, sliding_window=None)
        return super().forward(unwindowed, output, query, key, value, **kwargs)
