"""Model configuration: shapes, RoPE, and the attention kind of every layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from unified_attn.models.gated_delta_config import GatedDeltaConfig
from unified_attn.utils import (
    optional_positive,
    optional_positive_int,
    positive,
    positive_int,
)

LayerKindName = Literal["full", "sliding", "chunked", "streaming", "linear_state", "gated_delta"]
RopeType = Literal["llama3", "linear", "yarn"]
NormStyle = Literal["llama", "gemma", "float32"]
MLPKind = Literal["swiglu", "geglu", "moe"]
ExpertKind = Literal["clamped_swiglu", "swiglu"]
RouterSoftmax = Literal["top_k", "all", "sigmoid"]
RopeStyle = Literal["neox", "interleaved"]
RoutingDType = Literal["float32", "model"]


def check_choices(owner: str, config: Any, choices: Mapping[str, tuple[str, ...]]) -> None:
    """A `ValueError` naming the first field of `config` whose value is not among its `choices`
    (attrs does not check `Literal` fields); `owner` starts the message."""
    for field, valid in choices.items():
        if getattr(config, field) not in valid:
            raise ValueError(
                f"{owner}: {field} must be one of {valid}, got {getattr(config, field)!r}"
            )


def require_multiple(owner: str, config: Any, field: str, divisor: str) -> None:
    """A `ValueError` unless `config.<field>` is a multiple of `config.<divisor>`."""
    value, by = getattr(config, field), getattr(config, divisor)
    if value % by:
        raise ValueError(f"{owner}: {field}={value} is not a multiple of {divisor}={by}")


def as_token_ids(value: Any) -> tuple[int, ...]:
    """attrs converter: config.json's token id (an int, a list or null) as a tuple."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (int(value),)


@attrs.frozen
class LayerKind:
    """How one decoder layer attends.

    `full`: every earlier token. `sliding`: a query at position p sees keys `[p - window + 1, p]`.
    `chunked`: keys in the query's chunk `[p // chunk * chunk, p]`. `streaming` (StreamingLLM):
    the window plus the first `sink_tokens` tokens, kept forever (`StreamingSinkManager`).
    `linear_state`: gated linear attention whose state lives in KV-cache state blocks
    (`LinearStateBackend`, `StateManager`). `gated_delta`: Qwen3-Next's gated delta-net
    (`GatedDeltaStateBackend`, shapes in `ModelConfig.gated_delta`). `has_sinks`: the layer owns a
    learned per-head sink logit (`self_attn.sinks [num_heads]`, GPT-OSS) that takes probability
    mass without contributing a value. Later per-layer features are new optional fields here,
    defaulting to "off".
    """

    kind: LayerKindName = "full"
    window: int | None = attrs.field(default=None, validator=optional_positive_int)
    chunk: int | None = attrs.field(default=None, validator=optional_positive_int)
    has_sinks: bool = attrs.field(default=False, kw_only=True)
    sink_tokens: int = attrs.field(default=0, kw_only=True)

    def __attrs_post_init__(self) -> None:
        needs = {
            "full": (False, False),
            "sliding": (True, False),
            "chunked": (False, True),
            "streaming": (True, False),
            "linear_state": (False, False),
            "gated_delta": (False, False),
        }
        if self.kind not in needs:
            raise ValueError(f"LayerKind.kind must be one of {sorted(needs)}, got {self.kind!r}")
        if needs[self.kind] != (self.window is not None, self.chunk is not None):
            raise ValueError(
                f"LayerKind({self.kind!r}) got window={self.window}, chunk={self.chunk}: "
                "'sliding' and 'streaming' need exactly a window, 'chunked' exactly a chunk, "
                "'full' and the state kinds neither"
            )
        if (self.kind == "streaming") != (self.sink_tokens > 0) or self.sink_tokens < 0:
            raise ValueError(
                f"LayerKind({self.kind!r}) got sink_tokens={self.sink_tokens}: only 'streaming' "
                "layers keep sink tokens, and they need at least one"
            )

    @classmethod
    def full(cls, *, has_sinks: bool = False) -> LayerKind:
        return cls("full", has_sinks=has_sinks)

    @classmethod
    def sliding(cls, window: int, *, has_sinks: bool = False) -> LayerKind:
        return cls("sliding", window=window, has_sinks=has_sinks)

    @classmethod
    def chunked(cls, chunk: int, *, has_sinks: bool = False) -> LayerKind:
        return cls("chunked", chunk=chunk, has_sinks=has_sinks)

    @classmethod
    def streaming(cls, window: int, sink_tokens: int) -> LayerKind:
        return cls("streaming", window=window, sink_tokens=sink_tokens)

    @classmethod
    def linear_state(cls) -> LayerKind:
        return cls("linear_state")

    @classmethod
    def gated_delta(cls) -> LayerKind:
        return cls("gated_delta")

    @property
    def is_state(self) -> bool:
        """A recurrent-state layer (its cache is one state per request, not keys and values)."""
        return self.kind in ("linear_state", "gated_delta")

    @property
    def is_local(self) -> bool:
        """Attends to a window or a chunk (Gemma 3's "local" layers), not the whole prefix."""
        return self.window is not None or self.chunk is not None


@attrs.frozen(kw_only=True)
class RopeScaling:
    """RoPE frequency scaling. `llama3`: Llama 3.1 smooth scaling; `linear`: divide by factor;
    `yarn`: YaRN (GPT-OSS), interpolation blended by a ramp between the `beta_fast` and `beta_slow`
    rotation counts, and cos/sin multiplied by an attention factor (given, or from `factor`,
    `mscale` and `mscale_all_dim` as transformers infers it)."""

    rope_type: RopeType = "llama3"
    factor: float = attrs.field(validator=positive)
    low_freq_factor: float = attrs.field(default=1.0, validator=positive)
    high_freq_factor: float = attrs.field(default=4.0, validator=positive)
    original_max_position_embeddings: int = attrs.field(default=8192, validator=positive_int)
    beta_fast: float = attrs.field(default=32.0, validator=positive)
    beta_slow: float = attrs.field(default=1.0, validator=positive)
    truncate: bool = True
    attention_factor: float | None = attrs.field(default=None, validator=optional_positive)
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.rope_type not in ("llama3", "linear", "yarn"):
            raise ValueError(
                "RopeScaling.rope_type must be 'llama3', 'linear' or 'yarn', got "
                f"{self.rope_type!r}"
            )
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"llama3 RoPE scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


@attrs.frozen(kw_only=True)
class AttnTemperature:
    """Llama 4's attention temperature tuning of its NoPE layers: the query at position p is
    multiplied by `1 + attn_scale * log1p(floor((p + 1) / floor_scale))`."""

    floor_scale: float = attrs.field(validator=positive)
    attn_scale: float = attrs.field(validator=positive)


@attrs.frozen(kw_only=True)
class MoEConfig:
    """Mixture of experts: a linear router picks `top_k` of `num_experts` experts per token.

    The defaults are GPT-OSS: `expert_kind="clamped_swiglu"` (router `mlp.router` with a bias,
    experts as batched tensors with biases, each a clamped SwiGLU
    `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = clamp(gate, max=limit)`),
    `router_softmax="top_k"` (softmax over the chosen logits only).

    Mixtral and Qwen2-MoE: `expert_kind="swiglu"` (router `mlp.gate` without bias, experts
    `mlp.experts.{e}` as plain SwiGLU MLPs without biases), `router_softmax="all"` (softmax over
    every expert in float32, then the top-k probabilities, renormalised to sum 1 when
    `norm_topk_prob`), the weights kept in float32 (Mixtral) or rounded to the model dtype
    (`routing_weights_dtype="model"`, Qwen2-MoE). `intermediate_size`: the experts' (None: the
    model's).
    `shared_expert_intermediate_size` (Qwen2-MoE): a SwiGLU `mlp.shared_expert` run on every
    token, scaled by `sigmoid(mlp.shared_expert_gate(x))` and added (None: no shared expert).

    Llama 4: `router_softmax="sigmoid"` (the sigmoid of each chosen logit, no normalisation)
    and `scale_input` (the routing weight multiplies the chosen expert's input, not its output;
    the shared expert is not gated), with `expert_kind="swiglu"`; router `mlp.router`.
    """

    num_experts: int = attrs.field(validator=positive_int)
    top_k: int = attrs.field(validator=positive_int)
    swiglu_alpha: float = attrs.field(default=1.702, validator=positive)
    swiglu_limit: float = attrs.field(default=7.0, validator=positive)
    expert_kind: ExpertKind = "clamped_swiglu"
    router_softmax: RouterSoftmax = "top_k"
    norm_topk_prob: bool = True
    routing_weights_dtype: RoutingDType = "float32"
    intermediate_size: int | None = attrs.field(default=None, validator=optional_positive_int)
    shared_expert_intermediate_size: int | None = attrs.field(
        default=None, validator=optional_positive_int
    )
    scale_input: bool = False

    def __attrs_post_init__(self) -> None:
        if self.scale_input and self.expert_kind != "swiglu":
            raise ValueError(
                f"MoEConfig: scale_input needs expert_kind='swiglu', got {self.expert_kind!r}"
            )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig: top_k={self.top_k} exceeds num_experts={self.num_experts}"
            )
        choices = {
            "expert_kind": ("clamped_swiglu", "swiglu"),
            "router_softmax": ("top_k", "all", "sigmoid"),
            "routing_weights_dtype": ("float32", "model"),
        }
        check_choices("MoEConfig", self, choices)


def _as_layer_kinds(value: Any) -> tuple[LayerKind, ...]:
    return tuple(value)


def _as_eos(value: Any) -> int | tuple[int, ...] | None:
    return tuple(value) if isinstance(value, list | tuple) else value


def _as_int_tuple(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@attrs.frozen(kw_only=True)
class ModelConfig:
    """A Llama-family decoder. `layer_kinds` defaults to all full attention.

    Family features, all off by default (Llama): `norm_style` (`gemma`: scale by `1 + weight` in
    float32; `float32`: scale in float32, then cast), `post_norms` (Gemma 2's four norms per
    layer: attention and MLP outputs are normed before the residual add), `embed_scale` (embedding
    multiplied by it, rounded to the model dtype), `query_pre_attn_scalar` (attention scale
    `scalar ** -0.5` instead of `head_size ** -0.5`), `attn_logit_softcap` / `final_logit_softcap`
    (`cap * tanh(x / cap)` on attention scores / output logits), `mlp_kind` with `moe`,
    `qk_norm` (Qwen 3, Gemma 3: an RMSNorm of `norm_style` over each head of q and k, before RoPE;
    weights `self_attn.q_norm` / `k_norm [head_size]`), `fused_qkv` / `fused_gate_up` (Phi-3: one
    `self_attn.qkv_proj` with q, k, v rows in that order; one `mlp.gate_up_proj` with the gate
    rows first), `local_rope_theta` / `local_rope_scaling` (Gemma 3: the RoPE of the local
    layers, those with a window or chunk; None: the global `rope_theta` and `rope_scaling`),
    `dense_mlp_layers` (with `mlp_kind="moe"`: the layers whose MLP is a dense SwiGLU of
    `intermediate_size` instead, Qwen2-MoE's `mlp_only_layers` and `decoder_sparse_step`).
    Llama 4: `rope_style="interleaved"` (RoPE rotates adjacent channel pairs, as complex
    numbers, instead of the two halves), `nope_layers` (layers without RoPE), `qk_l2_norm`
    (q and k of the RoPE layers divided by their RMS over each head, without weights, after
    RoPE), `attn_temperature` (query scaling by position on the NoPE layers).
    Qwen3-Next: `attn_output_gate` (`q_proj` gives each head's query then its gate; the
    attention output is multiplied by `sigmoid(gate)` before `o_proj`), `partial_rotary_factor`
    (RoPE on the first `head_size * factor` channels of each head), `gated_delta` (the shapes
    of the `gated_delta` layers).
    """

    vocab_size: int = attrs.field(validator=positive_int)
    hidden_size: int = attrs.field(validator=positive_int)
    intermediate_size: int = attrs.field(validator=positive_int)
    num_layers: int = attrs.field(validator=positive_int)
    num_heads: int = attrs.field(validator=positive_int)
    num_kv_heads: int = attrs.field(validator=positive_int)
    head_size: int = attrs.field(validator=positive_int)
    rms_norm_eps: float = attrs.field(default=1e-5, validator=positive)
    rope_theta: float = attrs.field(default=10000.0, validator=positive)
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = attrs.field(default=2048, validator=positive_int)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections (Qwen2, Llama attention_bias)
    attention_output_bias: bool = False  # o_proj (Llama attention_bias)
    mlp_bias: bool = False
    mlp_kind: MLPKind = "swiglu"
    moe: MoEConfig | None = None  # required by (and only by) mlp_kind="moe"
    norm_style: NormStyle = "llama"
    post_norms: bool = False
    embed_scale: float | None = attrs.field(default=None, validator=optional_positive)
    query_pre_attn_scalar: float | None = attrs.field(default=None, validator=optional_positive)
    attn_logit_softcap: float | None = attrs.field(default=None, validator=optional_positive)
    final_logit_softcap: float | None = attrs.field(default=None, validator=optional_positive)
    qk_norm: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    local_rope_theta: float | None = attrs.field(default=None, validator=optional_positive)
    local_rope_scaling: RopeScaling | None = None
    dense_mlp_layers: tuple[int, ...] = attrs.field(default=(), converter=_as_int_tuple)
    rope_style: RopeStyle = "neox"
    nope_layers: tuple[int, ...] = attrs.field(default=(), converter=_as_int_tuple)
    qk_l2_norm: bool = False
    attn_temperature: AttnTemperature | None = None
    attn_output_gate: bool = False
    partial_rotary_factor: float = attrs.field(default=1.0, validator=positive)
    gated_delta: GatedDeltaConfig | None = None
    layer_kinds: tuple[LayerKind, ...] = attrs.field(converter=_as_layer_kinds)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = attrs.field(default=None, converter=_as_eos)
    name: str = "custom"

    @head_size.default
    def _default_head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @layer_kinds.default
    def _default_layer_kinds(self) -> tuple[LayerKind, ...]:
        return (LayerKind(),) * self.num_layers

    def __attrs_post_init__(self) -> None:
        require_multiple(f"model {self.name}", self, "num_heads", "num_kv_heads")
        if self.head_size % 2:
            raise ValueError(
                f"model {self.name}: RoPE needs an even head_size, got {self.head_size}"
            )
        self._check_features()
        if len(self.layer_kinds) != self.num_layers:
            raise ValueError(
                f"model {self.name}: {len(self.layer_kinds)} layer_kinds for num_layers="
                f"{self.num_layers}; give one LayerKind per layer"
            )
        for token in (self.bos_token_id, *self.eos_token_ids):
            if token is not None and not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"model {self.name}: special token id {token} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )

    def _check_features(self) -> None:
        choices = {
            "mlp_kind": ("swiglu", "geglu", "moe"),
            "norm_style": ("llama", "gemma", "float32"),
            "rope_style": ("neox", "interleaved"),
        }
        check_choices(f"model {self.name}", self, choices)
        if (self.mlp_kind == "moe") != (self.moe is not None):
            raise ValueError(
                f"model {self.name}: mlp_kind={self.mlp_kind!r} with moe={self.moe}; "
                "mlp_kind='moe' needs a MoEConfig, the other kinds none"
            )
        if self.dense_mlp_layers and self.mlp_kind != "moe":
            raise ValueError(
                f"model {self.name}: dense_mlp_layers={self.dense_mlp_layers} with "
                f"mlp_kind={self.mlp_kind!r}; only mlp_kind='moe' has dense layers to name"
            )
        for field in ("dense_mlp_layers", "nope_layers"):
            outside = [i for i in getattr(self, field) if not 0 <= i < self.num_layers]
            if outside:
                raise ValueError(
                    f"model {self.name}: {field} {outside} are outside the layers "
                    f"[0, {self.num_layers}); give layer indices"
                )
        self._check_state_layers()
        if self.local_rope_scaling is not None and self.local_rope_theta is None:
            raise ValueError(
                f"model {self.name}: local_rope_scaling without local_rope_theta; set the local "
                "layers' RoPE base too"
            )

    def _check_state_layers(self) -> None:
        if self.gated_delta is None and any(k.kind == "gated_delta" for k in self.layer_kinds):
            raise ValueError(f"model {self.name}: gated_delta layers need a GatedDeltaConfig, "
                             "got gated_delta=None")  # fmt: skip
        rotary, style = self.rotary_dim, self.rope_style
        if rotary % 2 or rotary > self.head_size or (rotary < self.head_size and style != "neox"):
            raise ValueError(
                f"model {self.name}: partial_rotary_factor={self.partial_rotary_factor} gives "
                f"{rotary} of {self.head_size} channels; it must be at most 1, give an even "
                f"number and go with rope_style='neox' (got {style!r})"
            )

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (the first ones), as transformers rounds."""
        return int(self.head_size * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        base = self.head_size if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(base**-0.5)

    def rope_of(self, kind: LayerKind) -> tuple[float, RopeScaling | None]:
        """(theta, scaling) of the layers of `kind`: the local RoPE when set and `kind` is local."""
        if self.local_rope_theta is not None and kind.is_local:
            return self.local_rope_theta, self.local_rope_scaling
        return self.rope_theta, self.rope_scaling

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return self.eos_token_id
