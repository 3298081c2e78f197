"""What the Mamba-2 launchers (`ssm_ops`) check of their inputs: shape, dtype, device and the
unit stride of the last dimension; each error names the input, what was expected and what was
found. Shapes only: nothing here reads device memory (the launchers stay graph-capturable)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(
    op: str,
    name: str,
    tensor: torch.Tensor,
    shape: Sequence[int | None],
    dtypes: Sequence[torch.dtype],
    device: torch.device,
    *,
    unit_stride: bool = False,
) -> None:
    """`shape` entries None match any size. Raises ValueError naming `op` and `name`."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, found {type(tensor).__name__}")
    if tensor.dim() != len(shape) or any(
        s is not None and s != t for s, t in zip(shape, tensor.shape, strict=True)
    ):
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{op}: {name} has shape {list(tensor.shape)}, expected {wanted}")
    if tensor.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(
            f"{op}: {name} has dtype {str(tensor.dtype).removeprefix('torch.')}, expected {names}"
        )
    if tensor.device != device:
        raise ValueError(f"{op}: {name} is on {tensor.device}, expected {device} (x's device)")
    if unit_stride and tensor.numel() and tensor.stride(-1) != 1:
        raise ValueError(
            f"{op}: {name} has stride {tensor.stride()}, expected a unit stride in its last "
            "dimension (pass .contiguous())"
        )


def check_slots(op: str, name: str, slots: torch.Tensor, rows: int, device: torch.device) -> None:
    """A `[rows]` int32 vector of block indices (-1: none)."""
    check_tensor(op, name, slots, (rows,), (torch.int32,), device)


def check_head_params(
    op: str, tensors: dict[str, torch.Tensor], num_heads: int, device: torch.device
) -> None:
    """dt_bias, A, D: `[H]` float32."""
    for name, tensor in tensors.items():
        check_tensor(op, name, tensor, (num_heads,), (torch.float32,), device)


def check_groups(op: str, num_heads: int, num_groups: int) -> None:
    if num_groups <= 0 or num_heads % num_groups:
        raise ValueError(
            f"{op}: B and C have {num_groups} groups, expected a divisor of the {num_heads} heads"
        )


def check_state_pool(
    op: str, states: torch.Tensor, num_heads: int, head_dim: int, state_dim: int,
    device: torch.device,
) -> None:  # fmt: skip
    """`[num_blocks, H, P, N]` float32, each head's `[P, N]` contiguous."""
    check_tensor(op, "ssm_states", states, (None, num_heads, head_dim, state_dim),
                 (torch.float32,), device)  # fmt: skip
    if states.numel() and (states.stride(-1), states.stride(-2)) != (1, state_dim):
        raise ValueError(
            f"{op}: ssm_states has stride {states.stride()}, expected each head's [P, N] state "
            f"contiguous (strides (..., {state_dim}, 1))"
        )


def check_dt_limit(op: str, dt_limit: tuple[float, float]) -> tuple[float, float]:
    low, high = (float(v) for v in dt_limit)
    if not low <= high:
        raise ValueError(f"{op}: dt_limit is {dt_limit}, expected (low, high) with low <= high")
    return low, high


def check_chunk_size(op: str, chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(
            f"{op}: chunk_size is {chunk_size!r}, expected a power of two >= 16 (the models' "
            "chunk_size, e.g. 128 or 256)"
        )
