"""Attention-kernel benchmark on one GPU: the Triton unified paged kernel against same-run peers.

    python benchmarks/attention.py --out DIR [--quick] [--no-flex] [--no-plot] [--budget-s S]
                                   [--sections decode,prefill,window,features,split]

Shapes: 32 query heads / 8 KV heads / head size 128, bf16, page (block) size 16, random data,
random non-contiguous block tables (a random permutation of block ids).

* ceilings (always): device-to-device copy bandwidth (bytes read + written, 2 GiB buffers) and a
  bf16 8192^3 matmul, measured in the same run; decode figures are reported as a fraction of the
  copy bandwidth.
* decode: batch x context grid, uniform lengths and a skewed variant (lognormal lengths, same total
  tokens). Ours uses `TritonAttentionBackend.plan_split` for split-KV and a pre-sized
  `SplitScratch`. Bytes read = K+V of the visible tokens + Q + output; reported as TB/s and % of
  the copy bandwidth. Peers: torch SDPA (FLASH_ATTENTION and CUDNN_ATTENTION backends) on dense
  contiguous K/V, once with `enable_gqa=True` (q [B, 32, 1, D], k/v [B, 8, L, D]) and once with the
  query heads of a KV head packed as query rows (q [B, 8, 4, D], non-causal: the same math);
  compiled FlexAttention dense (length block mask) and paged (gather-free: the block mask points at
  physical pages of a [1, 8, pages * 16, D] cache; torch's experimental `PagedAttention` when
  importable, else an equivalent inverse-page-table mask_mod). Peers read the same data as ours
  (derived from our cache), so outputs are cross-checked.
* prefill: causal, one sequence and batch 4, L in 2k..32k; TFLOP/s with
  FLOPs = 4 * sum over queries of visible keys * Hq * D; peers SDPA flash / cuDNN (is_causal) and
  compiled FlexAttention (causal block mask).
* window: W=1024 at L=32k (ours) against our full causal at 32k: speedup as % of the tile-count
  ideal L / (2W); FlexAttention with a sliding-window mask_mod for reference.
* features: sinks (random [32] float32) and soft cap 30 against plain, decode B=32 ctx 8k and
  prefill 8k: % overhead.
* split: decode B=1 at 32k with the split plan against `split=None`.

Timing: `triton.testing.do_bench(warmup=25, rep=100, return_mode="median")`, which clears L2
before every call; when a call's working set is under 200 MB, several buffers are rotated and the
rotation is captured in a CUDA graph (median graph time / calls). Every output is checked finite
before timing; ours is compared with an fp32 reference at small shapes in every section and with
the peers at the timed shapes (max |diff| / max |ref|, bf16 tolerance 2e-2). FlexAttention compile
time is excluded (first call), recorded as `first_call_s`. Progress lines are flushed as they come;
`DIR/attention.json` is rewritten after every shape, the table and `DIR/attention.png` come at the
end (also on SIGTERM / Ctrl-C, then with exit code 1). A soft time budget (`--budget-s`) skips
FlexAttention compiles and further shapes, recording them as skipped, once it runs short. Without
CUDA the script exits with code 2.

Modules: `config` (shapes, targets, parameters), `run` (the run record and its JSON), `timing`,
`data` and `meta` (inputs, block tables, our launch), `reference` (fp32 checks), `peers` (SDPA and
FlexAttention), one module per section (`decode`, `prefill`, and `sections` for the ceilings,
window, features and split), `verdicts`, `report`, `plot`, and `cli` (arguments and `main`).
"""
