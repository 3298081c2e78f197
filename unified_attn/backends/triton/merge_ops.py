"""The MLA launchers' merge of split partials (`merge_mla_partials`), over
`kernels/attention/merge_partials.py`."""

from __future__ import annotations

import torch
import triton

from unified_attn.kernels.attention.merge_partials import merge_partials_kernel


def merge_mla_partials(
    out: torch.Tensor, part_acc: torch.Tensor, part_lse: torch.Tensor, num_segments: int
) -> None:
    """`out [T, H, L]` from an MLA launch's split partials (`part_acc [T * H * segments, L]`,
    `part_lse [T * H * segments]`, log2 units); no log-sum-exp is written."""
    num_tokens, num_heads, width = out.shape
    merge_partials_kernel[(num_tokens, num_heads)](
        out, part_lse, part_acc, part_lse, num_heads, num_segments, out.stride(0), out.stride(1),
        D=width, PARTS_PAD=triton.next_power_of_2(num_segments), WRITE_LSE=False,
    )  # fmt: skip
