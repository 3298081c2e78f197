"""`DecoderModel`: a Llama-family decoder whose layers attend through shared backend instances.

Parameter names are Hugging Face's, so a checkpoint loads as a plain state dict (after the
renames some architectures declare, `hf_families.WEIGHT_RENAMES`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, cast

import torch
from torch import nn

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.backend.state_layers import STATE_OPTIONS
from unified_attn.models.attention_model import CausalLM
from unified_attn.models.config import LayerKind, ModelConfig
from unified_attn.models.fused import fused_by_default, set_fused_layers, skinny_row_limit
from unified_attn.models.invariant import invariant_linear, make_batch_invariant
from unified_attn.models.layers import (
    FLOAT32_PARAMS,
    DecoderLayer,
    RMSNorm,
    make_layer_config,
    norm_identity,
)
from unified_attn.models.rope import RotaryEmbedding
from unified_attn.selector import SelectorConfig, select_backend

# (kind, sliding_window, attention_chunk_size, sink tokens): layers with equal keys share a backend
BackendKey = tuple[str, int | None, int | None, int]


def _backend_key(kind: LayerKind) -> BackendKey:
    return (kind.kind if kind.is_state else "attention", kind.window, kind.chunk,
            kind.sink_tokens)  # fmt: skip


class _Backbone(nn.Module):
    """The `model.` prefix of the parameter names."""

    rotary_emb_local: RotaryEmbedding | None

    def __init__(self, config: ModelConfig, backends: dict[BackendKey, AttentionBackend]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config)
        # the local layers' own RoPE (Gemma 3), when the config gives one
        local = config.local_rope_theta is not None
        self.rotary_emb_local = RotaryEmbedding(config, local=True) if local else None
        self.layers = nn.ModuleList(
            DecoderLayer(
                config,
                i,
                kind,
                make_layer_config(config, i, kind),
                backends[_backend_key(kind)],
                None if i in config.nope_layers else self._rotary_of(kind),
            )
            for i, kind in enumerate(config.layer_kinds)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_style)

    def _rotary_of(self, kind: LayerKind) -> RotaryEmbedding:
        if self.rotary_emb_local is not None and kind.is_local:
            return self.rotary_emb_local
        return self.rotary_emb

    def _rotaries(self) -> list[RotaryEmbedding]:
        return [r for r in (self.rotary_emb, self.rotary_emb_local) if r is not None]

    def reset_rotary_buffers(self, device: torch.device | str) -> None:
        for rotary in self._rotaries():
            rotary.reset_buffers(device)

    @contextmanager
    def rotary_step(self, positions: torch.Tensor) -> Iterator[None]:
        """The fused RoPE tables of `positions`, computed once for every layer."""
        with ExitStack() as stack:
            for rotary in self._rotaries():
                stack.enter_context(rotary.step(positions))
            yield


class DecoderModel(CausalLM[ModelConfig, BackendKey]):
    """Inference-only decoder. Weights start as zeros (norms as the identity): call
    `init_random_weights` or load a state dict (see `load_hf_model`).

    `backend_options={"batch_invariant": True}` builds the backends in batch-invariant mode and
    swaps the model's matmuls, norms and router for their batch-invariant forms
    (`models/invariant`), the LM head included: a row's logits then never depend on the
    batch. Otherwise a model built on CUDA runs the fused layers (`use_fused_layers`) unless
    `UNIFIED_ATTN_FUSED_LAYERS=0` (`models/fused.py`)."""

    model: _Backbone
    batch_invariant: bool

    def _build(self) -> None:
        self.model = _Backbone(self.config, self.backends)
        self._build_lm_head()

    def _materialize(self, device: torch.device | str, options: dict[str, Any]) -> None:
        super()._materialize(device, options)
        self.embed_scale = _in_dtype(self.config.embed_scale, self.dtype)
        self.batch_invariant = False
        if options.get("batch_invariant", False):
            make_batch_invariant(self)
        elif fused_by_default() and torch.device(device).type == "cuda":  # checked everywhere
            self.use_fused_layers()
        skinny_row_limit()  # a bad UNIFIED_ATTN_SKINNY_GEMM(_ROWS) is refused on every device too

    def use_fused_layers(self, enabled: bool = True) -> None:
        """Norms (with their residual adds), gated activations and RoPE as the Triton kernels
        of `kernels/layers`, separate q/k/v and gate/up projections as one GEMM each
        (`models/fused.py`), or (`enabled=False`) the torch code. On CUDA by default (off with
        `UNIFIED_ATTN_FUSED_LAYERS=0`); elsewhere only under Triton's interpreter (tests).
        Batch-invariant mode keeps the torch code, whose invariant forms it swapped in."""
        if enabled and self.batch_invariant:
            raise ValueError(
                "use_fused_layers: this model runs in batch-invariant mode, which keeps its "
                "invariant torch layers; build it without batch_invariant to fuse them"
            )
        set_fused_layers(self, enabled)

    def _cast(self) -> None:
        super()._cast()
        for name, param in self.named_parameters():
            if name.endswith(FLOAT32_PARAMS):
                param.data = param.data.float()

    def _reset_rotary(self, device: torch.device | str) -> None:
        self.model.reset_rotary_buffers(device)

    def _make_backends(
        self, backend_cls: type[AttentionBackend], options: dict[str, Any], device: torch.device
    ) -> dict[BackendKey, AttentionBackend]:
        """One instance per distinct attention kind, in first-seen layer order. State layers
        use the backend the selector picks for their layer kind, whatever attention backend
        was selected."""
        config, dtype = self.config, self.dtype
        state_options = {k: v for k, v in options.items() if k in STATE_OPTIONS}
        options = {k: v for k, v in options.items() if k not in STATE_OPTIONS}
        backends: dict[BackendKey, AttentionBackend] = {}
        for kind in config.layer_kinds:
            key = _backend_key(kind)
            if key in backends:
                continue
            if kind.is_state:
                state_cls = select_backend(
                    SelectorConfig(
                        head_size=config.head_size,
                        dtype=dtype,
                        # a model built on "meta" (planning only) selects as on the CPU
                        device="cpu" if device.type == "meta" else device.type,
                        use_batch_invariant=options.get("batch_invariant", False),
                        layer_kind=kind.kind,
                    )
                )
                backends[key] = state_cls(**self._state_shape(kind), dtype=dtype, **options,
                                          **state_options)  # fmt: skip
            else:
                backends[key] = backend_cls(
                    num_kv_heads=config.num_kv_heads,
                    head_size=config.head_size,
                    dtype=dtype,
                    sliding_window=kind.window,
                    attention_chunk_size=kind.chunk,
                    num_sink_tokens=kind.sink_tokens,
                    **options,
                )
        return backends

    def _state_shape(self, kind: LayerKind) -> dict[str, Any]:
        """The state backend's shape arguments for layers of `kind`."""
        config, delta = self.config, self.config.gated_delta
        if kind.kind == "gated_delta" and delta is not None:
            return dict(num_heads=delta.num_v_heads, head_size=delta.v_head_size,
                        num_k_heads=delta.num_k_heads, k_head_size=delta.k_head_size,
                        conv_kernel=delta.conv_kernel, chunk_size=delta.chunk_size)  # fmt: skip
        return dict(num_heads=config.num_heads, head_size=config.head_size)

    def attention_layers(self) -> Iterator[tuple[LayerConfig, AttentionBackend]]:
        for layer in self.model.layers:
            attn = cast(DecoderLayer, layer).self_attn
            yield cast(LayerConfig, attn.layer_config), cast(AttentionBackend, attn.backend)

    def _fill_constant(self) -> None:
        identity = norm_identity(self.config.norm_style)
        for name, param in self.named_parameters():
            param.data.fill_(_constant(name, identity) or 0.0)

    @torch.no_grad()
    def init_random_weights(self, seed: int) -> None:
        """Deterministic on any device: normal(0, 0.02) drawn on CPU in float32, norms the
        identity (1, or 0 for the Gemma norm style; a gated delta-net's gated norm 1)."""
        identity = norm_identity(self.config.norm_style)
        self._init_random_parameters(seed, lambda name: _constant(name, identity))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions `[T]` int64 -> final-normed hidden `[T, hidden_size]`.

        The step's metadata must already be in the backends (`prep_forward`)."""
        hidden = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        residual = None
        with self.model.rotary_step(positions):
            for layer in self.model.layers:
                hidden, residual = layer(positions, hidden, residual)
        return self.model.norm.forward_residual(hidden, cast(torch.Tensor, residual))[0]

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden `[N, hidden_size]` -> logits `[N, vocab_size]` float32 (soft-capped in the
        model dtype with `final_logit_softcap`, as transformers)."""
        linear = invariant_linear if self.batch_invariant else nn.functional.linear
        logits = linear(hidden, self._head_weight())
        if self.gather_logits is not None:
            logits = self.gather_logits(logits)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


def _constant(param_name: str, identity: float) -> float | None:
    """The value a parameter starts at whatever the seed (None: random): norms the identity
    (`identity` for the model's norms, 1 for a gated delta-net's gated norm and `dt_bias`)."""
    if param_name.endswith(("self_attn.norm.weight", ".dt_bias")):
        return 1.0
    return identity if param_name.endswith("norm.weight") else None


def _in_dtype(value: float | None, dtype: torch.dtype) -> float | None:
    """`value` rounded to `dtype` (via float32), as transformers' Gemma embedding scale buffer."""
    if value is None:
        return None
    return float(torch.tensor(value, dtype=torch.float32).to(dtype))
