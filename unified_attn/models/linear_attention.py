"""A gated linear-attention layer (the state layers of the `hybrid-linear` preset).

q and k are L2-normalised per head; a per-head scalar gate `g_t = sigmoid(g_proj(x))` decays
the state. The recurrence itself and its state (in KV-cache state blocks) belong to
`LinearStateBackend`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.models.config import ModelConfig


class LinearAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_config: LayerConfig, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.layer_config = layer_config
        self.backend = backend
        hidden, size = config.hidden_size, config.num_heads * config.head_size
        self.q_proj = nn.Linear(hidden, size, bias=False)
        self.k_proj = nn.Linear(hidden, size, bias=False)
        self.v_proj = nn.Linear(hidden, size, bias=False)
        self.g_proj = nn.Linear(hidden, config.num_heads, bias=True)
        self.o_proj = nn.Linear(size, hidden, bias=False)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """positions `[T]` (unused: no RoPE), hidden `[T, hidden_size]` -> `[T, hidden_size]`."""
        lc = self.layer_config
        num_tokens = hidden.shape[0]
        q = self._normalize(self.q_proj(hidden).view(num_tokens, lc.num_heads, lc.head_size))
        k = self._normalize(self.k_proj(hidden).view(num_tokens, lc.num_heads, lc.head_size))
        v = self.v_proj(hidden).view(num_tokens, lc.num_heads, lc.head_size)
        log_gate = F.logsigmoid(self.g_proj(hidden).float())  # [T, H]
        output = torch.empty(num_tokens, lc.num_heads * lc.head_size, dtype=hidden.dtype,
                             device=hidden.device)  # fmt: skip
        self.backend.forward(lc, output, q, k, v, log_gate=log_gate)
        return self.o_proj(output)

    @staticmethod
    def _normalize(x: torch.Tensor) -> torch.Tensor:
        """L2 over each head (batch-invariant mode replaces it)."""
        return F.normalize(x, dim=-1)
