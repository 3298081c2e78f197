"""The gated delta rule (Qwen3-Next's linear-attention layers) in plain torch: its chunked form
(prefill) and its one-token recurrence (decode); the causal convolution before it is Mamba-2's
(`mamba_math.causal_conv1d`). The CPU path of `GatedDeltaStateBackend`.

Per value head h, with decay `a_t = exp(g_t)`, rate `b_t` and state `S [Dk, Dv]`:
    S_t = a_t S_{t-1} + k_t (b_t (v_t - a_t S_{t-1}^T k_t))^T          o_t = S_t^T q_t
q and k are L2-normalised (q also scaled by `Dk ** -0.5`, `prepare_qk`) and shared by the
`Hv / Hk` value heads of each key head.
"""

from __future__ import annotations

import torch

from unified_attn.backends.mamba_math import causal_conv1d

__all__ = ["causal_conv1d", "gated_delta_chunked", "gated_delta_step", "prepare_qk"]

L2_EPS = 1e-6  # as the FLA kernels transformers mirrors


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k `[..., Hk, Dk]` -> float32 `[..., Hv, Dk]`: each key head repeated for its value
    heads, L2-normalised, q scaled by `Dk ** -0.5`."""
    repeat = num_v_heads // q.shape[-2]
    q, k = (_l2norm(t.float().repeat_interleave(repeat, dim=-2)) for t in (q, k))
    return q * q.shape[-1] ** -0.5, k


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
    offset: int = 0,
    checkpoints: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One request's new tokens, a chunk at a time (exact). Chunks end at absolute positions
    that are multiples of `chunk_size` (the request has `offset` tokens before these) and at
    every row count in `checkpoints`.

    q, k `[T, H, Dk]` (`prepare_qk`), v `[T, H, Dv]`, g (log decay) and beta `[T, H]`, state
    `[H, Dk, Dv]` float32 (the state before the tokens) -> (o `[T, H, Dv]` float32, the state
    after the last token, the states after each row count of `checkpoints`)."""
    num_tokens = q.shape[0]
    ends = {*range(chunk_size - offset % chunk_size, num_tokens, chunk_size), num_tokens}
    ends |= {end for end in checkpoints if 0 < end < num_tokens}
    outputs, saved = [], {}
    begin = 0
    for end in sorted(ends):
        o, state = _chunk(q[begin:end], k[begin:end], v[begin:end].float(),
                          g[begin:end].float(), beta[begin:end].float(), state)  # fmt: skip
        outputs.append(o)
        saved[end], begin = state, end
    return torch.cat(outputs), state, [saved[end] for end in checkpoints]


def _chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """q, k `[L, H, Dk]`, v `[L, H, Dv]`, g and beta `[L, H]`, state `[H, Dk, Dv]` (float32)."""
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, L, D]
    log_a = torch.cumsum(g.t(), dim=-1)  # [H, L]: log of the decay from the chunk start
    gap = log_a[:, :, None] - log_a[:, None, :]  # [H, L, L]: decay from s to t, t >= s
    causal = torch.ones_like(gap[0], dtype=torch.bool).tril()
    decay = torch.exp(gap.masked_fill(~causal, float("-inf")))
    b = beta.t()[:, :, None]  # [H, L, 1]
    # The rows' updates u_t = b_t (v_t - k_t^T S_t^pre) depend on the earlier rows' updates:
    # (I + M) u = b v - b a_t k_t^T S_0, with M[t, s] = b_t (k_t . k_s) decay[t, s], s < t.
    system = (b * (k @ k.transpose(1, 2)) * decay).tril(-1)
    solve = torch.linalg.solve_triangular
    u = solve(system, b * v, upper=False, unitriangular=True)
    carried = solve(system, b * k * torch.exp(log_a)[:, :, None], upper=False,
                    unitriangular=True)  # fmt: skip
    u = u - carried @ state  # [H, L, Dv]
    o = ((q @ k.transpose(1, 2)) * decay) @ u + (q * torch.exp(log_a)[:, :, None]) @ state
    to_end = torch.exp(log_a[:, -1:] - log_a)[:, :, None]  # [H, L, 1]: decay to the chunk end
    state = torch.exp(log_a[:, -1])[:, None, None] * state + (k * to_end).transpose(1, 2) @ u
    return o.transpose(0, 1), state


def gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token of each of R requests: q, k `[R, H, Dk]` (`prepare_qk`), v `[R, H, Dv]`, g and
    beta `[R, H]`, state `[R, H, Dk, Dv]` float32 -> (o `[R, H, Dv]` float32, the new states)."""
    state = state * torch.exp(g.float())[:, :, None, None]
    predicted = torch.einsum("rhkv,rhk->rhv", state, k)
    delta = (v.float() - predicted) * beta.float()[:, :, None]
    state = state + k[:, :, :, None] * delta[:, :, None, :]
    return torch.einsum("rhkv,rhk->rhv", state, q), state
