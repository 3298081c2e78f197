"""Mamba-2 (SSD) state layers over pools of state blocks: `conv1d` (the causal depthwise
convolution, varlen and decode), `ssd_chunked` (the chunked scan of prefill), `ssd_update`
(the one-token recurrence of decode). Launchers: `backends/triton/ssm_ops.py`."""
