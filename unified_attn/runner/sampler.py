"""Token sampling in vLLM's order.

1. Log-probabilities, when a request asks for them, come from the model's raw logits (vLLM's
   default `raw_logprobs`): nothing below changes them.
2. `min_tokens`: until a request has that many output tokens, its EOS (unless `ignore_eos`) and
   `stop_token_ids` logits are -inf.
3. Penalties: repetition (prompt and output tokens), then frequency and presence (output tokens).
4. Greedy requests take the argmax; the others divide by the temperature, apply top-k then top-p
   and draw, from their own generator when seeded.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from unified_attn.request import Request
from unified_attn.sampling_params import SamplingParams


@attrs.frozen
class TokenLogprobs:
    """Raw log-probabilities of one sampled row: the sampled token's, its rank in the vocabulary
    (1 = the most likely; tokens with an equal log-probability count as ahead), and the
    `SamplingParams.logprobs` most likely tokens, best first."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@attrs.frozen
class SamplerOutput:
    """One token per row, and the log-probabilities of the rows that asked for them."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) on one row `[V]` of float32 logits."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the mass before it already reaches top_p (the top token always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    output_token_ids: Sequence[int],
    params: SamplingParams,
) -> torch.Tensor:
    """vLLM's penalties on one row `[V]`: tokens seen in the prompt (`prompt_mask`, bool `[V]`;
    None when `repetition_penalty` is 1) or the output have their logit divided by
    `repetition_penalty` if positive, multiplied by it if not; then every output occurrence
    subtracts `frequency_penalty` and every distinct output token `presence_penalty`."""
    counts = torch.bincount(
        torch.tensor(list(output_token_ids), dtype=torch.int64, device=logits.device),
        minlength=logits.shape[-1],
    ).to(logits.dtype)
    in_output = counts > 0
    if params.repetition_penalty != 1.0:
        assert prompt_mask is not None
        seen = prompt_mask | in_output
        penalty = torch.where(seen, params.repetition_penalty, 1.0)
        logits = logits * torch.where(logits > 0, 1.0 / penalty, penalty)
    return logits - params.frequency_penalty * counts - params.presence_penalty * in_output


def stop_token_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The tokens `min_tokens` holds back: the request's stop tokens and, unless it ignores EOS,
    the model's EOS tokens."""
    return [*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)]


class Sampler:
    """Samples one token per row; a seeded request keeps its own generator for its whole life
    (across preemption), others share the engine's."""

    def __init__(
        self, device: torch.device, seed: int = 0, eos_token_ids: Sequence[int] = ()
    ) -> None:
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}
        # request id -> bool [V]: the prompt's tokens, for `repetition_penalty` (built once)
        self.prompt_masks: dict[str, torch.Tensor] = {}

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """One token per row of `logits [N, V]` (float32); row `i` belongs to `requests[i]`."""
        processed = self._process(logits, requests)
        tokens = processed.argmax(dim=-1).tolist()
        for i, request in enumerate(requests):
            params: SamplingParams = request.sampling_params
            if not params.greedy:
                probs = torch.softmax(filter_logits(processed[i], params), dim=-1)
                generator = self._generator(request.request_id, params)
                tokens[i] = int(torch.multinomial(probs, 1, generator=generator).item())
        return SamplerOutput(tokens, self._logprobs(logits, tokens, requests))

    def _process(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """`min_tokens` masks and penalties, on a copy, for the rows that have them."""
        rows = [i for i, r in enumerate(requests) if self._needs_processing(r)]
        if not rows:
            return logits
        out = logits.clone()
        for i in rows:
            out[i] = self._process_row(logits[i], requests[i])
        return out

    @staticmethod
    def _needs_processing(request: Request) -> bool:
        params: SamplingParams = request.sampling_params
        return params.has_penalties or request.num_output_tokens < params.min_tokens

    def _process_row(self, row: torch.Tensor, request: Request) -> torch.Tensor:
        params: SamplingParams = request.sampling_params
        if request.num_output_tokens < params.min_tokens:
            row = row.clone()
            row[stop_token_ids(params, self.eos_token_ids)] = float("-inf")
        if params.has_penalties:
            mask = self._prompt_mask(request, row) if params.repetition_penalty != 1.0 else None
            row = apply_penalties(row, mask, request.output_token_ids, params)
        return row

    def _prompt_mask(self, request: Request, row: torch.Tensor) -> torch.Tensor:
        mask = self.prompt_masks.get(request.request_id)
        if mask is None:
            mask = torch.zeros(row.shape[-1], dtype=torch.bool, device=row.device)
            ids = torch.tensor(request.prompt_token_ids, dtype=torch.int64, device=row.device)
            mask[ids] = True
            self.prompt_masks[request.request_id] = mask
        return mask

    def _logprobs(
        self, logits: torch.Tensor, tokens: list[int], requests: Sequence[Request]
    ) -> list[TokenLogprobs | None]:
        """Raw log-probabilities of the rows whose requests set `SamplingParams.logprobs`."""
        out: list[TokenLogprobs | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not rows:
            return out
        logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
        sampled = torch.tensor([tokens[i] for i in rows], device=logprobs.device)
        sampled_lp = logprobs.gather(1, sampled[:, None])
        ranks = (logprobs >= sampled_lp).sum(dim=-1).tolist()
        k = max(requests[i].sampling_params.logprobs for i in rows)
        top_lp, top_ids = torch.topk(logprobs, k, dim=-1)
        top_lp_rows, top_id_rows = top_lp.tolist(), top_ids.tolist()
        for j, (i, value) in enumerate(zip(rows, sampled_lp[:, 0].tolist(), strict=True)):
            k_i = requests[i].sampling_params.logprobs
            out[i] = TokenLogprobs(
                tokens[i],
                value,
                ranks[j],
                tuple(top_id_rows[j][:k_i]),
                tuple(top_lp_rows[j][:k_i]),
            )
        return out

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.default_generator
        if request_id not in self.generators:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            self.generators[request_id] = gen
        return self.generators[request_id]

    def drop(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.prompt_masks.pop(request_id, None)
