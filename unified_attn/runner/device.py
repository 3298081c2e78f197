"""The device an engine runs on, checked against this machine before anything is built, and the
host-to-device copy of step inputs that does not make the host wait (`pinned_to`)."""

from __future__ import annotations

import torch

SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


def resolve_device(value: str | torch.device) -> torch.device:
    """`value` ("cpu", "cuda", "cuda:N" or a `torch.device`) as a device this machine has.

    Raises `ValueError` naming the device, what is accepted and what to do instead."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device {value!r} is not a device name; use one of 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if device.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(
            f"device {value!r}: unified_attn runs on {' or '.join(SUPPORTED_DEVICE_TYPES)}, "
            f"not {device.type}; use 'cpu' or 'cuda'"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "torch was built without CUDA"
                if torch.version.cuda is None
                else "no CUDA GPU is visible"
            )
            raise ValueError(
                f"device {value!r} needs a CUDA GPU, but {why} (torch {torch.__version__}); "
                "use device 'cpu'"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"device {value!r}: this machine has {count} CUDA device(s), "
                f"'cuda:0'..'cuda:{count - 1}'; pick one of those"
            )
    return device


def pinned_to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`. On CUDA the copy goes through pinned memory and does
    not wait for the device (torch's caching host allocator keeps the pinned block until the
    copy has run); elsewhere a plain copy."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
