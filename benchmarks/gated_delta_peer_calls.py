"""How vLLM 0.33 calls its fla gated delta rule ops (`peers/vllm_fla`, copied by
`vllm_peers.py`), for `gated_delta_kernels.py`'s peers: the chunked prefill over varlen
requests with the chunk metadata its builder precomputes, the recurrent decode on the same
q, k, v, g and beta, and the packed decode its Qwen3-Next layer runs (raw gates).

fla keeps states as `[blocks, Hv, Dv, Dk]` (ours: `[blocks, Hv, Dk, Dv]`) and skips block 0
(vLLM's null block) in decode."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

FLA_CHUNK = 64  # fla's FLA_CHUNK_SIZE


def load_fla() -> SimpleNamespace | None:
    try:
        from peers.vllm_fla import chunk, fused_recurrent, index
    except ImportError:
        return None
    return SimpleNamespace(chunk=chunk, recurrent=fused_recurrent, index=index)


def fla_layout(states: torch.Tensor) -> torch.Tensor:
    """`[..., Dk, Dv]` states as fla's `[..., Dv, Dk]` (a contiguous copy), and back."""
    return states.transpose(-1, -2).contiguous()


def fla_prefill(
    fla: SimpleNamespace, inp: dict[str, torch.Tensor], qsl: torch.Tensor,
    initial: torch.Tensor, scale: float, l2norm: bool,
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """`chunk_gated_delta_rule` over the requests of `qsl` (`[R + 1]` int32) from `initial`
    (`[R, Hv, Dv, Dk]` float32) as vLLM's prefill calls it: batch 1, `cu_seqlens`, the chunk
    indices and offsets computed once (its metadata builder's), the final states returned.
    -> a call giving (o `[T, Hv, Dv]`, final states `[R, Hv, Dv, Dk]`)."""
    indices = fla.index.prepare_chunk_indices(qsl, FLA_CHUNK)
    offsets = fla.index.prepare_chunk_offsets(qsl, FLA_CHUNK)
    q, k, v, g, beta = (inp[name][None] for name in ("q", "k", "v", "g", "beta"))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        o, final = fla.chunk.chunk_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=initial, output_final_state=True,
            cu_seqlens=qsl, chunk_indices=indices, chunk_offsets=offsets,
            use_qk_l2norm_in_kernel=l2norm,
        )  # fmt: skip
        return o[0], final

    return run


def fla_decode(
    fla: SimpleNamespace, inp: dict[str, torch.Tensor], states: torch.Tensor, scale: float
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`fused_recurrent_gated_delta_rule` on our one-token rows, q and k normalised in the
    kernel, states (fla's layout) updated in place at `slots` -> o `[R, Hv, Dv]`."""
    q, k, v, g, beta = (inp[name][:, None] for name in ("q", "k", "v", "g", "beta"))

    def run(slots: torch.Tensor) -> torch.Tensor:
        o, _ = fla.recurrent.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=states, inplace_final_state=True,
            ssm_state_indices=slots, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        return o[:, 0]

    return run


def fla_packed_decode(
    fla: SimpleNamespace, inp: dict[str, torch.Tensor], states: torch.Tensor, scale: float
) -> Callable[[torch.Tensor], torch.Tensor]:
    """vLLM 0.33's non-speculative Qwen3-Next decode, `fused_recurrent_gated_delta_rule_
    packed_decode`: the `[q, k, v]` rows packed, and raw gates a, b (A_log = dt_bias = 0) whose
    `g = -softplus(a)` and `beta = sigmoid(b)` are ours -> o `[R, Hv, Dv]`."""
    rows, heads = inp["g"].shape
    mixed = torch.cat([inp[name].flatten(1) for name in ("q", "k", "v")], dim=1)
    a, b = torch.log(torch.expm1(-inp["g"])), torch.logit(inp["beta"])
    zeros = torch.zeros(heads, device=a.device)
    out = torch.empty(rows, 1, heads, inp["v"].shape[2], dtype=inp["v"].dtype, device=a.device)

    def run(slots: torch.Tensor) -> torch.Tensor:
        fla.recurrent.fused_recurrent_gated_delta_rule_packed_decode(
            mixed, a, b, zeros, zeros, scale, states, out, slots, use_qk_l2norm_in_kernel=True
        )
        return out[:, 0]

    return run
