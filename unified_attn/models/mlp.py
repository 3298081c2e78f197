"""Feed-forward blocks: gated MLPs (SwiGLU, GeGLU) and the factory choosing by `mlp_kind`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from unified_attn.kernels.layers.activation import act_and_mul
from unified_attn.models.config import ModelConfig
from unified_attn.models.fused import PackedLinear, project, skinny_row_limit


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate="tanh")  # transformers' gelu_pytorch_tanh


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "swiglu": nn.functional.silu,
    "geglu": _gelu_tanh,
}
# the fused kernel's name of each activation (`kernels/layers/activation.py`)
KERNEL_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu_tanh"}


class MLP(nn.Module):
    """Gated MLP: `down(act(gate(x)) * up(x))`; SiLU for SwiGLU (Llama), tanh-GELU for GeGLU
    (Gemma). With `fused_gate_up` (Phi-3) one `gate_up_proj [2I, H]` holds the gate rows, then
    the up rows. Fused (`set_fused`): one gate/up GEMM (separate projections packed,
    `PackedLinear`) and one activation-and-product kernel; with `skinny` decode rows take the
    decode-row GEMM (`models/fused.project`)."""

    packed: PackedLinear | None

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        kind: str = "swiglu",
        *,
        bias: bool = False,
        fused_gate_up: bool = False,
    ) -> None:
        super().__init__()
        hidden, inter = hidden_size, intermediate_size
        self.act, self.kind = ACTIVATIONS[kind], kind
        self.fused_gate_up, self.fused, self.packed = fused_gate_up, False, None
        self.skinny = 0  # rows up to which projections take the decode-row GEMM
        if fused_gate_up:
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        else:
            self.gate_proj = nn.Linear(hidden, inter, bias=bias)
            self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def set_fused(self, enabled: bool) -> None:
        if enabled and not self.fused_gate_up and self.packed is None:
            self.packed = PackedLinear([self.gate_proj, self.up_proj])
        self.fused = enabled
        self.skinny = skinny_row_limit() if enabled else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return project(self.down_proj, self._fused_activation(x), self.skinny)
        if self.fused_gate_up:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self._activate(gate) * up)
        return self.down_proj(self._activate(self.gate_proj(x)) * self.up_proj(x))

    def _fused_activation(self, x: torch.Tensor) -> torch.Tensor:
        """`act(gate) * up` `[..., I]` from one gate/up GEMM and one kernel."""
        packed = self.gate_up_proj if self.packed is None else self.packed
        gate_up = project(packed, x, self.skinny)  # [..., 2I]: gate, then up
        out = act_and_mul(gate_up.reshape(-1, gate_up.shape[-1]), KERNEL_ACTIVATIONS[self.kind])
        return out.view(*gate_up.shape[:-1], out.shape[-1])

    def _activate(self, gate: torch.Tensor) -> torch.Tensor:
        """`act(gate)` (batch-invariant mode replaces it)."""
        return self.act(gate)


def make_mlp(config: ModelConfig, layer_index: int = 0) -> nn.Module:
    """The feed-forward block of layer `layer_index`: `[T, hidden] -> [T, hidden]`. With
    `mlp_kind="moe"`, a mixture of experts, or a dense SwiGLU on `dense_mlp_layers`."""
    hidden, inter = config.hidden_size, config.intermediate_size
    if config.mlp_kind != "moe":
        return MLP(
            hidden,
            inter,
            config.mlp_kind,
            bias=config.mlp_bias,
            fused_gate_up=config.fused_gate_up,
        )
    if layer_index in config.dense_mlp_layers:
        return MLP(hidden, inter, "swiglu", bias=config.mlp_bias)
    from unified_attn.models.moe import make_moe

    return make_moe(config)
