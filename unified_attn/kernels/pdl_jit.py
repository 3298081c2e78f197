"""The first statement of a kernel that supports programmatic dependent launch (`pdl.py`):
`pdl_start(launch_pdl)`, before the kernel touches memory."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_start(launch_pdl: tl.constexpr):
    """With `launch_pdl`: wait until the kernel before has finished and its writes are visible,
    then let the next kernel's programs be scheduled (they wait the same way)."""
    if launch_pdl:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
