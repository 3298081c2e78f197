"""Mamba-2 in plain torch: the causal depthwise convolution with its carried inputs, the SSD
scan in its chunked form (prefill) and its one-token recurrence (decode). The oracle of the
Triton kernels (`kernels/ssm`) and the CPU path of `Mamba2StateBackend`.

Per head h, with `a_t = exp(dt_t * A_h)` and state `S [P, N]` (head size x state size):
    S_t = a_t * S_{t-1} + dt_t * x_t^T B_t          o_t = S_t C_t + D_h * x_t
B and C are shared by the `H / G` heads of each of the G groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, carried: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of one request's new rows, then SiLU.

    x `[T, C]`, carried `[K - 1, C]` (the inputs before x: zeros for a new request), weight
    `[C, K]`, bias `[C]` -> (y `[T, C]` in x's dtype, the last `K - 1` inputs `[K - 1, C]`)."""
    window = torch.cat([carried.to(x.dtype), x])  # [K - 1 + T, C]
    y = F.conv1d(window.t()[None].to(weight.dtype), weight[:, None], bias, groups=x.shape[1])
    return F.silu(y[0].t()).to(x.dtype), window[-(weight.shape[1] - 1) :]


def discretize(
    dt: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float]
) -> torch.Tensor:
    """`clamp(softplus(dt + dt_bias), *limit)` in float32, `[T, H]`."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(*limit)


def _heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`[T, G, N]` -> `[T, H, N]`: each group's rows repeated for its heads."""
    return t.float().repeat_interleave(num_heads // t.shape[1], dim=1)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
    offset: int = 0,
    checkpoints: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One request's new tokens through the SSD scan, a chunk at a time (exact). Chunks end
    at absolute positions that are multiples of `chunk_size` (the request has `offset` tokens
    before x, so its first chunk may be shorter) and at each checkpoint.

    x `[T, H, P]`, dt `[T, H]` float32 (discretized), A `[H]` float32 (negative), B and C
    `[T, G, N]`, state `[H, P, N]` float32 (the state before x) -> (y `[T, H, P]` float32,
    without the D skip; the state after the last token; the states after each row count in
    `checkpoints`, each in `[1, T]`)."""
    num_heads, num_tokens = x.shape[1], x.shape[0]
    if any(not 0 < c <= num_tokens for c in checkpoints):
        raise ValueError(f"checkpoints {checkpoints} are not row counts in [1, {num_tokens}]")
    Bh, Ch = _heads(B, num_heads), _heads(C, num_heads)
    outputs, saved = [], []
    grid = range(chunk_size - offset % chunk_size, num_tokens, chunk_size)
    ends = sorted({*grid, *checkpoints, num_tokens})
    for begin, end in zip([0, *ends[:-1]], ends, strict=True):
        y, state = _chunk(x[begin:end].float(), dt[begin:end], A, Bh[begin:end],
                          Ch[begin:end], state)  # fmt: skip
        outputs.append(y)
        if end in checkpoints:
            saved.append(state)
    return torch.cat(outputs), state, saved


def _chunk(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """x `[L, H, P]`, dt `[L, H]`, B and C `[L, H, N]`, state `[H, P, N]` (all float32)."""
    log_a = torch.cumsum((dt * A).t(), dim=-1)  # [H, L]: log of the decay from the chunk start
    gap = log_a[:, :, None] - log_a[:, None, :]  # [H, L, L]: decay from s to t, t >= s
    causal = torch.ones_like(gap[0], dtype=torch.bool).tril()
    decay = torch.exp(gap.masked_fill(~causal, float("-inf")))
    xdt = x * dt[:, :, None]  # [L, H, P]
    scores = torch.einsum("thn,shn->hts", C, B) * decay  # [H, L, L]
    y = torch.einsum("hts,shp->thp", scores, xdt)
    y = y + torch.einsum("thn,hpn->thp", C, state) * torch.exp(log_a).t()[:, :, None]
    to_end = torch.exp(log_a[:, -1:] - log_a).t()  # [L, H]: decay from each token to the end
    state = torch.exp(log_a[:, -1])[:, None, None] * state + torch.einsum(
        "shp,shn->hpn", xdt * to_end[:, :, None], B
    )
    return y, state


def ssd_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token of each of R requests: x `[R, H, P]`, dt `[R, H]` float32, B and C
    `[R, G, N]`, state `[R, H, P, N]` float32 -> (y `[R, H, P]` float32 without the D skip,
    the new states)."""
    num_heads = x.shape[1]
    Bh, Ch = _heads(B, num_heads), _heads(C, num_heads)  # [R, H, N]
    decay = torch.exp(dt * A)[:, :, None, None]
    xdt = (x.float() * dt[:, :, None])[:, :, :, None]  # [R, H, P, 1]
    state = decay * state + xdt * Bh[:, :, None, :]
    return torch.einsum("rhpn,rhn->rhp", state, Ch), state
