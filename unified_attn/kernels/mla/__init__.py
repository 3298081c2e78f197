"""DeepSeek MLA kernels: `mla_attention` (portable), `mla_attention_sm90`, `mla_decode_sm90_ws`,
`mla_decode_sm90_fp8` (Hopper, Gluon)."""
