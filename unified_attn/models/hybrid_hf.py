"""Hugging Face checkpoints of the state-space hybrids: `config.json` into a `HybridConfig`
and the weights into `HybridModel`'s names, for Mamba2ForCausalLM, BambaForCausalLM and
NemotronHForCausalLM."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

from unified_attn.models.deepseek_hf import check_state
from unified_attn.models.hf_checkpoint import CheckpointFormat, State
from unified_attn.models.hf_rope import flat_rope_params
from unified_attn.models.hybrid import HybridModel
from unified_attn.models.hybrid_config import BlockKind, HybridConfig, Mamba2Config

HFConfig = dict[str, Any]
HYBRID_MODEL_TYPES = ("mamba2", "bamba", "nemotron_h")
# Nemotron-H's `hybrid_override_pattern` letters and `layers_block_type` names
NEMOTRON_BLOCKS: dict[str, BlockKind] = {
    "M": "mamba", "*": "attention", "-": "mlp",
    "mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
    "full_attention": "attention", "mlp": "mlp",
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
    fields = {ours: hf[theirs] for ours, theirs in keys.items() if theirs in hf}
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
    rope = flat_rope_params(hf)
    partial_factor = float(rope.get("partial_rotary_factor", 1.0))
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"checkpoint {name}: config.json rope_type={rope.get('rope_type')!r} is not "
            "supported for Bamba; expected 'default'"
        )
    attn = set(hf.get("attn_layer_indices") or ())
    blocks: list[BlockKind] = []
    for i in range(hf["num_hidden_layers"]):
        blocks += ["attention" if i in attn else "mamba", "mlp"]
    return HybridConfig(
        **_common(hf, name), **attention, blocks=blocks,
        mamba=_mamba(hf, name, {k: v for k, v in keys.items() if k != "expand"}),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0),
        rotary_dim=int(attention["head_size"] * partial_factor),
    )  # fmt: skip


def _nemotron_blocks(hf: HFConfig, name: str) -> list[BlockKind]:
    pattern = hf.get("layers_block_type") or list(hf.get("hybrid_override_pattern") or "")
    unknown = sorted({p for p in pattern if p not in NEMOTRON_BLOCKS})
    if unknown or not pattern:
        raise ValueError(
            f"checkpoint {name}: Nemotron-H blocks {unknown or pattern} are not supported; "
            "expected Mamba, attention and MLP blocks (mixture-of-experts blocks are not "
            "supported yet)"
        )
    return [NEMOTRON_BLOCKS[p] for p in pattern]


def _nemotron_h(hf: HFConfig, name: str) -> HybridConfig:
    _require(hf, "mamba_hidden_act", "silu", name)
    _require(hf, "mlp_hidden_act", "relu2", name)
    keys = dict(num_heads="mamba_num_heads", head_size="mamba_head_dim", num_groups="n_groups",
                state_size="ssm_state_size", conv_kernel="conv_kernel", chunk_size="chunk_size",
                conv_bias="use_conv_bias", proj_bias="mamba_proj_bias")  # fmt: skip
    return HybridConfig(
        **_common(hf, name), **_attention(hf, name), blocks=_nemotron_blocks(hf, name),
        mamba=_mamba(hf, name, keys), rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        mlp_activation="relu2", residual_in_fp32=bool(hf.get("residual_in_fp32", False)),
    )  # fmt: skip


READERS: dict[str, Callable[[HFConfig, str], HybridConfig]] = {
    "mamba2": _mamba2,
    "bamba": _bamba,
    "nemotron_h": _nemotron_h,
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
_BAMBA_LAYER = re.compile(
    r"^layers\.(\d+)\.(input_layernorm|pre_ff_layernorm|mamba|self_attn|feed_forward)(\..+)$"
)
_BAMBA_PLACE = {"input_layernorm": (0, "norm"), "mamba": (0, "mixer"),
                "self_attn": (0, "mixer"), "pre_ff_layernorm": (1, "norm"),
                "feed_forward": (1, "mixer")}  # fmt: skip
_RENAMES = {"embeddings.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight",
            "final_layernorm.weight": "norm.weight"}  # fmt: skip


def _model_name(name: str) -> str:
    name = _PREFIX.sub("", name)
    name = _RENAMES.get(name, name)
    match = _BAMBA_LAYER.match(name)
    if match is None:
        return name
    layer, part, rest = match.groups()
    second, ours = _BAMBA_PLACE[part]
    return f"layers.{2 * int(layer) + second}.{ours}{rest}"


def _model_names(tensors: State, config: HybridConfig) -> State:
    """`HybridModel`'s names: the backbone under `model.`, the head as `lm_head`."""
    state = {}
    for name, tensor in tensors.items():
        ours = _model_name(name)
        state[ours if ours == "lm_head.weight" else f"model.{ours}"] = tensor
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


_FORMAT: CheckpointFormat[HybridModel] = CheckpointFormat(
    model_cls=HybridModel,
    read_config=hybrid_config_from_hf,
    model_names=_model_names,
    check=partial(check_state, hint="num_hidden_layers, block pattern, Mamba heads and groups"),
)


def load_hybrid(path: Any, backend_cls: Any, **model_kwargs: Any) -> tuple[HybridModel, Any]:
    return _FORMAT.load(path, backend_cls, **model_kwargs)
