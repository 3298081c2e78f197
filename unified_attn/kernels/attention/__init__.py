"""Paged attention kernels: `unified_attention`, `cache_write`, `merge_partials`."""
