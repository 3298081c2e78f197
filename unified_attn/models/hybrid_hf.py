"""Hugging Face checkpoints of the state-space hybrids: `config.json` into a `HybridConfig`
and the weights into `HybridModel`'s names, for Mamba2ForCausalLM, BambaForCausalLM,
NemotronHForCausalLM (with its MoE blocks) and GraniteMoeHybridForCausalLM (Granite-4.0-H)."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from unified_attn.models.hf_checkpoint import CheckpointFormat, State, check_state
from unified_attn.models.hf_rope import flat_rope_params
from unified_attn.models.hybrid import HybridModel
from unified_attn.models.hybrid_config import BlockKind, HybridConfig, HybridMoEConfig, Mamba2Config

HFConfig = dict[str, Any]
# Nemotron-H's `hybrid_override_pattern` letters and `layers_block_type` names
NEMOTRON_BLOCKS: dict[str, BlockKind] = {
    "M": "mamba", "*": "attention", "-": "mlp", "E": "moe",
    "mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
    "full_attention": "attention", "mlp": "mlp", "moe": "moe",
}  # fmt: skip
# Granite-4.0-H's `layer_types` (transformers 5 writes the second pair)
GRANITE_MIXERS: dict[str, BlockKind] = {
    "mamba": "mamba", "attention": "attention",
    "linear_attention": "mamba", "full_attention": "attention",
}  # fmt: skip


def _require(hf: HFConfig, key: str, expected: Any, name: str) -> None:
    found = hf.get(key, expected)
    if found != expected:
        raise ValueError(
            f"checkpoint {name}: config.json {key}={found!r} is not supported; expected "
            f"{expected!r}"
        )


def _mamba(hf: HFConfig, name: str, keys: dict[str, str], norm_groups: int | None = None
           ) -> Mamba2Config:  # fmt: skip
    """The mixer from the family's key names (`keys`: our field -> config.json key)."""
    fields = {ours: hf[key] for ours, key in keys.items() if key in hf and ours != "expand"}
    limit = hf.get("time_step_limit") or (0.0, float("inf"))
    mixer = Mamba2Config(**fields, time_step_limit=tuple(_json_float(v) for v in limit))
    expand = hf.get(keys.get("expand", "expand"))
    if expand is not None and int(expand * hf["hidden_size"]) != mixer.inner_size:
        raise ValueError(
            f"checkpoint {name}: expand * hidden_size = {int(expand * hf['hidden_size'])} but "
            f"heads * head size = {mixer.inner_size}; config.json must agree"
        )
    return mixer


def _json_float(value: Any) -> float:
    """A float of config.json; transformers 5 writes infinity as `{"__float__": "Infinity"}`."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _common(hf: HFConfig, name: str) -> dict[str, Any]:
    return dict(
        name=name,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        max_position_embeddings=hf.get("max_position_embeddings") or 1 << 20,
    )


def _mamba2(hf: HFConfig, name: str) -> HybridConfig:
    _require(hf, "hidden_act", "silu", name)
    keys = dict(num_heads="num_heads", head_size="head_dim", num_groups="n_groups",
                state_size="state_size", conv_kernel="conv_kernel", chunk_size="chunk_size",
                conv_bias="use_conv_bias", proj_bias="use_bias")  # fmt: skip
    return HybridConfig(
        **_common(hf, name),
        blocks=["mamba"] * hf["num_hidden_layers"],
        mamba=_mamba(hf, name, keys),
        rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        residual_in_fp32=bool(hf.get("residual_in_fp32", True)),
    )


def _attention(hf: HFConfig, name: str) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    head = hf.get("head_dim") or hf["hidden_size"] // heads
    return dict(
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_size=head,
        attention_bias=bool(hf.get("attention_bias", False)),
        intermediate_size=hf["intermediate_size"],
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )


def _bamba(hf: HFConfig, name: str) -> HybridConfig:
    _require(hf, "hidden_act", "silu", name)
    _require(hf, "num_experts", 1, name)
    keys = dict(num_heads="mamba_n_heads", head_size="mamba_d_head", num_groups="mamba_n_groups",
                state_size="mamba_d_state", conv_kernel="mamba_d_conv",
                chunk_size="mamba_chunk_size", conv_bias="mamba_conv_bias",
                proj_bias="mamba_proj_bias", expand="mamba_expand")  # fmt: skip
    attention = _attention(hf, name)
    rope = _default_rope(hf, name)
    partial_factor = float(rope.get("partial_rotary_factor", 1.0))
    attn = set(hf.get("attn_layer_indices") or ())
    blocks: list[BlockKind] = []
    for i in range(hf["num_hidden_layers"]):
        blocks += ["attention" if i in attn else "mamba", "mlp"]
    return HybridConfig(
        **_common(hf, name), **attention, blocks=blocks,
        mamba=_mamba(hf, name, {k: v for k, v in keys.items() if k != "expand"}),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5), rope_theta=_rope_theta(hf, rope),
        rotary_dim=int(attention["head_size"] * partial_factor),
    )  # fmt: skip


def _default_rope(hf: HFConfig, name: str) -> dict[str, Any]:
    rope = flat_rope_params(hf)
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"checkpoint {name}: config.json rope_type={rope.get('rope_type')!r} is not "
            f"supported for {hf.get('model_type')}; expected 'default'"
        )
    return rope


def _rope_theta(hf: HFConfig, rope: dict[str, Any]) -> float:
    return float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0)


def _nemotron_blocks(hf: HFConfig, name: str) -> list[BlockKind]:
    pattern = hf.get("layers_block_type") or list(hf.get("hybrid_override_pattern") or "")
    unknown = sorted({p for p in pattern if p not in NEMOTRON_BLOCKS})
    if unknown or not pattern:
        raise ValueError(
            f"checkpoint {name}: Nemotron-H blocks {unknown or pattern} are not supported; "
            f"expected Mamba, attention, MLP and MoE blocks ({sorted(NEMOTRON_BLOCKS)})"
        )
    return [NEMOTRON_BLOCKS[p] for p in pattern]


def _nemotron_moe(hf: HFConfig, name: str) -> HybridMoEConfig:
    """The MoE blocks (Nemotron-3-Nano): relu2 experts, sigmoid-grouped routing."""
    _require(hf, "moe_latent_size", None, name)
    return HybridMoEConfig(
        num_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        shared_intermediate_size=hf["moe_shared_expert_intermediate_size"],
        activation="relu2", routing="sigmoid_grouped", n_group=hf.get("n_group", 1),
        topk_group=hf.get("topk_group", 1), norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
    )  # fmt: skip


def _nemotron_h(hf: HFConfig, name: str) -> HybridConfig:
    _require(hf, "mamba_hidden_act", "silu", name)
    _require(hf, "mlp_hidden_act", "relu2", name)
    keys = dict(num_heads="mamba_num_heads", head_size="mamba_head_dim", num_groups="n_groups",
                state_size="ssm_state_size", conv_kernel="conv_kernel", chunk_size="chunk_size",
                conv_bias="use_conv_bias", proj_bias="mamba_proj_bias")  # fmt: skip
    blocks = _nemotron_blocks(hf, name)
    return HybridConfig(
        **_common(hf, name), **_attention(hf, name), blocks=blocks,
        mamba=_mamba(hf, name, keys), rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        mlp_activation="relu2", residual_in_fp32=bool(hf.get("residual_in_fp32", False)),
        moe=_nemotron_moe(hf, name) if "moe" in blocks else None,
    )  # fmt: skip


def _granite_blocks(hf: HFConfig, name: str, ffn: BlockKind) -> list[BlockKind]:
    """Each decoder layer as two blocks: its mixer, then its feed-forward block `ffn`."""
    types = hf.get("layer_types") or hf.get("layers_block_type") or []
    unknown = sorted({t for t in types if t not in GRANITE_MIXERS})
    if unknown or len(types) != hf["num_hidden_layers"]:
        raise ValueError(
            f"checkpoint {name}: config.json layer_types={types!r} is not supported; expected "
            f"num_hidden_layers={hf['num_hidden_layers']} entries from {sorted(GRANITE_MIXERS)}"
        )
    return [kind for t in types for kind in (GRANITE_MIXERS[t], ffn)]


def _granite_mamba(hf: HFConfig, name: str) -> Mamba2Config:
    keys = dict(num_heads="mamba_n_heads", head_size="mamba_d_head", num_groups="mamba_n_groups",
                state_size="mamba_d_state", conv_kernel="mamba_d_conv",
                chunk_size="mamba_chunk_size", conv_bias="mamba_conv_bias",
                proj_bias="mamba_proj_bias", expand="mamba_expand")  # fmt: skip
    if hf.get("mamba_d_head") == "auto":  # as GraniteMoeHybridConfig resolves it
        hf = {**hf, "mamba_d_head": hf["mamba_expand"] * hf["hidden_size"] // hf["mamba_n_heads"]}
    return _mamba(hf, name, keys)


def _granite(hf: HFConfig, name: str) -> HybridConfig:
    """Granite-4.0-H: Bamba's layers with Granite's multipliers, RoPE or none, and per layer
    an MoE with a shared SwiGLU expert (`num_local_experts=0`: the shared MLP alone)."""
    _require(hf, "hidden_act", "silu", name)
    position = hf.get("position_embedding_type")
    if position not in (None, "nope", "rope"):
        raise ValueError(
            f"checkpoint {name}: config.json position_embedding_type={position!r} is not "
            "supported; expected 'rope', 'nope' or null"
        )
    rope = _default_rope(hf, name)
    experts, shared = hf.get("num_local_experts") or 0, hf["shared_intermediate_size"]
    moe = None if not experts else HybridMoEConfig(
        num_experts=experts, top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["intermediate_size"], shared_intermediate_size=shared,
    )  # fmt: skip
    attention = {**_attention(hf, name), "intermediate_size": shared}
    return HybridConfig(
        **_common(hf, name), **attention, blocks=_granite_blocks(hf, name, "moe" if moe else "mlp"),
        mamba=_granite_mamba(hf, name), moe=moe, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(hf, rope),
        rotary_dim=attention["head_size"] if position == "rope" else None,
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        attention_multiplier=float(hf.get("attention_multiplier", 1.0)),
        logits_scaling=float(hf.get("logits_scaling", 1.0)),
    )  # fmt: skip


READERS: dict[str, Callable[[HFConfig, str], HybridConfig]] = {
    "mamba2": _mamba2,
    "bamba": _bamba,
    "nemotron_h": _nemotron_h,
    "granitemoehybrid": _granite,
}


def hybrid_config_from_hf(hf: HFConfig, name: str = "hybrid") -> HybridConfig:
    model_type = hf.get("model_type")
    if model_type not in READERS:
        raise ValueError(
            f"checkpoint {name}: model_type {model_type!r} is not a state-space hybrid; "
            f"expected one of {sorted(READERS)}"
        )
    return READERS[model_type](hf, name)


# ---- weights -----------------------------------------------------------------------------------

_PREFIX = re.compile(r"^(?:backbone|model)\.")
_MTP = re.compile(r"^(?:backbone\.|model\.)?mtp\.")  # Nemotron-H's next-token layers: unused
_BAMBA_LAYER = re.compile(
    r"^layers\.(\d+)\.(input_layernorm|pre_ff_layernorm|post_attention_layernorm|mamba"
    r"|self_attn|feed_forward|block_sparse_moe|shared_mlp)(\..+)$"
)
_BAMBA_PLACE = {"input_layernorm": (0, "norm"), "mamba": (0, "mixer"),
                "self_attn": (0, "mixer"), "pre_ff_layernorm": (1, "norm"),
                "post_attention_layernorm": (1, "norm"), "feed_forward": (1, "mixer"),
                "block_sparse_moe": (1, "mixer"), "shared_mlp": (1, "mixer")}  # fmt: skip
# Granite's MoE (checkpoint and transformers names) and shared MLP, as `HybridMoE`'s; the
# shared MLP's fused `input_linear` (gate rows, then up rows) is split in `_split_gate_up`.
_GRANITE_FFN = {
    "block_sparse_moe.router.layer.weight": "gate.weight",
    "block_sparse_moe.router.weight": "gate.weight",
    "block_sparse_moe.input_linear.weight": "experts.gate_up_proj",
    "block_sparse_moe.experts.gate_up_proj": "experts.gate_up_proj",
    "block_sparse_moe.output_linear.weight": "experts.down_proj",
    "block_sparse_moe.experts.down_proj": "experts.down_proj",
    "shared_mlp.input_linear.weight": "shared_experts.input_linear.weight",
    "shared_mlp.output_linear.weight": "shared_experts.down_proj.weight",
}
_RENAMES = {"embeddings.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight",
            "final_layernorm.weight": "norm.weight"}  # fmt: skip
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


def _model_name(name: str) -> str:
    name = _PREFIX.sub("", name)
    name = _RENAMES.get(name, name)
    match = _BAMBA_LAYER.match(name)
    if match is None:
        return name
    layer, part, rest = match.groups()
    second, ours = _BAMBA_PLACE[part]
    rest = "." + _GRANITE_FFN.get(part + rest, rest[1:])
    return f"layers.{2 * int(layer) + second}.{ours}{rest}"


def _model_names(tensors: State, config: HybridConfig) -> State:
    """`HybridModel`'s names: the backbone under `model.`, the head as `lm_head`."""
    state = {}
    for name, tensor in tensors.items():
        if _MTP.match(name):
            continue
        ours = _model_name(name)
        if "moe" not in config.blocks:  # Granite without experts: the shared MLP is the block's
            ours = ours.replace(".shared_experts.", ".")
        state[ours if ours == "lm_head.weight" else f"model.{ours}"] = tensor
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return _stack_experts(_split_gate_up(state))


def _split_gate_up(state: State) -> State:
    """Granite's shared MLP `input_linear [2I, H]` as `gate_proj` and `up_proj`."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(".input_linear.weight"):
            prefix = name.removesuffix("input_linear.weight")
            out[f"{prefix}gate_proj.weight"], out[f"{prefix}up_proj.weight"] = tensor.chunk(2)
        else:
            out[name] = tensor
    return out


def _stack_experts(state: State) -> State:
    """Nemotron-H's per-expert `experts.{e}.up_proj.weight` / `down_proj.weight` stacked into
    `experts.up_proj [E, I, H]` / `experts.down_proj [E, H, I]`; a set whose experts are not
    0..E-1 is left as it is, for the name check to report."""
    out: State = {}
    sets: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            prefix, index, which = match.groups()
            sets.setdefault(f"{prefix}.{which}", {})[int(index)] = tensor
    for stacked, experts in sets.items():
        if sorted(experts) == list(range(len(experts))):
            out[stacked] = torch.stack([experts[e] for e in range(len(experts))])
        else:
            head, which = stacked.rsplit(".", 1)
            out.update({f"{head}.{e}.{which}.weight": t for e, t in experts.items()})
    return out


_FORMAT: CheckpointFormat[HybridModel] = CheckpointFormat(
    model_cls=HybridModel,
    read_config=hybrid_config_from_hf,
    model_names=_model_names,
    check=partial(check_state, hint="num_hidden_layers, block pattern, Mamba heads and groups"),
)


def load_hybrid(path: Any, backend_cls: Any, **model_kwargs: Any) -> tuple[HybridModel, Any]:
    return _FORMAT.load(path, backend_cls, **model_kwargs)
