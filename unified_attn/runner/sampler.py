"""Token sampling in vLLM's order.

1. Log-probabilities, when a request asks for them, come from the model's raw logits (vLLM's
   default `raw_logprobs`): nothing below changes them.
2. `allowed_token_ids`: every other token's logit is -inf. `bad_words`: a word's last token is
   -inf when the output so far ends with the word's other tokens.
3. `min_tokens`: until a request has that many output tokens, its EOS (unless `ignore_eos`) and
   `stop_token_ids` logits are -inf. Then `logit_bias` is added.
4. Penalties: repetition (prompt and output tokens), then frequency and presence (output tokens).
5. Greedy requests take the argmax. The others, all together (`sampling_ops`): divide by the
   temperature, apply min-p, top-k, then top-p, and draw with the exponential race (the argmax
   of the probabilities divided by Exp(1) noise); a seeded request's noise comes from its own
   generator, so its tokens do not depend on the rest of the batch.

Steps 2-4 work on the rows that need them, all at once (`logits_processing`), step 5 on the
whole batch, neither with a host synchronisation: the only transfer to the host is the tokens
(and the log-probabilities of the rows that ask for them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from unified_attn.models.invariant import log_softmax
from unified_attn.request import Request
from unified_attn.runner.logits_processing import LogitsProcessor, needs_processing
from unified_attn.runner.logprobs import (
    StepLogprobs,
    TokenLogprobs,
    logprob_tensors,
    token_logprobs,
)
from unified_attn.runner.sampling_ops import (
    SamplingTensors,
    exponential_race,
    filter_batch,
    sample_batch,
    to_device,
)
from unified_attn.sampling_params import SamplingParams


@attrs.frozen
class SamplerOutput:
    """One token per row, and the log-probabilities of the rows that asked for them."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p, top-k, then top-p (nucleus) on one row `[V]` of float32
    logits (`sampling_ops.filter_batch` on a batch of one)."""
    tensors = SamplingTensors.build([params], logits.shape[-1], logits.device)
    return filter_batch(logits[None], tensors)[0]


def _torch_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1)


class Sampler:
    """Samples one token per row; a seeded request keeps its own generator for its whole life
    (across preemption), others share the engine's."""

    def __init__(
        self,
        device: torch.device,
        seed: int = 0,
        eos_token_ids: Sequence[int] = (),
        *,
        batch_invariant: bool = False,
    ) -> None:
        self.device = device
        # Batch-invariant mode: log-probabilities of each row on its own (the rest of sampling
        # works along the vocabulary of one row at a time, or takes the argmax).
        self.log_softmax: Callable[[torch.Tensor], torch.Tensor] = (
            log_softmax if batch_invariant else _torch_log_softmax
        )
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}
        self.logits_processor = LogitsProcessor(eos_token_ids)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """One token per row of `logits [N, V]` (float32); row `i` belongs to `requests[i]`."""
        tokens: list[int] = self.sample_ids(logits, requests).tolist()  # the one transfer
        return SamplerOutput(tokens, self._logprobs(logits, tokens, requests))

    def sample_ids(
        self, logits: torch.Tensor, requests: Sequence[Request | ExtendedRequest]
    ) -> torch.Tensor:
        """`sample`'s tokens `[N]` int64, left on the device (no host synchronisation)."""
        processed = self.logits_processor.process(logits, requests)
        sampled = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if not sampled:
            chosen = processed.argmax(dim=-1)
        elif len(sampled) == len(requests):
            chosen = self._draw(processed, requests)
        else:
            rows = to_device(sampled, torch.int64, processed.device)
            drawn = self._draw(processed.index_select(0, rows), [requests[i] for i in sampled])
            chosen = processed.argmax(dim=-1).index_copy(0, rows, drawn)
        return chosen

    def _draw(
        self, logits: torch.Tensor, requests: Sequence[Request | ExtendedRequest]
    ) -> torch.Tensor:
        """One token per row of `logits [S, V]` of sampled requests, on the device."""
        params = [r.sampling_params for r in requests]
        tensors = SamplingTensors.build(params, logits.shape[-1], logits.device)
        generators = {
            j: self._generator(r.request_id, p)
            for j, (r, p) in enumerate(zip(requests, params, strict=True))
            if p.seed is not None
        }
        return sample_batch(logits, tensors, generators, self.default_generator)

    def verify(
        self, logits: torch.Tensor, request: Request, drafts: Sequence[int]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Speculative decoding: row j of `logits [len(drafts) + 1, V]` scores the token after
        the request's tokens and `drafts[:j]`. Returns the accepted drafts and one token of the
        target's own (the correction at the first rejection, or a bonus token after them all),
        with their log-probabilities if asked for.

        Each row is processed as if the drafts before it were already output (`min_tokens`,
        penalties). Greedy: a draft is accepted when it is the row's argmax, so the tokens equal
        decoding without drafts. Sampling: a draft (a point mass) is accepted with the target's
        probability of it, and a rejection draws from the target with the draft's token removed,
        which keeps every token distributed as the target (Leviathan et al., 2023)."""
        params: SamplingParams = request.sampling_params
        if params.greedy and not needs_processing(request):
            return self._verify_greedy(logits, request, drafts)
        tokens: list[int] = []
        outputs = list(request.output_token_ids)
        for j in range(len(drafts) + 1):
            row = self._process_row(logits[j], ExtendedRequest(request, outputs), force=False)
            draft = drafts[j] if j < len(drafts) else None
            token = self._verify_row(row, request, params, draft)
            tokens.append(token)
            if token != draft:
                break
            outputs.append(token)
        rows = logits[: len(tokens)]
        return tokens, self._logprobs(rows, tokens, [request] * len(tokens))

    def _verify_greedy(
        self, logits: torch.Tensor, request: Request, drafts: Sequence[int]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Greedy rows that need no processing: every argmax in one transfer."""
        best = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(drafts) and best[accepted] == drafts[accepted]:
            accepted += 1
        tokens = best[: accepted + 1]
        return tokens, self._logprobs(logits[: len(tokens)], tokens, [request] * len(tokens))

    def _verify_row(
        self, row: torch.Tensor, request: Request, params: SamplingParams, draft: int | None
    ) -> int:
        if params.greedy:
            return int(row.argmax())
        probs = torch.softmax(filter_logits(row, params), dim=-1)
        generator = self._generator(request.request_id, params)
        if draft is not None:
            draw = torch.rand(1, generator=generator, device=probs.device)
            if float(draw) < float(probs[draft]):
                return draft
            probs = probs.clone()
            probs[draft] = 0.0
        return int(exponential_race(probs[None], {0: generator}, None)[0])

    def _process_row(
        self, row: torch.Tensor, request: Request | ExtendedRequest, force: bool = True
    ) -> torch.Tensor:
        """Steps 2-4 of one row `[V]` for `request` as it is (its outputs counted afresh; a
        new tensor), or `row` itself when `force` is False and it needs none of them."""
        if not force and not needs_processing(request):
            return row
        return self.logits_processor.process_rows(row[None].clone(), [request], counted=False)[0]

    def step_logprobs(
        self, logits: torch.Tensor, ids: torch.Tensor, requests: Sequence[Request]
    ) -> StepLogprobs | None:
        """`_logprobs`' values for the rows that ask for them, on the device, with the sampled
        `ids` `[N]` still there (an overlapped step; None when no row asks)."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not rows:
            return None
        index = to_device(rows, torch.int64, logits.device)
        ks = [requests[i].sampling_params.logprobs for i in rows]
        logprobs = self.log_softmax(logits.index_select(0, index).float())
        return StepLogprobs(rows, ks, logprob_tensors(logprobs, ids.index_select(0, index), ks))

    def _logprobs(
        self, logits: torch.Tensor, tokens: list[int], requests: Sequence[Request]
    ) -> list[TokenLogprobs | None]:
        """Raw log-probabilities of the rows whose requests set `SamplingParams.logprobs`."""
        out: list[TokenLogprobs | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if rows:
            found = token_logprobs(
                self.log_softmax(logits[rows].float()),
                [tokens[i] for i in rows],
                [requests[i].sampling_params.logprobs for i in rows],
            )
            for i, lp in zip(rows, found, strict=True):
                out[i] = lp
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
        self.logits_processor.drop(request_id)


@attrs.frozen
class ExtendedRequest:
    """A request as it would be with `output_token_ids` (its own plus accepted drafts, or plus
    the token a step in flight sampled for it): what `min_tokens`, bad words and the penalties
    read when a draft position is verified or an overlapped step samples."""

    request: Request
    output_token_ids: list[int]

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self.request.bad_words_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)
