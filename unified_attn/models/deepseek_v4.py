"""DeepSeek-V4: hybrid sliding-window / compressed sparse (CSA) / heavily compressed (HCA)
attention, hyper-connections and hash-routed MoE, numerically as transformers'
`DeepseekV4ForCausalLM` (eval mode).

Every layer attends over a window of `sliding_window` tokens (one shared-KV latent of
`head_dim` per token); CSA layers add one compressed entry per `csa_compress_rate` tokens,
of which a lightning indexer picks the top `index_topk` per query; HCA layers one entry per
`hca_compress_rate` tokens, all visible. Each cache is its own *cache user*
(`model.layers.i.self_attn.{swa,compressor,compressed,indexer_compressor,indexer}`) with its
own backend instance and `(manager, config, spec)` triple
(`unified_attn.backends.deepseek_v4_window` states the contract), so the worker plans several
KV-cache groups per layer with no DeepSeek-specific code. The backends come from one selected
class (`layer_kind "deepseek_v4"`) and the classes its `cache_user_classes()` names for the
other roles.

Parameter names are transformers' own, so a `save_pretrained` checkpoint loads as a state dict
(`load_deepseek_v4`); RoPE buffers and multi-token-prediction weights are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

import attrs
import torch
from torch import nn

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.models.attention_model import CausalLM, fill_ones_and_zeros
from unified_attn.models.config import RopeScaling, as_token_ids
from unified_attn.models.deepseek_v4_attention import CSA, HCA, SLIDING, V4Rotary, v4_norm
from unified_attn.models.deepseek_v4_layers import SCORES, DeepseekV4DecoderLayer, HyperHead
from unified_attn.utils import positive, positive_int

LAYER_TYPES = (SLIDING, CSA, HCA)
# the cache users besides `swa` whose classes a V4 backend names (`cache_user_classes`)
CACHE_USER_ROLES = ("compressor", "compressed", "indexer")
MLP_LAYER_TYPES = ("hash_moe", "moe")


def _as_names(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


@attrs.frozen(kw_only=True)
class DeepseekV4Config:
    """Shapes, layer schedule and routing of a DeepSeek-V4 model; names follow `config.json`
    (`compress_rates` split into `csa_compress_rate` / `hca_compress_rate`, the "compress" RoPE
    as `compress_rope_theta` / `compress_rope_scaling`)."""

    name: str = "deepseek-v4"
    vocab_size: int = attrs.field(validator=positive_int)
    hidden_size: int = attrs.field(validator=positive_int)
    moe_intermediate_size: int = attrs.field(validator=positive_int)
    num_layers: int = attrs.field(validator=positive_int)
    num_heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    qk_rope_head_dim: int = attrs.field(validator=positive_int)
    q_lora_rank: int = attrs.field(validator=positive_int)
    o_groups: int = attrs.field(validator=positive_int)
    o_lora_rank: int = attrs.field(validator=positive_int)
    sliding_window: int = attrs.field(validator=positive_int)
    layer_types: tuple[str, ...] = attrs.field(converter=_as_names)
    mlp_layer_types: tuple[str, ...] = attrs.field(converter=_as_names)
    csa_compress_rate: int = attrs.field(default=4, validator=positive_int)
    hca_compress_rate: int = attrs.field(default=128, validator=positive_int)
    index_n_heads: int = attrs.field(default=64, validator=positive_int)
    index_head_dim: int = attrs.field(default=128, validator=positive_int)
    index_topk: int = attrs.field(default=512, validator=positive_int)
    hc_mult: int = attrs.field(default=4, validator=positive_int)
    hc_sinkhorn_iters: int = attrs.field(default=20, validator=positive_int)
    hc_eps: float = attrs.field(default=1e-6, validator=positive)
    n_routed_experts: int = attrs.field(validator=positive_int)
    num_experts_per_tok: int = attrs.field(validator=positive_int)
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = attrs.field(default=1.5, validator=positive)
    swiglu_limit: float = attrs.field(default=10.0, validator=positive)
    mlp_bias: bool = False
    rms_norm_eps: float = attrs.field(default=1e-6, validator=positive)
    rope_theta: float = attrs.field(default=10000.0, validator=positive)
    rope_scaling: RopeScaling | None = None  # the "main" RoPE (sliding-only layers)
    compress_rope_theta: float = attrs.field(default=160000.0, validator=positive)
    compress_rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = attrs.field(default=4096, validator=positive_int)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=as_token_ids)

    def __attrs_post_init__(self) -> None:
        for field, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            values = getattr(self, field)
            bad = sorted({v for v in values if v not in allowed})
            if len(values) != self.num_layers or bad:
                raise ValueError(
                    f"DeepseekV4Config {self.name}: {field} needs num_layers={self.num_layers} "
                    f"entries from {allowed}; got {len(values)} entries, unknown {bad}"
                )
        self._check_shapes()

    def _check_shapes(self) -> None:
        problems = []
        rope, dim = self.qk_rope_head_dim, self.head_dim
        if rope % 2 or rope > dim:
            problems.append(f"qk_rope_head_dim={rope} must be even and <= head_dim={dim}")
        if (self.num_heads * dim) % self.o_groups:
            problems.append(f"o_groups={self.o_groups} must divide num_heads * head_dim")
        if self.num_experts_per_tok > self.n_routed_experts:
            problems.append(f"num_experts_per_tok={self.num_experts_per_tok} > n_routed_experts")
        if self.scoring_func not in SCORES:
            problems.append(f"scoring_func={self.scoring_func!r} is not one of {sorted(SCORES)}")
        if problems:
            raise ValueError(f"DeepseekV4Config {self.name}: " + "; ".join(problems))

    def layer_count(self, kind: str) -> int:
        return sum(t == kind for t in self.layer_types)


# ---- the model ----------------------------------------------------------------------------------


def make_backends(
    config: DeepseekV4Config,
    backend_cls: type[AttentionBackend],
    dtype: torch.dtype,
    options: dict[str, Any],
) -> dict[str, AttentionBackend]:
    """One backend instance per cache-user kind the layers need (`cache_users` names them):
    the selected class serves `swa`, the classes of its `cache_user_classes()` the roles
    `CACHE_USER_ROLES` (the contract's "Layers with several cache users")."""
    roles = backend_cls.cache_user_classes()
    missing = [role for role in CACHE_USER_ROLES if role not in roles]
    if missing:
        raise ValueError(
            f"{backend_cls.__name__} is not a DeepSeek-V4 backend: it has no class for the "
            f"cache users {missing}; use a backend of layer kind 'deepseek_v4' (e.g. "
            "deepseek-v4-reference)"
        )
    cls = cast(Any, backend_cls)
    compressor, compressed = cast(Any, roles["compressor"]), cast(Any, roles["compressed"])
    indexer = cast(Any, roles["indexer"])
    common = dict(num_kv_heads=1, dtype=dtype, **options)
    dim, idx = config.head_dim, config.index_head_dim
    csa, hca = config.csa_compress_rate, config.hca_compress_rate
    backends = {"swa": cls(head_size=dim, sliding_window=config.sliding_window, **common)}
    if config.layer_count(CSA):
        backends["csa_compressor"] = compressor(
            head_size=2 * dim, compress_rate=csa, overlap=True, **common
        )
        backends["csa_compressed"] = compressed(head_size=dim, compress_rate=csa, **common)
        backends["indexer_compressor"] = compressor(
            head_size=2 * idx, compress_rate=csa, overlap=True, **common
        )
        backends["indexer"] = indexer(head_size=idx, compress_rate=csa, **common)
    if config.layer_count(HCA):
        backends["hca_compressor"] = compressor(
            head_size=dim, compress_rate=hca, overlap=False, **common
        )
        backends["hca_compressed"] = compressed(head_size=dim, compress_rate=hca, **common)
    return backends


class _Backbone(nn.Module):
    """The `model.` prefix of the parameter names."""

    def __init__(self, config: DeepseekV4Config, backends: dict[str, AttentionBackend]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV4DecoderLayer(config, i, backends) for i in range(config.num_layers)
        )
        self.norm = v4_norm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config)


# Parameters and buffers transformers keeps in float32 whatever the model dtype.
_FLOAT32 = ("_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias", "norm.")


def keeps_float32(name: str) -> bool:
    return any(part in name for part in _FLOAT32)


class DeepseekV4ForCausalLM(CausalLM[DeepseekV4Config, str]):
    """Inference-only DeepSeek-V4. Weights start constant (norms 1, the rest 0): call
    `init_random_weights` or load a checkpoint (`load_deepseek_v4`)."""

    model: _Backbone

    def _make_backends(
        self, backend_cls: type[AttentionBackend], options: dict[str, Any], device: torch.device
    ) -> dict[str, AttentionBackend]:
        return make_backends(self.config, backend_cls, self.dtype, options)

    def _prepare(self) -> None:
        self.rotary = V4Rotary(self.config)

    def _build(self) -> None:
        self.model = _Backbone(self.config, self.backends)
        self._build_lm_head()

    def _cast(self) -> None:
        for name, tensor in (*self.named_parameters(), *self.named_buffers()):
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(torch.float32 if keeps_float32(name) else self.dtype)

    def _reset_rotary(self, device: torch.device | str) -> None:
        self.rotary.reset(device)

    def attention_layers(self) -> Iterator[tuple[LayerConfig, AttentionBackend]]:
        """Every cache user of every layer, layer by layer."""
        for layer in self.model.layers:
            for user in cast(DeepseekV4DecoderLayer, layer).self_attn.users.values():
                yield user.layer, user.backend

    def _fill_constant(self) -> None:
        fill_ones_and_zeros(self, _starts_at_one)

    @torch.no_grad()
    def init_random_weights(self, seed: int) -> None:
        """Deterministic on any device: normal(0, 0.02) drawn on CPU in float32; norms and the
        hyper-connection scales 1; sinks, biases and position biases 0; hash layers route each
        token to `num_experts_per_tok` distinct random experts."""
        gen = self._init_random_parameters(seed, _starting_value)
        for name, buffer in self.named_buffers():
            if name.endswith("tid2eid"):
                order = torch.rand(buffer.shape[0], self.config.n_routed_experts, generator=gen)
                buffer.copy_(order.argsort(dim=-1)[:, : buffer.shape[1]])
            else:
                buffer.zero_()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions `[T]` int64 -> final-normed hidden `[T, hidden_size]`. Every
        backend's `prep_forward` must have run for the step."""
        hidden = self.model.embed_tokens(input_ids)
        streams = hidden[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()
        for layer in self.model.layers:
            streams = layer(streams, input_ids, positions, self.rotary)
        return cast(torch.Tensor, self.model.norm(self.model.hc_head(streams)))


def _starting_value(name: str) -> float | None:
    """The constant a parameter starts at in `init_random_weights` (None: drawn)."""
    if _starts_at_one(name):
        return 1.0
    return 0.0 if _starts_at_zero(name) else None


def _starts_at_one(name: str) -> bool:
    return name.endswith(("norm.weight", "hc.scale", "hc_scale"))


def _starts_at_zero(name: str) -> bool:
    return name.endswith(("sinks", "position_bias", "hc.base", "hc_base"))
