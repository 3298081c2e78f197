"""Tensor parallelism: `tp_group` (`TensorParallelGroup`: rank 0's side, spawning or joining the
other ranks), `tp_rank` (a rank's shard, worker and runner, and its serving loop),
`tp_messages` (the step messages ranks exchange), `tp_codec` (their typed binary format, never
pickle: `tp_frame` its bytes, `tp_wire` its streams, `tp_sampling` the sampling parameters),
`tp_process_group` (the process group and its timeouts). docs/distributed.md."""
