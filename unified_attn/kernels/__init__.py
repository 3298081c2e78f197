"""Every Triton and Gluon kernel of the package, by domain; backends and models launch them.

- `attention`: unified paged attention (prefill, decode, mixed), K/V cache writes (fp8 too), the
  log-sum-exp merge of split-KV partials.
- `mla`: DeepSeek MLA with weight absorption over a paged latent cache (portable, and Hopper
  lockstep, warp-specialized and fp8 decode kernels).
- `sparse`: attention over gathered cache rows (DeepSeek-V4's window and selected compressed
  entries; portable and Hopper) and the lightning indexer's scores.
- `moe`: the grouped routed-experts products and the device sort of (token, expert) pairs.
- `hyper`: DeepSeek-V4's hyper-connection weights.
- `invariant`: the batch-invariant ops (matmul, norms, softmax) and their launchers.
- `ssm`: Mamba-2 state layers (the causal convolution, the SSD scan chunked and decode) and
  the gated delta rule's (decode, token-by-token and chunked WY prefill).
- `layers`: a decoder step's fused layers: RMSNorm with the residual add, gated activations
  (SwiGLU, GeGLU), rotary embeddings of q and k in place, the decode-row GEMM with the norm or
  the activation fused before it.

A jit module holds kernels; the launchers that check inputs, plan tiles and launch live in the
backends (`backends/triton/*_ops.py`) or beside the kernels where a model calls them directly
(`moe`, `hyper`, `layers`, `invariant/invariant_launch.py`). Kernels import nothing from the
package.
"""
