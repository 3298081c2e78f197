"""One causal prefill launch (8k tokens, 32q/8kv/d128, bf16) for `ncu` to profile.

    ncu --kernel-name regex:unified_attention --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis python benchmarks/profile_prefill.py
"""

import torch

from unified_attn.backends.triton.ops import unified_attention


def main(length: int = 8192, soft_cap: float | None = None) -> None:
    hq, hkv, d, bs = 32, 8, 128, 16
    nb = length // bs + 1
    cache = torch.randn(nb + 1, 2, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    table = (torch.randperm(nb, device="cuda").to(torch.int32) + 1)[None]
    q = torch.randn(length, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    qsl = torch.tensor([0, length], dtype=torch.int32, device="cuda")
    seq = torch.tensor([length], dtype=torch.int32, device="cuda")
    for _ in range(3):
        unified_attention(q, cache[:, 0], cache[:, 1], out, query_start_loc=qsl, seq_lens=seq,
                          block_table=table, num_seqs=1, max_query_len=length, scale=d**-0.5,
                          soft_cap=soft_cap)  # fmt: skip
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
