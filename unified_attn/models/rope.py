"""Rotary position embeddings (default, llama3, linear, YaRN), numerically as transformers."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from unified_attn.kernels.layers.rotary import apply_rotary
from unified_attn.models.config import ModelConfig, RopeScaling


def rope_inv_freq(head_size: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies `[head_size // 2]` float32, computed exactly as transformers does."""
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_size, theta, scaling)
    return _llama3_scale(inv_freq, scaling)


def rope_attention_scaling(scaling: RopeScaling | None) -> float:
    """Factor transformers multiplies cos and sin by: YaRN's mscale, 1.0 for the other types."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        numerator = _yarn_mscale(scaling.factor, scaling.mscale)
        return float(numerator / _yarn_mscale(scaling.factor, scaling.mscale_all_dim))
    return _yarn_mscale(scaling.factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_correction_dim(rotations: float, dim: int, base: float, old_len: int) -> float:
    """The dimension whose wavelength fits `rotations` times into the original context."""
    return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn_inv_freq(dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    # Dimensions rotating more than beta_fast times in the original context keep their frequency
    # (extrapolation), those rotating less than beta_slow times are divided by `factor`
    # (interpolation), a linear ramp blends between.
    old_len = s.original_max_position_embeddings
    low = _yarn_correction_dim(s.beta_fast, dim, base, old_len)
    high = _yarn_correction_dim(s.beta_slow, dim, base, old_len)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE (Llama 4, transformers' complex form): channels `(2i, 2i + 1)` are one
    complex number rotated by angle i, in float32. x `[T, H, D]`, cos/sin `[T, 1, D / 2]`."""
    pairs = x.float().unflatten(-1, (-1, 2))  # [T, H, D / 2, 2]
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE over the whole head, with the model's global RoPE settings or (`local=True`) those
    of its local layers (`ModelConfig.rope_of`); neox-style (rotate_half) or, with
    `rope_style="interleaved"`, on adjacent channel pairs (`rotate_pairs`). With
    `partial_rotary_factor` below 1 only the first `rotary_dim` channels rotate (neox).

    Fused (`set_fused`): q and k rotate in place in one kernel, from a `[cos | sin]` table of
    the step's positions (`cos_sin_table`), computed once per step inside `step(positions)`
    for every layer sharing this module (else once per call)."""

    inv_freq: torch.Tensor
    _step: tuple[torch.Tensor, torch.Tensor] | None

    def __init__(self, config: ModelConfig, *, local: bool = False) -> None:
        super().__init__()
        theta, scaling = config.rope_theta, config.rope_scaling
        if local and config.local_rope_theta is not None:
            theta, scaling = config.local_rope_theta, config.local_rope_scaling
        self.rotary_dim, self.theta, self.scaling = config.rotary_dim, theta, scaling
        self.partial = config.rotary_dim < config.head_size
        self.interleaved = config.rope_style == "interleaved"
        self.attention_scaling = rope_attention_scaling(scaling)
        self.register_buffer("inv_freq", self._compute(), persistent=False)
        self.fused, self._step = False, None

    def set_fused(self, enabled: bool) -> None:
        self.fused = enabled

    def _compute(self) -> torch.Tensor:
        return rope_inv_freq(self.rotary_dim, self.theta, self.scaling)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute `inv_freq` in float32 on `device` (after meta construction or a cast)."""
        self.inv_freq = self._compute().to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions[:, None].float() * self.inv_freq.float()  # [T, D / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def cos_sin_table(self, positions: torch.Tensor) -> torch.Tensor:
        """`[T, rotary_dim]` float32: the cosines of each token's angles, then their sines,
        attention-scaled: the values `cos_sin` gives (before its cast), once each."""
        freqs = positions[:, None].float() * self.inv_freq.float()  # [T, rotary_dim / 2]
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        return table if self.attention_scaling == 1.0 else table * self.attention_scaling

    @contextmanager
    def step(self, positions: torch.Tensor) -> Iterator[None]:
        """Within it, fused calls with these `positions` share one `cos_sin_table`."""
        if not self.fused:
            yield
            return
        self._step = (positions, self.cos_sin_table(positions))
        try:
            yield
        finally:
            self._step = None

    def _table(self, positions: torch.Tensor) -> torch.Tensor:
        """The step's table when inside `step(positions)`, else computed now."""
        step = self._step
        if step is not None and step[0] is positions:
            return step[1]
        return self.cos_sin_table(positions)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[T, Hq, D]`, k `[T, Hkv, D]` -> rotated, same shapes and dtype (fused: q and k
        themselves, rotated in place)."""
        if self.fused:
            style = "interleaved" if self.interleaved else "neox"
            apply_rotary(q, k, self._table(positions), style=style)
            return q, k
        if self.interleaved:
            return self._rotate_pairs(positions, q, k)
        cos, sin = self.cos_sin(positions, q.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.partial:
            d = self.rotary_dim  # the rotated channels; the rest pass through

            def rotate(x: torch.Tensor) -> torch.Tensor:
                head = x[..., :d]
                return torch.cat([head * cos + rotate_half(head) * sin, x[..., d:]], dim=-1)

            return rotate(q), rotate(k)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def _rotate_pairs(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.float()  # [T, D / 2]
        cos = (freqs.cos() * self.attention_scaling)[:, None, :]
        sin = (freqs.sin() * self.attention_scaling)[:, None, :]
        return rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
