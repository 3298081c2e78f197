"""One causal prefill launch (8k tokens, 32q/8kv/d128, bf16) for `ncu` to profile.

    ncu --kernel-name regex:unified_attention --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis python benchmarks/profile_prefill.py
"""

import torch
from common import prefill_case


def main(length: int = 8192, soft_cap: float | None = None) -> None:
    launch = prefill_case(length, soft_cap=soft_cap)["launch"]
    for _ in range(3):
        launch()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
