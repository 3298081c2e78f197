"""KV-cache manager micro-benchmarks (CPU, pure Python).

    python benchmarks/kv_manager.py [--quick] [--out benchmarks/results] [--profile] [--no-plot]
    python benchmarks/kv_manager.py --lookup [--quick] [--out DIR]   # lookups only

Workloads (block size 16, fixed seeds, `time.perf_counter_ns`, warm-up before measuring):

* prefill/admission: requests with 1,024-token prompts sharing 4 system prefixes (512 tokens)
  plus random 512-token suffixes, admitted one by one with `get_computed_blocks` +
  `allocate_slots`. Reports allocate_slots calls/s, admissions/s, the prefix-cache hit rate and
  the hashing rate (building `Request` objects with the block hasher), measured separately.
* decode: 256 running requests after their prefill, 64 decode steps; per step
  `new_step_starts()`, then for every request: append one token, `allocate_slots(r, 1)`,
  `num_computed_tokens += 1`. Reports µs per step (all requests): median, p90, mean, max.
* churn: a small pool, distinct prompts, requests admitted and freed continuously so every
  `get_new_blocks` evicts a cached block. Reports allocate_slots calls/s and evictions (blocks
  popped from the free queue that still carried a hash, counted directly by peeking the queue
  head before each allocation, outside the timed region).
* block pool: `BlockPool(N)` for N in 1k, 10k, 100k: `get_new_blocks(k)` / `free_blocks` in
  many rounds (µs per block, should be flat in N), for unhashed blocks (LIFO reuse) and hashed
  blocks (FIFO, every pop evicts), plus `touch` of blocks in the middle of the free queue.
* lookup (`--lookup`, its own run and `<out>/kv_lookup.json`): `get_computed_blocks` alone for
  full attention, full + sliding window 128 and full + sliding window 1024, at 1k and 4k-token
  prompts, with 7/8 of the prompt cached, nothing cached, and (hybrids) the sliding group's
  blocks of the last quarter of the cached prefix evicted; variants interleaved in shuffled
  rounds; mean, median and min µs per call and each hybrid's median over full attention's.

Configurations (all but lookup): full attention only, and hybrid full + sliding window 128.
Results: a rich table on stdout, `<out>/kv_manager.json`, and `<out>/kv_manager.png` when
matplotlib is installed. Every number is measured; nothing is estimated.

Modules: `config` (configurations, targets, parameters), `workloads` (managers, prompts,
requests, admission), one module per section (`prefill`, `decode`, `churn`, `block_pool`,
`lookup`), `decode_profile` (cProfile of the hybrid decode), `verdicts`, `report`, `plot`, and
`cli` (arguments and `main`).
"""
