"""Checks and tuning evidence: ours against a float32 oracle, and the compiled kernel variants."""

from __future__ import annotations

from typing import Any

import torch

from mla_bench.shape import FP8_SCALE, plan_record
from mla_bench.timing import Bench, rel_err


def oracle_check(bench: Bench, p: dict[str, Any], gen: torch.Generator) -> dict[str, Any]:
    """Ours against a float32 torch oracle: 3 ragged decode requests, H 16, auto plan."""
    from unified_attn.backends.kv_quant import dequantize_fp8, quantize_fp8
    from unified_attn.backends.triton.mla_ops import MLAScratch, mla_attention
    from unified_attn.backends.triton.mla_plan import plan_mla

    dev, dtype = bench.device, getattr(torch, p["dtype"])
    L, dim, page, heads = p["kv_lora_rank"], p["kv_lora_rank"] + p["rope_dim"], p["page"], 16
    lens = [3 * page + 5, 1, 7 * page] if bench.gpu else [page + 3, 1, 2 * page]
    pages = [-(-n // page) for n in lens]
    cache = torch.randn(sum(pages) + 1, page, dim, generator=gen).to(dtype).to(dev)
    kv_scale = torch.tensor(FP8_SCALE, device=dev) if p.get("fp8") else None
    if kv_scale is not None:  # the cache holds e4m3; the oracle reads it dequantized
        cache = quantize_fp8(cache, kv_scale)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    ids = (torch.randperm(sum(pages), generator=gen) + 1).tolist()
    for i, n in enumerate(pages):
        table[i, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype).to(dev)
    out = torch.empty(len(lens), heads, L, dtype=dtype, device=dev)
    plan = plan_mla(
        num_reqs=3,
        num_tokens=3,
        num_heads=heads,
        max_query_len=1,
        max_seq_len=max(lens),
        dtype=dtype,
        device=dev,
        fp8_cache=kv_scale is not None,
    )
    scratch = MLAScratch()
    if plan.split is not None:
        scratch.ensure(3, heads, plan.split.num_segments, L, dev)
    table = table.to(dev)
    mla_attention(
        q,
        cache,
        table,
        torch.arange(4, dtype=torch.int32, device=dev),
        torch.tensor(lens, dtype=torch.int32, device=dev),
        p["scale"],
        out,
        L,
        plan=plan,
        scratch=scratch,
        kv_scale=kv_scale,
    )
    want = torch.empty(out.shape, dtype=torch.float32, device=dev)
    for i, n in enumerate(lens):
        pos = torch.arange(n, device=dev)
        keys = cache[table[i, pos // page].long(), pos % page].float()  # [n, L + R]
        if kv_scale is not None:
            keys = dequantize_fp8(keys, kv_scale)
        probs = torch.softmax(q[i].float() @ keys.T * p["scale"], dim=-1)
        want[i] = probs @ keys[:, :L]
    return {"lens": lens, "plan": plan_record(plan), **rel_err(out, want)}


def compiled_kernels() -> list[dict[str, Any]]:
    """Registers, spills and shared memory of every compiled variant of our kernels (the
    portable one and the Hopper ones; read off Triton's per-device caches: tuning evidence,
    an error entry if that internal layout changes)."""
    from unified_attn.kernels.mla.mla_attention import mla_attention_kernel
    from unified_attn.kernels.mla.mla_attention_sm90 import (
        mla_attention_sm90_kernel,
    )
    from unified_attn.kernels.mla.mla_decode_sm90_fp8 import (
        mla_decode_sm90_fp8_kernel,
    )
    from unified_attn.kernels.mla.mla_decode_sm90_ws import mla_decode_sm90_ws_kernel

    records = []
    for kernel in (mla_attention_kernel, mla_attention_sm90_kernel, mla_decode_sm90_ws_kernel,
                   mla_decode_sm90_fp8_kernel):  # fmt: skip
        try:
            cache = kernel.device_caches[torch.cuda.current_device()][0]
            records += [
                {"kernel": kern.src.fn.__name__, "constants": constexprs(kern),
                 "n_regs": kern.n_regs, "n_spills": kern.n_spills,
                 "shared_bytes": kern.metadata.shared, "num_warps": kern.metadata.num_warps,
                 "num_stages": kern.metadata.num_stages,
                 "wgmma": kern.asm["ptx"].count("wgmma.mma_async"),
                 "mma_sync": kern.asm["ptx"].count("mma.sync")}
                for kern in cache.values()
            ]  # fmt: skip
        except Exception as e:
            records.append({"error": f"{type(e).__name__}: {e}"[:200]})
    return records


def constexprs(kern: Any) -> dict[str, str]:
    names = kern.src.fn.arg_names
    return {names[k[0]]: str(v) for k, v in kern.src.constants.items() if names[k[0]].isupper()}
