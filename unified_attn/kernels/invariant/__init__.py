"""Batch-invariant ops: `invariant_kernels` (jit) and `invariant_launch` (launchers)."""
