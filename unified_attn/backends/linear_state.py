"""Gated linear attention whose per-request state lives in KV-cache state blocks.

Per head, with a scalar gate `g_t` in (0, 1) per token:
    S_t = g_t * S_{t-1} + k_t^T v_t        (S: [D, D], float32)
    o_t = scale * q_t S_t
Prefill chunks use the exact chunkwise-parallel form; the state is carried between steps through
the block of `StateManager` (mode "none": table column 0; mode "align": read at position
`(computed - 1) // block_size`, write at `(computed + new - 1) // block_size`, see
`unified_attn/managers/state.py`). A request with nothing computed starts from zeros.

In batch-invariant mode the recurrence runs token by token (`gated_linear_recurrence`): the
chunkwise form's bits depend on where a step's chunk begins, so a prompt split differently by
the scheduler (or resumed from a cached state) would end in another state; token by token,
token t's output and state depend only on the tokens up to t.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from unified_attn.backend import (
    CommonAttentionMetadata,
    LayerConfig,
)
from unified_attn.backends.state_backend import StateBackend
from unified_attn.backends.state_rows import StateRow
from unified_attn.selector import register_backend

CHUNK = 64


@attrs.frozen
class StatePlan:
    requests: dict[int, list[StateRow]]  # host: group id -> one row per request


@register_backend(priority={"cpu": 100, "cuda": 100})
class LinearStateBackend(StateBackend[StatePlan]):
    """One instance serves every linear-attention layer with the same head shape."""

    name = "linear-state"
    layer_kinds = ("linear_state",)

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True  # every request on its own; token by token in batch-invariant mode

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype | str]]:
        return [((self.num_heads, self.head_size, self.head_size), "float32")]

    def prep_forward(
        self,
        common: CommonAttentionMetadata,
        block_tables: dict[int, torch.Tensor],
        for_cudagraph_capture: bool = False,
    ) -> None:
        self.plan = StatePlan(self.plan_rows(common, block_tables))

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        q, k, v = self.check_forward_inputs(layer, output, query, key, value)
        log_gate = kwargs["log_gate"]  # [T, H] float32, log g_t <= 0
        (states,) = self.caches[layer.name]  # [num_blocks, H, D, D] float32
        out = output.view(q.shape)
        plan = self.current_plan()
        scan = gated_linear_recurrence if self.batch_invariant else gated_linear_attention
        for row in plan.requests[self.group_of_layer[layer.name]]:
            state = self.read_state(states, row.read)
            # "all" mode: run up to each checkpoint, save it, go on
            begin = row.start
            for rows, block in (*row.checkpoints, (row.end - row.start, row.write)):
                end = row.start + rows
                o, state = scan(q[begin:end], k[begin:end], v[begin:end], log_gate[begin:end],
                                state, layer.scale)  # fmt: skip
                out[begin:end] = o.to(out.dtype)
                states[block] = state
                begin = end
        return output


def gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gate: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens `[L, H, D]` and log gates `[L, H]` from `state [H, D, D]`: outputs
    `[L, H, D]` float32 and the final state. Exact chunkwise form, CHUNK tokens at a time."""
    outputs = []
    for begin in range(0, q.shape[0], CHUNK):
        qc, kc, vc = (t[begin : begin + CHUNK].float().transpose(0, 1) for t in (q, k, v))
        b = torch.cumsum(log_gate[begin : begin + CHUNK].float().transpose(0, 1), dim=-1)
        # [H, L]: b_t = sum of log gates up to t; decay from s to t is exp(b_t - b_s) <= 1
        decay = torch.exp(b[:, :, None] - b[:, None, :]).tril()  # [H, L, L]
        scores = (qc @ kc.transpose(1, 2)) * decay
        o = scores @ vc + torch.exp(b)[:, :, None] * (qc @ state)
        outputs.append((scale * o).transpose(0, 1))
        weights = torch.exp(b[:, -1:] - b)[:, :, None]  # [H, L, 1]
        state = torch.exp(b[:, -1])[:, None, None] * state + (kc * weights).transpose(1, 2) @ vc
    return torch.cat(outputs), state


def gated_linear_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gate: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_linear_attention`, one token at a time: `S = g_t * S + k_t^T v_t`, then
    `o_t = scale * q_t S`, every op on tensors of one token's shape. Token t's bits depend on
    the tokens up to t and the starting state only, never on how the tokens were split into
    steps: the batch-invariant form."""
    outputs = []
    for t in range(q.shape[0]):
        qt, kt, vt = q[t].float(), k[t].float(), v[t].float()  # [H, D]
        gate = torch.exp(log_gate[t].float())[:, None, None]  # [H, 1, 1]
        state = gate * state + kt[:, :, None] * vt[:, None, :]
        outputs.append(scale * (qt[:, None, :] @ state)[:, 0])
    return torch.stack(outputs), state
