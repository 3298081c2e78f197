"""The fp8 (e4m3) KV cache of the reference and Triton backends: quantization with saturation
and the per-layer K and V scales.

    stored      = float8_e4m3fn(clamp(x / scale, -448, 448))   (round to nearest even)
    dequantized = float32(stored) * scale

Each layer has a K scale and a V scale (float32 scalars), kept in one persistent device tensor
`[2]` per layer that the kernels read (no host sync, the same address under CUDA graphs). They
come from, in order:

1. the checkpoint: `model.layers.N.self_attn.k_scale` / `v_scale`, handed to the backend as the
   `kv_scales` forward kwarg (`[2]` float32, on the model's device); never changed;
2. calibration: in the first step that writes keys and runs eagerly (planned outside CUDA-graph
   capture; for an engine, the first prefill chunk), each layer's forward sets its scales to
   `amax / 448` of the keys and values that step writes (1.0 when that amax is 0 or not
   finite), before writing them; fixed for the life of the backend instance, so later results
   never depend on batch composition;
3. 1.0 in batch-invariant mode (calibration would make a request's cache depend on the batch
   that happened to run first), unless the checkpoint gives scales.

`FP8KVBackend` is the base of the backends with such a cache: it takes the fp8 names, keeps the
scales and hands each layer's forward its scales (`_layer_scales`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import torch

from unified_attn.backend import AttentionBackend, CommonAttentionMetadata, LayerConfig, PlanT
from unified_attn.selector import SelectorConfig
from unified_attn.tensor_specs.paged import FP8_KV_DTYPE, FP8_KV_NAMES, as_kv_dtype, is_fp8_kv

FP8_MAX = 448.0  # the largest finite float8 e4m3fn value


def fp8_name_as_dtype(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Backend keyword arguments with `kv_cache_dtype="fp8"` (or `fp8_e4m3`) spelled as the
    torch dtype the base constructor takes."""
    if kwargs.get("kv_cache_dtype") in FP8_KV_NAMES:
        return {**kwargs, "kv_cache_dtype": FP8_KV_DTYPE}
    return kwargs


def kv_cache_dtype_reasons(backend: str, cfg: SelectorConfig) -> list[str]:
    """Why `backend`, which stores the model dtype or fp8 e4m3, cannot take
    `cfg.kv_cache_dtype`; [] when it can."""
    wanted = cfg.kv_cache_dtype
    try:
        ok = wanted == "auto" or as_kv_dtype(wanted) in (cfg.dtype, FP8_KV_DTYPE)
    except ValueError:
        ok = False
    if ok:
        return []
    return [
        f"KV-cache dtype {wanted} must equal the model dtype ({cfg.dtype}) or be fp8: "
        f"{backend} takes kv_cache_dtype 'auto' or 'fp8' (float8 e4m3 with per-layer scales)"
    ]


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x` (any float dtype) divided by the 0-dim float32 `scale`, saturated to +-448, as
    float8 e4m3fn (round to nearest even; NaN stays NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 `x` times the 0-dim float32 `scale`, in float32."""
    return x.float() * scale


def calibrated_scale(x: torch.Tensor, written: torch.Tensor | None = None) -> torch.Tensor:
    """0-dim float32 `amax / 448` over the rows of `x [N, ...]` where `written [N]` (all rows
    when None); 1.0 when there is no row or the amax is 0 or not finite. Device ops only."""
    if x.shape[0] == 0:
        return torch.ones((), dtype=torch.float32, device=x.device)
    magnitude = x.abs()
    if written is not None:
        magnitude = torch.where(written.view(-1, *[1] * (x.dim() - 1)), magnitude, 0)
    amax = magnitude.amax().float()
    usable = torch.isfinite(amax) & (amax > 0)
    return torch.where(usable, amax / FP8_MAX, torch.ones_like(amax))


@attrs.define
class KVScales:
    """The K and V scales of the layers of one backend instance with an fp8 cache (see the
    module docstring for where they come from and when calibration happens)."""

    calibrate: bool  # False in batch-invariant mode: 1.0 unless the checkpoint gives scales
    # layer name -> persistent device [2] float32 (k_scale, v_scale), made at bind time
    tensors: dict[str, torch.Tensor] = attrs.Factory(dict)
    fixed: set[str] = attrs.Factory(set)  # layers whose scales no step may change any more
    pending: set[str] = attrs.Factory(set)  # layers the current step calibrates (not yet done)

    def bind(self, layer_names: Iterable[str], device: torch.device) -> None:
        """One `[2]` tensor of 1.0 per layer; nothing calibrated yet."""
        self.tensors = {
            name: torch.ones(2, dtype=torch.float32, device=device) for name in layer_names
        }
        self.fixed = set() if self.calibrate else set(self.tensors)
        self.pending = set()

    def begin_step(self, has_keys: bool, capturing: bool) -> None:
        """Host side of a step (`prep_forward`): the layers not calibrated yet become pending
        when the step writes keys and is not a CUDA-graph capture."""
        eligible = has_keys and not capturing
        self.pending = set(self.tensors) - self.fixed if eligible else set()

    def take_pending(self, name: str) -> bool:
        """True once per pending layer, which is then fixed: its first `forward` of the step
        calibrates it (a repeated call, such as a warm-up, does not)."""
        if name not in self.pending:
            return False
        self.pending.discard(name)
        self.fixed.add(name)
        return True

    def of(self, layer: LayerConfig, given: torch.Tensor | None) -> torch.Tensor:
        """The layer's `[2]` scales: the checkpoint's `given` (checked), else its own."""
        own = self.tensors[layer.name]
        if given is None:
            return own
        if given.shape != (2,) or given.dtype != torch.float32 or given.device != own.device:
            raise ValueError(
                f"layer {layer.name}: kv_scales must be a [2] float32 tensor (k_scale, v_scale) "
                f"on {own.device}, got {given.dtype} {tuple(given.shape)} on {given.device}"
            )
        return given

    def for_layer(
        self,
        layer: LayerConfig,
        given: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
        written: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A forward's `[2]` scales: the checkpoint's `given`, else the layer's own, calibrated
        first from the keys and values `[N, ...]` this step writes (rows where `written`) if the
        layer is pending."""
        scales = self.of(layer, given)
        if given is None and self.take_pending(layer.name):
            self.calibrate_layer(layer.name, k, v, written)
        return scales

    def calibrate_layer(
        self, name: str, k: torch.Tensor, v: torch.Tensor, written: torch.Tensor | None = None
    ) -> None:
        """Set the layer's scales from this step's keys and values `[N, Hkv, D]` (the rows
        where `written [N]`, or all); device ops only, no host sync."""
        scales = torch.stack([calibrated_scale(k, written), calibrated_scale(v, written)])
        self.tensors[name].copy_(scales)


def step_writes_keys(
    common: CommonAttentionMetadata, group_ids: Iterable[int], cross: bool
) -> bool:
    """Whether a step writes keys into the caches of these groups: it has tokens, or for
    cross-attention, encoder slots (a decode step writes no encoder keys)."""
    if cross:
        return any(common.slot_mappings[gid].numel() for gid in group_ids)
    return common.num_actual_tokens > 0


def fp8_scales(backend: Any) -> KVScales | None:
    """A `KVScales` for a backend whose cache dtype is fp8 (calibrating unless the backend is
    batch-invariant), else None."""
    if not is_fp8_kv(backend.kv_cache_dtype):
        return None
    return KVScales(calibrate=not backend.batch_invariant)


class FP8KVBackend(AttentionBackend[PlanT]):
    """A backend whose cache may hold fp8 e4m3 (`kv_cache_dtype="fp8"` or `fp8_e4m3`): it keeps
    each layer's scales in `kv_scales` (None when the cache holds the model dtype), bound with
    the caches. Subclass it as `X(FP8KVBackend[MyPlan], AttentionBackend[MyPlan])`: the second
    base declares the plan type where the contract reads it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**fp8_name_as_dtype(kwargs))
        self.kv_scales: KVScales | None = fp8_scales(self)

    def bind_kv_caches(self, kv_caches: dict[str, Any], block_table_map: dict[str, int]) -> None:
        super().bind_kv_caches(kv_caches, block_table_map)
        if self.kv_scales is not None and kv_caches:
            self.kv_scales.bind(kv_caches, next(iter(kv_caches.values())).device)

    def _layer_scales(
        self,
        layer: LayerConfig,
        given: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """fp8 cache: the layer's `[2]` K/V scales, calibrated first from the keys and values
        `[N, ...]` this step writes if it is pending (with `slots [W]`: the first W rows, those
        whose slot is >= 0; else every row); the checkpoint's `given` scales are never
        calibrated. None for a cache of the model dtype."""
        if self.kv_scales is None:
            return None
        scales = self.kv_scales.of(layer, given)
        if given is None and self.kv_scales.take_pending(layer.name):
            written = None
            if slots is not None:  # the mask is built only when calibrating: once per layer
                k, v, written = k[: slots.shape[0]], v[: slots.shape[0]], slots >= 0
            self.kv_scales.calibrate_layer(layer.name, k, v, written)
        return scales
