"""State-layer kernels over pools of state blocks. Mamba-2 (SSD): `conv1d` (the causal depthwise
convolution, varlen and decode), `ssd_chunked` (the chunked scan of prefill), `ssd_update` (the
one-token recurrence of decode); launchers: `backends/triton/ssm_ops.py`. Qwen3-Next's gated
delta rule: `gated_delta_update` (decode), `gated_delta_varlen` (prefill, token by token);
launchers: `backends/triton/gated_delta_ops.py`."""
