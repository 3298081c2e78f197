"""The fused layers of a decoder step: RMSNorm (with the residual add), gated activations and
rotary embeddings. Each `*_jit.py` holds the kernels, the module of the same name without the
suffix checks inputs and launches (`norm`, `activation`, `rotary`); the models' torch code is
the reference."""
