"""Multi-head latent attention (MLA, DeepSeek-V2/V3) through the unified contract: the reference
backend, plain torch on any device.

**Cache.** One latent vector per token serves as key and value of every head:
`[c_kv (kv_lora_rank = L), k_pe (qk_rope_head_dim = R)]`, stored by `LatentKVSpec(L + R)` as
`[num_blocks, block_size, L + R]` under the full-attention manager (sliding window when the
backend has one). The backend is built with `num_kv_heads=1`, `head_size=L + R` and the
option `kv_lora_rank=L`; its layers' `LayerConfig` have `num_kv_heads=1`, `head_size=L + R`,
`num_heads=H` and `scale` = the model's softmax scale (`qk_head_dim ** -0.5`, times YaRN's
`mscale ** 2` where the model has one).

**`forward(layer, output, query, key, value, *, kv_b_proj)`**, with N = `qk_nope_head_dim`,
V = `v_head_dim`:

- `query [T, H, N + R]` (or `[T, H * (N + R)]`): per-head queries, the no-RoPE part `q_nope`
  first, then `q_pe` with RoPE applied.
- `key [T, L + R]` (or `[T, 1, L + R]`): the new latent entries, `kv_a_layernorm(c_kv)` then the
  roped `k_pe`; written into the cache at the group's slot mapping (slot -1: nothing written).
- `value`: not read (the latent is the value too); pass `key` again. It must have key's shape
  and dtype.
- `output [T, H * V]` (or `[T, H, V]`): filled and returned.
- `kv_b_proj [H * (N + V), L]`: the layer's up-projection weight (transformers' `kv_b_proj.weight`).
  Viewed as `[H, N + V, L]` it splits, without a copy, into `W_UK [H, N, L]` (rows `:N`) and
  `W_UV [H, L, V]` (rows `N:`, transposed).

**Math.** Head h's key of token s is `[W_UK[h] @ c_s, k_pe_s]` and its value `W_UV[h]^T c_s`.
*Absorbed* rows fold `W_UK` into the query instead, `q_abs = [q_nope @ W_UK, q_pe] [T, H, L + R]`,
attend over the latent cache directly (the same scores: `q_nope . (W_UK c) = (q_nope W_UK) . c`),
get a latent output `[T, H, L]` (the probability-weighted sum of `c`) and project it once with
`W_UV` to `[T, H, V]`. *Up-projected* rows expand every cached latent of their request to per-head
K `[S, H, N + R]` and V `[S, H, V]` and attend causally, as a plain MHA prefill.

Here decode rows (query length 1) are absorbed, longer rows (prefill, chunked prefill, draft
verification) up-projected; a subclass setting `absorb_prefill = True` sends every row through
the absorbed path in one call (the same math; up-projection is the faster choice for long
prefills on real hardware, absorption for decode).

**Seams for a kernel backend.** A subclass replaces only these two methods:

- `write_latent(latent [T, L + R], cache [N_blocks, bs, L + R], slot_mapping [T] int64)`;
- `absorbed_attention(q_abs [T, H, L + R], cache, block_table [B, max_blocks] int32,
  query_start_loc [B + 1] int32, seq_lens [B] int32, scale, out [T, H, L])`: causal over any
  query lengths (the token at absolute position p sees keys 0..p); rows past
  `query_start_loc[B]` are padding. It takes no window: this backend passes its own
  `sliding_window` to `reference_absorbed_attention`, and a subclass whose kernel has none must
  refuse windows in `validate_configuration`.

The plain-torch versions, `reference_write_latent` and `reference_absorbed_attention`
(`backends/mla_math.py`), only read device tensors (no host sync) and serve as the kernels' test
oracles.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

from unified_attn.backend import (
    AttentionBackend,
    AttentionType,
    CacheConfig,
    CommonAttentionMetadata,
    LayerConfig,
    refuse_soft_cap,
    soft_cap_reasons,
)
from unified_attn.backends.kv_quant import (
    FP8KVBackend,
    dequantize_fp8,
    kv_cache_dtype_reasons,
    quantize_fp8,
)
from unified_attn.backends.mla_checks import check_mla_tensor, construction_problems, row_size
from unified_attn.backends.mla_math import (
    absorb_query,
    project_latent_out,
    reference_absorbed_attention,
    reference_write_latent,
    up_projected_attention,
)
from unified_attn.managers import FullAttentionManager, SlidingWindowManager
from unified_attn.selector import SelectorConfig, register_backend
from unified_attn.tensor_specs import LatentKVSpec


@attrs.frozen
class MLAGroupIndex:
    """Where one KV-cache group's layers write and read in a step (device tensors)."""

    slot_mapping: torch.Tensor  # [T] int64 slot of each new token, -1 = padding
    block_table: torch.Tensor  # [Ba, max_blocks] int32: rows of the absorbed requests
    # up-projected request -> (block id [S_i], offset [S_i]) of each of its key positions
    prefill_keys: dict[int, tuple[torch.Tensor, torch.Tensor]]


@attrs.frozen
class MLAPlan:
    """One step: the absorbed requests as one batch, the others one by one."""

    absorbed_tokens: torch.Tensor | None  # device [Ta] int64 token rows; None = every row
    absorbed_qsl: torch.Tensor  # device [Ba + 1] int32 query start of each absorbed request
    absorbed_seq_lens: torch.Tensor  # device [Ba] int32
    prefill: list[tuple[int, int, int, int]]  # host: (request, first row, end row, computed)
    groups: dict[int, MLAGroupIndex]  # KV-cache group id -> its indices
    launch: Any = None  # a kernel subclass's launch plan (`launch_plan`); None here


@register_backend(priority={"cpu": 100, "cuda": 10})
class MLAReferenceBackend(FP8KVBackend[MLAPlan], AttentionBackend[MLAPlan]):
    name = "mla-reference"
    layer_kinds = ("mla",)
    # True: every row through `absorbed_attention` (one call per layer and step).
    absorb_prefill: ClassVar[bool] = False

    def __init__(self, *, kv_lora_rank: int, num_kv_heads: int = 1, **kwargs: Any) -> None:
        super().__init__(num_kv_heads=num_kv_heads, **kwargs)
        problems = construction_problems(self, kv_lora_rank)
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = self.head_size - kv_lora_rank

    @classmethod
    def validate_configuration(cls, cfg: SelectorConfig) -> list[str]:
        reasons = kv_cache_dtype_reasons(cls.name, cfg)
        if cfg.attn_type != AttentionType.DECODER:
            reasons.append(f"MLA layers are causal decoder layers, not {cfg.attn_type.value}")
        if cfg.attention_chunk_size is not None:
            reasons.append("chunked local attention is not supported")
        if cfg.has_sinks:
            reasons.append("learned sinks are not supported")
        return reasons + soft_cap_reasons(cfg)

    def get_cache_config(self) -> CacheConfig:
        spec = LatentKVSpec(self.head_size, self.kv_cache_dtype)
        if self.sliding_window is not None:
            config = SlidingWindowManager.Config(sliding_window=self.sliding_window)
            return SlidingWindowManager, config, spec
        return FullAttentionManager, FullAttentionManager.Config(), spec

    def check_layer(self, layer: LayerConfig) -> None:
        super().check_layer(layer)
        refuse_soft_cap(layer, "MLA backends")

    # ---- the step --------------------------------------------------------------------------

    def prep_forward(
        self,
        common: CommonAttentionMetadata,
        block_tables: dict[int, torch.Tensor],
        for_cudagraph_capture: bool = False,
    ) -> None:
        num_reqs = common.num_reqs
        qsl, seq_lens, computed = common.host_lists()
        lens = [qsl[i + 1] - qsl[i] for i in range(num_reqs)]
        long_rows = [] if self.absorb_prefill else [i for i in range(num_reqs) if lens[i] > 1]
        prefill = [(i, qsl[i], qsl[i + 1], computed[i]) for i in long_rows]
        absorbed = None if self.absorb_prefill else [i for i in range(num_reqs) if lens[i] == 1]
        gids = set(self.group_of_layer.values())
        self.plan = MLAPlan(
            *self._absorbed_batch(common, absorbed, qsl, seq_lens),
            prefill=prefill,
            groups={
                gid: self._group_index(common, gid, block_tables[gid], absorbed, prefill, seq_lens)
                for gid in gids
            },
            launch=self.launch_plan(common, for_cudagraph_capture),
        )
        if self.kv_scales is not None:  # fp8 cache: calibrate the layers in this step?
            self.kv_scales.begin_step(common.num_actual_tokens > 0, for_cudagraph_capture)

    def launch_plan(self, common: CommonAttentionMetadata, for_cudagraph_capture: bool) -> Any:
        """Host planning a kernel subclass needs for `absorbed_attention` (tiles, split-KV,
        scratch sizing), stored in the plan's `launch`; the reference needs none."""
        return None

    @staticmethod
    def _absorbed_batch(
        common: CommonAttentionMetadata,
        absorbed: list[int] | None,
        qsl: list[int],
        seq_lens: list[int],
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(token rows, query start loc, sequence lengths) of the absorbed requests: the
        runner's own tensors when every request is absorbed."""
        if absorbed is None:
            return None, common.query_start_loc, common.seq_lens
        device = common.positions.device
        tokens = torch.tensor([qsl[i] for i in absorbed], dtype=torch.long, device=device)
        starts = torch.arange(len(absorbed) + 1, dtype=torch.int32, device=device)
        lens = torch.tensor([seq_lens[i] for i in absorbed], dtype=torch.int32, device=device)
        return tokens, starts, lens

    def _group_index(
        self,
        common: CommonAttentionMetadata,
        gid: int,
        block_table: torch.Tensor,
        absorbed: list[int] | None,
        prefill: list[tuple[int, int, int, int]],
        seq_lens: list[int],
    ) -> MLAGroupIndex:
        device = common.positions.device
        bs = self._block_size(gid)
        prefill_keys = {}
        table = block_table.cpu().long() if prefill else block_table  # host copy only if read
        for i, *_ in prefill:
            pos = torch.arange(seq_lens[i])
            prefill_keys[i] = (table[i, pos // bs].to(device), (pos % bs).to(device))
        rows = block_table if absorbed is None else block_table[absorbed]
        return MLAGroupIndex(common.slot_mappings[gid], rows, prefill_keys)

    def _block_size(self, gid: int) -> int:
        """Tokens per block of group `gid`, read off a bound cache view."""
        for name, group in self.group_of_layer.items():
            if group == gid:
                return int(self.kv_caches[name].shape[1])
        raise KeyError(f"no layer of this backend is in KV-cache group {gid}")

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        q, latent, out, w_uk, w_uv = self.check_mla_inputs(
            layer, output, query, key, value, kwargs.get("kv_b_proj")
        )
        plan = self.current_plan()
        index = plan.groups[self.group_of_layer[layer.name]]
        cache = self.kv_caches[layer.name]  # [num_blocks, block_size, L + R]
        slots = index.slot_mapping
        latent = latent[: slots.shape[0]]
        # fp8: the latent is both key and value, its scale the K one (calibrated on the rows
        # with a slot); None for a cache of the model dtype
        scales = self._layer_scales(layer, kwargs.get("kv_scales"), latent, latent, slots)
        scale = None if scales is None else scales[0]
        self.write_latent(latent if scale is None else quantize_fp8(latent, scale), cache, slots)
        self._absorbed_rows(layer, out, q, cache, index, plan, w_uk, w_uv, scale)
        for request, start, end, computed in plan.prefill:
            blocks, offsets = index.prefill_keys[request]
            latents = cache[blocks, offsets]
            if scale is not None:
                latents = dequantize_fp8(latents, scale)
            out[start:end] = up_projected_attention(
                layer, q[start:end], latents, computed, w_uk, w_uv
            )
        return output

    def _absorbed_rows(
        self,
        layer: LayerConfig,
        out: torch.Tensor,
        q: torch.Tensor,
        cache: torch.Tensor,
        index: MLAGroupIndex,
        plan: MLAPlan,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        """Absorb, attend over the latent cache (fp8: dequantized with `kv_scale`), project the
        latent output with W_UV."""
        tokens = plan.absorbed_tokens
        if tokens is not None and tokens.shape[0] == 0:
            return
        q_rows = q if tokens is None else q[tokens]
        q_abs = absorb_query(q_rows, w_uk)  # [Ta, H, L + R]
        latent_out = q_abs.new_empty(*q_abs.shape[:2], self.kv_lora_rank)  # [Ta, H, L]
        self.absorbed_attention(
            q_abs, cache, index.block_table, plan.absorbed_qsl, plan.absorbed_seq_lens,
            layer.scale, latent_out, kv_scale=kv_scale,
        )  # fmt: skip
        if tokens is None:  # every row absorbed: straight into the layer's output
            project_latent_out(latent_out, w_uv, out)
            return
        values = latent_out.new_empty(tokens.shape[0], *out.shape[1:])  # [Ta, H, V]
        project_latent_out(latent_out, w_uv, values)
        out[tokens] = values

    # ---- the seams a kernel backend replaces -------------------------------------------------

    def write_latent(
        self, latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Write `latent [T, L + R]` at `slot_mapping [T]` (-1: skip) of `cache`."""
        reference_write_latent(latent, cache, slot_mapping)

    def absorbed_attention(
        self,
        q_abs: torch.Tensor,
        cache: torch.Tensor,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        *,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        """Paged causal attention of `q_abs [T, H, L + R]` over the latent cache into
        `out [T, H, L]` (see the module docstring); an fp8 cache is dequantized with the 0-dim
        float32 `kv_scale`."""
        reference_absorbed_attention(
            q_abs, cache, block_table, query_start_loc, seq_lens, scale, out,
            sliding_window=self.sliding_window, kv_scale=kv_scale,
        )  # fmt: skip

    # ---- input checks ----------------------------------------------------------------------

    def check_mla_inputs(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_b_proj: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        """Validate shapes, dtypes and devices; return q `[T, H, N + R]`, latent `[T, L + R]`,
        out `[T, H, V]`, W_UK `[H, N, L]` and W_UV `[H, L, V]` (views, no copies)."""
        if kv_b_proj is None:
            raise ValueError(
                f"layer {layer.name}: MLA forward needs the keyword argument kv_b_proj (the "
                "layer's kv_b_proj.weight [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank])"
            )
        num_tokens, heads, width = query.shape[0], layer.num_heads, self.head_size
        rope, rank = self.qk_rope_head_dim, self.kv_lora_rank
        q_dim = row_size(query) // heads  # N + R
        v_dim = row_size(output) // heads
        if q_dim <= rope or v_dim == 0:
            raise ValueError(
                f"layer {layer.name}: query has {q_dim} values per head and output {v_dim}; "
                f"expected qk_nope_head_dim + {rope} (qk_rope_head_dim) with qk_nope_head_dim "
                "> 0, and v_head_dim > 0"
            )
        expected = {
            "query": (query, (num_tokens, heads * q_dim)),
            "key": (key, (num_tokens, width)),
            "value": (value, (num_tokens, width)),
            "output": (output, (num_tokens, heads * v_dim)),
            "kv_b_proj": (kv_b_proj, (heads * (q_dim - rope + v_dim), rank)),
        }
        for what, (tensor, shape) in expected.items():
            check_mla_tensor(layer, what, tensor, shape, self.dtype, query.device)
        nope = q_dim - rope
        w = kv_b_proj.view(heads, nope + v_dim, rank)
        return (
            query.view(num_tokens, heads, q_dim),
            key.view(num_tokens, width),
            output.view(num_tokens, heads, v_dim),
            w[:, :nope],
            w[:, nope:].transpose(1, 2),
        )
