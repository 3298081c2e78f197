"""One shape: its data, our launch, the torch peers, their rates and checks."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import torch

from mla_bench.timing import Bench, rel_err

L2_PAGES = 8  # --l2-resident: pages every request reads (8 x 64 x 576 x 2 bytes, under 1 MB)
FP8_SCALE = 4.0 / 448  # --fp8: the latent cache's scale (random latents beyond 4 saturate)


class Shape:
    """Random latent caches (one per rotation buffer), a permuted block table and the queries of
    B requests of `ctx` tokens and H heads; every tile config and peer reads this same data."""

    def __init__(
        self, bench: Bench, p: dict[str, Any], heads: int, batch: int, ctx: int,
        gen: torch.Generator,
    ) -> None:  # fmt: skip
        dev, self.dtype = bench.device, getattr(torch, p["dtype"])
        self.L, self.R, self.page, self.scale = (p["kv_lora_rank"], p["rope_dim"], p["page"],
                                                 p["scale"])  # fmt: skip
        self.heads, self.batch, self.ctx = heads, batch, ctx
        dim = self.L + self.R
        self.kv_scale = torch.tensor(FP8_SCALE, device=dev) if p.get("fp8") else None
        self.latent_bytes = batch * ctx * dim * (1 if p.get("fp8") else self.dtype.itemsize)
        pages = -(-ctx // self.page)
        num_blocks = batch * pages + 1  # block 0: the null block
        perm = torch.randperm(batch * pages, generator=gen) + 1
        if p.get("l2_resident"):  # every request's pages are the same 8, which L2 holds
            perm = (torch.arange(batch * pages) % pages % L2_PAGES) + 1
        self.block_table = perm.view(batch, pages).to(torch.int32).to(dev)
        self.rotations = bench.rotations(self.latent_bytes)
        self.caches = [
            self.stored(self.randn(num_blocks, self.page, dim, device=dev))
            for _ in range(self.rotations)
        ]
        self.q = self.randn(batch, heads, dim, device=dev)
        self.out = torch.empty(batch, heads, self.L, dtype=self.dtype, device=dev)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)

    def plan(self, tiles: Any, num_segments: int | None) -> tuple[Any, Any]:
        """Our plan for this batch and a scratch ensured for it."""
        from unified_attn.backends.triton.mla_ops import MLAScratch
        from unified_attn.backends.triton.mla_plan import plan_mla

        plan = plan_mla(
            num_reqs=self.batch, num_tokens=self.batch, num_heads=self.heads, max_query_len=1,
            max_seq_len=self.ctx, dtype=self.dtype, device=self.q.device, tiles=tiles,
            num_segments=num_segments, latent_dims=(self.L, self.q.shape[2] - self.L),
            fp8_cache=self.kv_scale is not None,
        )  # fmt: skip
        scratch = MLAScratch()
        if plan.split is not None:
            scratch.ensure(self.batch, self.heads, plan.split.num_segments, self.L, self.q.device)
        return plan, scratch

    def randn(self, *shape: int, device: torch.device) -> torch.Tensor:
        return torch.randn(*shape, device=device).to(self.dtype)

    def stored(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents as the cache holds them: quantized to e4m3 with --fp8."""
        from unified_attn.backends.kv_quant import quantize_fp8

        return latents if self.kv_scale is None else quantize_fp8(latents, self.kv_scale)

    def ours(self, cache: torch.Tensor, plan: Any, scratch: Any) -> Callable[[], torch.Tensor]:
        from unified_attn.backends.triton.mla_ops import mla_attention

        return functools.partial(
            mla_attention, self.q, cache, self.block_table, self.qsl, self.seq_lens, self.scale,
            self.out, self.L, plan=plan, scratch=scratch, kv_scale=self.kv_scale,
        )  # fmt: skip

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """Each request's pages as a dense `[B, ctx, L + R]` tensor (dequantized with --fp8)."""
        from unified_attn.backends.kv_quant import dequantize_fp8

        dense = cache[self.block_table].flatten(1, 2)[:, : self.ctx]
        if self.kv_scale is None:
            return dense
        return dequantize_fp8(dense, self.kv_scale).to(self.dtype)

    def sdpa(self, dense: torch.Tensor) -> torch.Tensor:
        """Heads as the query rows of the single latent KV head: `[B, H, L]`."""
        import torch.nn.functional as F

        k = dense[:, None]  # [B, 1, ctx, L + R]
        q = self.q[:, None]  # [B, 1, H, L + R]
        return F.scaled_dot_product_attention(q, k, k[..., : self.L], scale=self.scale)[:, 0]

    def peers(self, dense_copies: bool) -> dict[str, list[Callable[[], torch.Tensor]]]:
        calls = {
            "gather_sdpa": [
                functools.partial(lambda c: self.sdpa(self.gather(c)), c) for c in self.caches
            ]
        }
        if dense_copies:
            dense = [self.gather(c).contiguous() for c in self.caches]
            calls["sdpa_dense"] = [functools.partial(self.sdpa, d) for d in dense]
        return calls

    def flops(self) -> int:
        return 2 * self.heads * (2 * self.L + self.R) * self.batch * self.ctx


def plan_record(plan: Any) -> dict[str, Any]:
    t = plan.tiles
    return {
        "tiles": [t.block_h, t.block_q, t.block_n, t.num_warps, t.num_stages, t.programs_per_sm],
        "hopper": t.hopper,
        "warp_specialized": t.warp_specialized,
        "swap_ab": t.swap_ab,
        "num_segments": plan.split.num_segments if plan.split else 1,
        "segment": plan.split.segment if plan.split else None,
    }


def add_rates(
    rec: dict[str, Any],
    shape: Shape,
    bench: Bench,
    ceilings: dict[str, Any],
    ours_ms: float | None = None,
) -> None:
    if "ms" not in rec:
        return
    rec["tb_s"] = shape.latent_bytes / rec["ms"] / 1e9
    rec["tflop_s"] = shape.flops() / rec["ms"] / 1e9
    if bench.copy_tb_s:
        rec["pct_of_copy"] = 100.0 * rec["tb_s"] / bench.copy_tb_s
    matmul = ceilings.get("matmul_bf16_8192", {}).get("tflop_s")
    if matmul:
        rec["pct_of_matmul"] = 100.0 * rec["tflop_s"] / matmul
    if ours_ms:
        rec["ours_speedup"] = rec["ms"] / ours_ms  # > 1: ours is faster


def tiles_of(values: list[int]) -> Any:
    """`MLATiles` from a `--tiles` list: BH,BQ,BN,WARPS,STAGES[,PROGRAMS_PER_SM[,KERNEL]] with
    KERNEL 0 portable, 1 Hopper lockstep, 2 Hopper warp-specialized, 3 portable with swapped
    products (`swap_ab`); ValueError if invalid."""
    from unified_attn.backends.triton.mla_plan import MLATiles

    kernel = values[6:]
    return MLATiles(*values[:6], hopper=kernel in ([1], [2]), warp_specialized=kernel == [2],
                    swap_ab=kernel == [3])  # fmt: skip


def bench_shape(
    bench: Bench,
    args: argparse.Namespace,
    ceilings: dict[str, Any],
    heads: int,
    batch: int,
    ctx: int,
    gen: torch.Generator,
) -> dict[str, Any]:
    p = args.params
    configs = [tiles_of(t) for t in args.tiles] if args.tiles else [None]
    rec: dict[str, Any] = {"heads": heads, "batch": batch, "ctx": ctx, "ours": []}
    shape = Shape(bench, p, heads, batch, ctx, gen)
    ours_out = None
    for tiles in configs:
        plan, scratch = shape.plan(tiles, args.num_segments)
        try:
            r, out = bench.measure([shape.ours(c, plan, scratch) for c in shape.caches])
            add_rates(r, shape, bench, ceilings)
            ours_out = out if ours_out is None else ours_out
        except Exception as e:  # a tile config that does not compile is recorded, not fatal
            r = {"error": f"{type(e).__name__}: {e}"[:400]}
        rec["ours"].append({**plan_record(plan), **r})
        del scratch
    best = min((r for r in rec["ours"] if "ms" in r), key=lambda r: r["ms"], default={})
    rec.update(latent_bytes=shape.latent_bytes, rotation_buffers=shape.rotations, best=best)
    if not args.no_peers and ours_out is not None:
        dense_fits = not bench.gpu or 3 * shape.latent_bytes < free_bytes()
        for name, calls in shape.peers(dense_fits).items():
            try:
                r, out = bench.measure(calls)
                add_rates(r, shape, bench, ceilings, best.get("ms"))
                r["vs_ours"] = rel_err(ours_out, out)
            except Exception as e:  # a peer that cannot run this shape is recorded, not fatal
                r = {"error": f"{type(e).__name__}: {e}"[:400]}
            rec[name] = r
    del shape
    if bench.gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return rec


def free_bytes() -> int:
    free, _ = torch.cuda.mem_get_info()
    return int(free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
