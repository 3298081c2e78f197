"""The kinds of recurrent-state layer the state cells drive (`StateKind`), by `layer_kind`:
gated linear attention (`linear_state`), Mamba-2 (`mamba2`) and the gated delta-net
(`gated_delta`). A kind knows the backend's keywords beyond the shared ones, a step's random
inputs and the layer's weights, how they go through `forward`, and its oracle: the recurrence
one token at a time from the state before it (`token`), written apart from every backend's
chunked path (the one-token `ssd_step` and `gated_delta_step` of `backends/*_math.py`, and the
convolution as a dot product over the last K inputs). An oracle state is a tuple in the order
of the backend's `state_shapes`, so a state block is compared part by part (`parts`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from unified_attn.backend.state_layers import GatedDeltaWeights, Mamba2Weights
from unified_attn.backends.gated_delta_math import L2_EPS, gated_delta_step
from unified_attn.backends.mamba_math import ssd_step

if TYPE_CHECKING:
    from unified_attn.harness.conformance.state_cells import StateCell

State = tuple[torch.Tensor, ...]  # one request's state, in the backend's `state_shapes` order
Rows = dict[str, torch.Tensor]  # a step's inputs by name, each `[T, width]`
ForwardArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]

CONV_KERNEL = 4
# The scan's chunk (Mamba-2's smallest for the Triton scan): steps and checkpoints of the
# cells fall inside chunks as well as on their ends.
SCAN_CHUNK = 16
SSM_STATE_SIZE = 8
KEY_HEAD_SIZE = 8
TIME_STEP_LIMIT = (0.0, 2.0)  # clamps some of the softplus(dt) values of the random inputs


class StateKind(ABC):
    """One kind of state layer as the state cells drive it. `random_rows` and `weights` draw
    from the cell's generator only (a run is reproducible from its seed); `zero_state` is the
    state of a request with nothing computed; `token` is the oracle and never calls a
    backend."""

    layer_kind: ClassVar[str]
    title: ClassVar[str]  # the report's section
    parts: ClassVar[tuple[str, ...]]  # what each state tensor is, in `state_shapes` order
    tol: ClassVar[float]  # a float32 backend against the token-by-token oracle

    def backend_kwargs(self, cell: StateCell) -> dict[str, Any]:
        """The keywords of the kind's backend besides num_heads, head_size, dtype, the mode."""
        return {}

    def weights(self, cell: StateCell, gen: torch.Generator) -> tuple | None:
        """The layer's own parameters (the `mixer` keyword), or None."""
        return None

    @abstractmethod
    def random_rows(self, cell: StateCell, num_tokens: int, gen: torch.Generator) -> Rows:
        """Inputs of `num_tokens` tokens, each `[num_tokens, width]` float32 on the host."""

    @abstractmethod
    def forward_args(self, rows: Rows, weights: Any) -> ForwardArgs:
        """query, key, value and the keywords of `forward` for a step's rows."""

    @abstractmethod
    def zero_state(self, cell: StateCell) -> State: ...

    @abstractmethod
    def token(
        self, cell: StateCell, state: State, row: dict[str, torch.Tensor], weights: Any
    ) -> tuple[torch.Tensor, State]:
        """One token (`row`: each input `[width]`) from `state`: its output `[H * D]`, the
        state after it."""


class LinearKind(StateKind):
    """`S_t = g_t S_{t-1} + k_t^T v_t`, `o_t = scale q_t S_t`, in float64."""

    layer_kind = "linear_state"
    title = "recurrent state: gated linear attention"
    parts = ("state",)
    tol = 1e-4

    def random_rows(self, cell: StateCell, num_tokens: int, gen: torch.Generator) -> Rows:
        shape = (num_tokens, cell.num_heads * cell.head_size)
        gate = torch.randn(num_tokens, cell.num_heads, generator=gen) + 2.0
        return {
            "q": torch.randn(shape, generator=gen),
            "k": F.normalize(torch.randn(shape, generator=gen), dim=-1),
            "v": torch.randn(shape, generator=gen),
            "log_gate": F.logsigmoid(gate),
        }

    def forward_args(self, rows: Rows, weights: Any) -> ForwardArgs:
        return rows["q"], rows["k"], rows["v"], {"log_gate": rows["log_gate"]}

    def zero_state(self, cell: StateCell) -> State:
        size = cell.head_size
        return (torch.zeros(cell.num_heads, size, size, dtype=torch.float64),)

    def token(
        self, cell: StateCell, state: State, row: dict[str, torch.Tensor], weights: Any
    ) -> tuple[torch.Tensor, State]:
        q, k, v = (row[n].double().view(cell.num_heads, -1) for n in "qkv")  # [H, D]
        gate = row["log_gate"].double().exp()[:, None, None]
        new = gate * state[0] + k[:, :, None] * v[:, None, :]  # [H, D, D]
        out = cell.head_size**-0.5 * torch.einsum("hd,hde->he", q, new)
        return out.flatten(), (new,)


def _conv_token(
    carried: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the causal convolution: carried `[K - 1, C]`, x `[C]`, weight `[C, K]` ->
    SiLU of the dot product over the last K inputs `[C]`, the last `K - 1` inputs."""
    window = torch.cat([carried, x[None]])  # [K, C]
    y = (window * weight.t()).sum(0) + (0 if bias is None else bias)
    return F.silu(y), window[1:]


def _conv_dim(cell: StateCell, key_dim: int) -> int:
    return cell.num_heads * cell.head_size + 2 * key_dim


class Mamba2Kind(StateKind):
    """The causal convolution, then `S_t = a_t S_{t-1} + dt_t x_t^T B_t`, `y_t = S_t C_t + D x_t`
    (`ssd_step`), in float32."""

    layer_kind = "mamba2"
    title = "recurrent state: Mamba-2 (convolution, SSD scan)"
    parts = ("convolution inputs", "SSM state")
    tol = 2e-4

    @staticmethod
    def num_groups(cell: StateCell) -> int:
        return max(1, cell.num_heads // 2)  # two heads share each group's B and C

    def backend_kwargs(self, cell: StateCell) -> dict[str, Any]:
        return {"num_groups": self.num_groups(cell), "state_size": SSM_STATE_SIZE,
                "conv_kernel": CONV_KERNEL, "chunk_size": SCAN_CHUNK,
                "time_step_limit": TIME_STEP_LIMIT}  # fmt: skip

    def conv_dim(self, cell: StateCell) -> int:
        return _conv_dim(cell, self.num_groups(cell) * SSM_STATE_SIZE)

    def weights(self, cell: StateCell, gen: torch.Generator) -> Mamba2Weights:
        conv, heads = self.conv_dim(cell), cell.num_heads
        return Mamba2Weights(
            conv_weight=torch.randn(conv, CONV_KERNEL, generator=gen) * CONV_KERNEL**-0.5,
            conv_bias=torch.randn(conv, generator=gen) * 0.1,
            A=-(torch.rand(heads, generator=gen) + 0.2),
            D=torch.randn(heads, generator=gen),
            dt_bias=torch.randn(heads, generator=gen) * 0.5,
        )

    def random_rows(self, cell: StateCell, num_tokens: int, gen: torch.Generator) -> Rows:
        return {
            "xbc": torch.randn(num_tokens, self.conv_dim(cell), generator=gen),
            "dt": torch.randn(num_tokens, cell.num_heads, generator=gen),
        }

    def forward_args(self, rows: Rows, weights: Any) -> ForwardArgs:
        return rows["xbc"], rows["dt"], rows["xbc"], {"mixer": weights}

    def zero_state(self, cell: StateCell) -> State:
        return (torch.zeros(CONV_KERNEL - 1, self.conv_dim(cell)),
                torch.zeros(cell.num_heads, cell.head_size, SSM_STATE_SIZE))  # fmt: skip

    def token(
        self, cell: StateCell, state: State, row: dict[str, torch.Tensor], weights: Any
    ) -> tuple[torch.Tensor, State]:
        w: Mamba2Weights = weights
        xbc, carried = _conv_token(state[0], row["xbc"], w.conv_weight, w.conv_bias)
        heads, groups = cell.num_heads, self.num_groups(cell)
        x, B, C = xbc.split([heads * cell.head_size, *[groups * SSM_STATE_SIZE] * 2])
        x = x.view(1, heads, cell.head_size)
        dt = F.softplus(row["dt"] + w.dt_bias).clamp(*TIME_STEP_LIMIT)[None]  # [1, H]
        B, C = (t.view(1, groups, SSM_STATE_SIZE) for t in (B, C))
        y, ssm = ssd_step(x, dt, w.A, B, C, state[1][None])
        out = y[0] + w.D[:, None] * x[0]  # [H, P]
        return out.flatten(), (carried, ssm[0])


class GatedDeltaKind(StateKind):
    """The causal convolution over `[q, k, v]`, then the gated delta rule
    `S_t = a_t S_{t-1} + k_t (b_t (v_t - a_t S_{t-1}^T k_t))^T`, `o_t = S_t^T q_t`
    (`gated_delta_step`), in float32. Two value heads share each key head."""

    layer_kind = "gated_delta"
    title = "recurrent state: gated delta-net (convolution, delta rule)"
    parts = ("convolution inputs", "delta-rule state")
    tol = 2e-4

    @staticmethod
    def num_k_heads(cell: StateCell) -> int:
        return max(1, cell.num_heads // 2)

    def backend_kwargs(self, cell: StateCell) -> dict[str, Any]:
        return {"num_k_heads": self.num_k_heads(cell), "k_head_size": KEY_HEAD_SIZE,
                "conv_kernel": CONV_KERNEL, "chunk_size": SCAN_CHUNK}  # fmt: skip

    def conv_dim(self, cell: StateCell) -> int:
        return _conv_dim(cell, self.num_k_heads(cell) * KEY_HEAD_SIZE)

    def weights(self, cell: StateCell, gen: torch.Generator) -> GatedDeltaWeights:
        conv, heads = self.conv_dim(cell), cell.num_heads
        return GatedDeltaWeights(
            conv_weight=torch.randn(conv, CONV_KERNEL, generator=gen) * CONV_KERNEL**-0.5,
            conv_bias=None,  # as Qwen3-Next's (Mamba-2's cells have one)
            A=-torch.exp(torch.randn(heads, generator=gen) * 0.5),
            dt_bias=torch.randn(heads, generator=gen) * 0.5,
        )

    def random_rows(self, cell: StateCell, num_tokens: int, gen: torch.Generator) -> Rows:
        return {
            "qkv": torch.randn(num_tokens, self.conv_dim(cell), generator=gen),
            "a": torch.randn(num_tokens, cell.num_heads, generator=gen),
            "b": torch.randn(num_tokens, cell.num_heads, generator=gen),
        }

    def forward_args(self, rows: Rows, weights: Any) -> ForwardArgs:
        return rows["qkv"], rows["a"], rows["b"], {"mixer": weights}

    def zero_state(self, cell: StateCell) -> State:
        return (torch.zeros(CONV_KERNEL - 1, self.conv_dim(cell)),
                torch.zeros(cell.num_heads, KEY_HEAD_SIZE, cell.head_size))  # fmt: skip

    def token(
        self, cell: StateCell, state: State, row: dict[str, torch.Tensor], weights: Any
    ) -> tuple[torch.Tensor, State]:
        w: GatedDeltaWeights = weights
        qkv, carried = _conv_token(state[0], row["qkv"], w.conv_weight, w.conv_bias)
        heads, key_heads = cell.num_heads, self.num_k_heads(cell)
        q, k, v = qkv.split([key_heads * KEY_HEAD_SIZE] * 2 + [heads * cell.head_size])
        # each key head's q and k for its value heads, L2-normalised; q scaled by Dk ** -0.5
        q, k = (_l2norm(t.view(key_heads, -1)).repeat_interleave(heads // key_heads, dim=0)
                for t in (q, k))  # fmt: skip
        g = w.A * F.softplus(row["a"] + w.dt_bias)  # [Hv] log decay
        beta = torch.sigmoid(row["b"])
        q = q * KEY_HEAD_SIZE**-0.5
        o, new = gated_delta_step(q[None], k[None], v.view(1, heads, -1), g[None], beta[None],
                                  state[1][None])  # fmt: skip
        return o[0].flatten(), (carried, new[0])


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


STATE_KINDS: dict[str, StateKind] = {
    kind.layer_kind: kind for kind in (LinearKind(), Mamba2Kind(), GatedDeltaKind())
}


def state_kind(layer_kind: str) -> StateKind:
    if layer_kind not in STATE_KINDS:
        raise ValueError(
            f"no state cells for layer kind {layer_kind!r}; the state kinds are "
            f"{', '.join(STATE_KINDS)}"
        )
    return STATE_KINDS[layer_kind]
