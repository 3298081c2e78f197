"""MLA decode benchmark: the Triton weight-absorbed MLA kernel (`mla_ops.mla_attention`) over a
paged latent cache, against a torch peer measured in the same run.

    python benchmarks/mla_decode.py [--out DIR] [--heads 128,16] [--batches 1,16,64,128]
                                    [--contexts 1024,8192,32768] [--num-segments N]
                                    [--tiles BH,BQ,BN,WARPS,STAGES[,PROGRAMS_PER_SM]]
                                    [--no-peers] [--no-plot] [--quick]

Shapes: DeepSeek-V3 decode, H query heads (128, or 16 per rank at TP=8), kv_lora_rank L=512, rope
R=64, page 64, bf16, one query token per request, every request `ctx` tokens long, random data
in a randomly permuted paged cache, softmax scale 192^-0.5.

* ceilings, measured in the same run by the attention benchmark's helper
  (`attn_bench.sections.bench_ceilings`): device-to-device copy bandwidth (read + write) and a
  bf16 8192^3 matmul.
* ours: `plan_mla` (split-KV chosen automatically unless `--num-segments`), the scratch ensured
  before timing, tiles from `mla_tiles` unless `--tiles` (several `--tiles` compare configs).
  Latent bytes = sum over requests of seq_len * (L + R) * 2 (TB/s and % of the copy
  bandwidth); TFLOP/s = 2 * H * (2L + R) * sum(seq_len) (% of the matmul).
* peers (same run, same data): `gather + SDPA`, the paged path in plain torch (gather each
  request's pages into a dense [B, ctx, L + R] tensor, then `scaled_dot_product_attention` with
  the heads as query rows of the one latent KV head: q [B, 1, H, L + R], k [B, 1, ctx, L + R],
  v = k[..., :L]); and `SDPA dense`, the same SDPA on a pre-gathered copy (reads what ours reads).
  FlexAttention is not a peer yet (not tried: its kernels would pad the 576-wide head to 1024).
* checks: ours against a float32 torch oracle at a small ragged shape, and against each peer's
  output at every timed shape (max |diff| / max |ref| <= 2e-2).

Timing: `triton.testing.do_bench` medians through `attn_bench.timing.measure` (buffers rotated
and captured in a CUDA graph when the working set is under 200 MB). Writes `DIR/mla_decode.json`
(rewritten after every shape) and `DIR/mla_decode.png`.

`--quick` is a smoke run at tiny float32 shapes (H 16, L 64, R 16, page 16); without CUDA it runs
in Triton's interpreter with wall-clock medians, and its numbers say nothing about a GPU.

Modules: `config` (shapes, targets, constants), `timing` (`Bench`: GPU or CPU timing, error
metric), `shape` (one shape's data, our launch, the peers and their rates), `checks` (the float32
oracle and the compiled-kernel record), and `report` (verdicts, table, progress line, plot); the
arguments, the run record and `main` stay in `benchmarks/mla_decode.py`.
"""
