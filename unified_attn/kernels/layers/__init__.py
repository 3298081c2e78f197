"""The fused layers of a decoder step: RMSNorm (with the residual add), gated activations,
rotary embeddings, and the decode-row GEMM with either fused before it (`skinny_gemm`). Each
`*_jit.py` holds the kernels, the module of the same name without the suffix checks inputs and
launches (`norm`, `activation`, `rotary`, `skinny_gemm`); the models' torch code is the
reference."""
