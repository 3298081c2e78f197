"""Paged attention kernels: `unified_attention` (with `merge_segments`, its split-KV merge),
`cache_write`, `merge_partials`."""
