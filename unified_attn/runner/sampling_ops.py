"""Sampling on a whole batch of rows `[N, V]` at once, without a host synchronisation.

`SamplingTensors` holds the filters of `SamplingParams` as one tensor per parameter (built from
Python lists with one host-to-device copy each); `filter_batch` applies temperature, min-p,
top-k then top-p row by row with batched ops; `exponential_race` draws one token per row: the
argmax of the probabilities divided by exponential noise (the argmax of `p_i / E_i` falls on
token i with probability `p_i`, as a multinomial draw), each seeded row with noise from its own
generator so its draws do not depend on the rest of the batch. Every op works along the
vocabulary dimension of one row at a time (softmax, sort, cumsum, argmax), so a row's result
does not depend on the rows beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch

from unified_attn.runner.device import pinned_to
from unified_attn.sampling_params import SamplingParams


def to_device(
    values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`values` as a tensor on `device`, without the host waiting for the device
    (`runner/device.pinned_to`)."""
    return pinned_to(torch.tensor(values, dtype=dtype), device)


@attrs.frozen
class SamplingTensors:
    """The filters of the rows of a batch, one entry per row; a parameter no row uses is None
    (its stage is skipped).

    `temperature [N]` float32 (> 0); `min_p [N]` float32 (0: off); `top_k [N]` int64 (the
    vocabulary size: off) with `max_top_k` the largest k in use (the top-k stage reads that
    many values per row); `top_p [N]` float32 (1: off)."""

    temperature: torch.Tensor | None
    min_p: torch.Tensor | None
    top_k: torch.Tensor | None
    max_top_k: int
    top_p: torch.Tensor | None

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], vocab_size: int, device: torch.device
    ) -> SamplingTensors:
        """The tensors of `params` (sampled rows: temperature > 0), one per stage in use."""
        temperature = [p.temperature for p in params]
        min_p = [p.min_p for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        max_top_k = max((k for k in top_k if k < vocab_size), default=0)
        f32 = torch.float32
        return cls(
            temperature=None
            if all(t == 1.0 for t in temperature)
            else to_device(temperature, f32, device),
            min_p=to_device(min_p, f32, device) if any(m > 0.0 for m in min_p) else None,
            top_k=to_device(top_k, torch.int64, device) if max_top_k else None,
            max_top_k=max_top_k,
            top_p=to_device(top_p, f32, device) if any(p < 1.0 for p in top_p) else None,
        )


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """`logits [N, V]` with the tokens whose probability is below `min_p [N]` times the row's
    largest at -inf (min-p 0 drops nothing)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """`logits [N, V]` with every logit below the row's k-th largest at -inf (`top_k [N]`; ties
    at the k-th value all stay; k = V keeps the row). Reads only the `max_top_k` largest values
    of each row (no full sort)."""
    largest = torch.topk(logits, max_top_k, dim=-1).values
    kth = largest.gather(1, (top_k.clamp(max=max_top_k) - 1)[:, None])
    kth = kth.masked_fill((top_k >= logits.shape[-1])[:, None], float("-inf"))  # no top-k
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`logits [N, V]` walked in descending order (equal logits in vocabulary order: a stable
    sort), dropping a token once the probability mass before it already reaches the row's
    `top_p [N]` (the top token always stays; top-p 1 drops nothing)."""
    ordered, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(ordered, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    limit = torch.where(top_p < 1.0, top_p, float("inf"))  # exactly "off" for top-p 1
    ordered = ordered.masked_fill(before >= limit[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def filter_batch(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Temperature, then min-p, top-k, then top-p on `logits [N, V]` (float32); the stages no
    row uses are skipped. Returns new logits; the filtered tokens are at -inf."""
    if tensors.temperature is not None:
        logits = logits / tensors.temperature[:, None]
    if tensors.min_p is not None:
        logits = apply_min_p(logits, tensors.min_p)
    if tensors.top_k is not None:
        logits = apply_top_k(logits, tensors.top_k, tensors.max_top_k)
    if tensors.top_p is not None:
        # after top-k, most of a row is -inf, which the sort gets through faster
        logits = apply_top_p(logits, tensors.top_p)
    return logits


def exponential_race(
    probs: torch.Tensor,
    generators: Mapping[int, torch.Generator],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """One token per row of `probs [N, V]` (non-negative, need not sum to 1), each drawn with
    its row's probabilities: the argmax of `probs / E` with `E` independent Exp(1) noise.

    Row `i` in `generators` draws its noise with that generator alone (V values per draw), so
    its token depends only on its own row and generator; the other rows share
    `default_generator` (None: torch's default). Returns int64 `[N]` on the device; nothing
    is read back to the host."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_(generator=default_generator)
    for i, generator in generators.items():
        noise[i].exponential_(generator=generator)
    # Exp(1) noise of exactly 0 would make 0 / 0 a NaN that argmax would pick
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def sample_batch(
    logits: torch.Tensor,
    tensors: SamplingTensors,
    generators: Mapping[int, torch.Generator],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """Filters `logits [N, V]` (`filter_batch`) and draws one token per row
    (`exponential_race`); int64 `[N]` on the device."""
    probs = torch.softmax(filter_batch(logits, tensors), dim=-1)
    return exponential_race(probs, generators, default_generator)
