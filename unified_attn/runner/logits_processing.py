"""Steps 2-4 of sampling (`sampler.py`'s docstring: allowed tokens, bad words, `min_tokens`,
logit bias, penalties) on every row of a step that needs them at once: a few batched ops per
kind, whatever the number of rows, each fed by one small host-to-device copy, and no host
synchronisation (an overlapped step runs them with its forward queued).

Penalties read how often each token occurs in a request's output. `OutputCounts` keeps those
counts on the device, one `[V]` row per request, and adds only the tokens output since the
request's last step (usually one), so a step's host work does not grow with the outputs'
length. The host's `output_token_ids` stay the truth: a request whose outputs do not extend
what was counted (shorter, or a different last counted token) is counted again from them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import torch

from unified_attn.runner.sampling_ops import to_device
from unified_attn.sampling_params import SamplingParams


class Request(Protocol):
    """What steps 2-4 read of a request: a `request.Request`, or `sampler.ExtendedRequest` (its
    outputs with a draft or the token in flight)."""

    @property
    def request_id(self) -> str: ...
    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def bad_words_token_ids(self) -> list[list[int]]: ...
    @property
    def num_output_tokens(self) -> int: ...


def penalize(
    logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor | None,
    params: Sequence[SamplingParams],
) -> torch.Tensor:  # fmt: skip
    """vLLM's penalties on rows `[P, V]` (float32) with each row's output token `counts`
    `[P, V]` and the tokens of its prompt (`prompt_seen`, bool `[P, V]`; None when no row has a
    repetition penalty): a token seen in the prompt or the output has its logit divided by
    `repetition_penalty` if positive, multiplied by it if not; then every output occurrence
    subtracts `frequency_penalty` and every distinct output token `presence_penalty`."""

    def column(values: list[float]) -> torch.Tensor:
        return to_device(values, logits.dtype, logits.device)[:, None]

    in_output = counts > 0
    if prompt_seen is not None:  # as vLLM's: divided (not times the reciprocal), bit for bit
        penalty = torch.where(prompt_seen | in_output,
                              column([p.repetition_penalty for p in params]), 1.0)  # fmt: skip
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if any(p.frequency_penalty for p in params):  # a zero term changes nothing: skipped
        logits = logits - column([p.frequency_penalty for p in params]) * counts
    if any(p.presence_penalty for p in params):
        logits = logits - column([p.presence_penalty for p in params]) * in_output
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    output_token_ids: Sequence[int],
    params: SamplingParams,
) -> torch.Tensor:
    """`penalize` on one row `[V]` whose output is `output_token_ids` (`prompt_mask`: bool `[V]`,
    None when `repetition_penalty` is 1)."""
    counts = count_tokens([list(output_token_ids)], logits.shape[-1], logits.device)
    seen = None if prompt_mask is None else prompt_mask[None]
    return penalize(logits[None], counts, seen, [params])[0]


def count_tokens(rows: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """float32 `[len(rows), vocab]`: how often each token occurs in each row, added with
    `index_put_` (exact: sums of ones; not `bincount`, which reads the largest id on the host)."""
    counts = torch.zeros(len(rows), vocab, dtype=torch.float32, device=device)
    at = [i for i, row in enumerate(rows) for _ in row]
    if at:
        tokens = [t for row in rows for t in row]
        counts.index_put_(pair_index(at, tokens, device), torch.ones(len(at), device=device),
                          accumulate=True)  # fmt: skip
    return counts


def pair_index(
    rows: Sequence[int], tokens: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    return to_device(rows, torch.int64, device), to_device(tokens, torch.int64, device)


def ban_bad_words(
    logits: torch.Tensor, bad_words: Sequence[Sequence[int]], output_token_ids: Sequence[int]
) -> torch.Tensor:
    """vLLM's bad words on one row `[V]` (`banned_tokens`' tokens at -inf)."""
    banned = banned_tokens(bad_words, output_token_ids)
    if not banned:
        return logits
    return logits.index_fill(0, to_device(banned, torch.int64, logits.device), float("-inf"))


def banned_tokens(bad_words: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """vLLM's bad words: a word's last token is banned when the output ends with the word's
    other tokens (a one-token word: always)."""
    banned = []
    for word in bad_words:
        prefix = list(word[:-1])
        if len(prefix) <= len(output_token_ids) and (
            not prefix or list(output_token_ids[-len(prefix) :]) == prefix
        ):
            banned.append(word[-1])
    return banned


def stop_token_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The tokens `min_tokens` holds back: the request's stop tokens and, unless it ignores EOS,
    the model's EOS tokens."""
    return [*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)]


def needs_processing(request: Request) -> bool:
    params: SamplingParams = request.sampling_params
    return (
        params.has_penalties
        or params.changes_logits
        or request.num_output_tokens < params.min_tokens
    )


def reads_outputs(request: Request) -> bool:
    """Whether sampling `request` reads its output tokens (penalties, bad words) or their count
    (`min_tokens`), so that an overlapped step needs the token still in flight
    (`overlap.with_tokens_in_flight`)."""
    params: SamplingParams = request.sampling_params
    return params.has_penalties or params.min_tokens > 0 or bool(request.bad_words_token_ids)


@attrs.define
class _Counted:
    slot: int
    length: int = 0  # output tokens counted
    last: int = -1  # the last of them


class OutputCounts:
    """Output token counts `[slots, V]` (float32) and prompt tokens `[slots, V]` (bool) on the
    device, one slot per request with penalties, grown by doubling, freed by `drop`."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)
        self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.rows: dict[str, _Counted] = {}
        self.free: list[int] = []

    def slots_of(self, requests: Sequence[Request]) -> torch.Tensor:
        """The requests' slots `[P]` (int64, on the device), their counts brought up to their
        `output_token_ids` by the ops this queues."""
        taken: list[int] = []  # slots new to a request: counts and prompt rows from zero
        recounted: list[int] = []  # outputs that do not extend what was counted
        prompt: tuple[list[int], list[int]] = ([], [])  # (slot, token) pairs
        outputs: tuple[list[int], list[int]] = ([], [])
        slots = []
        for request in requests:
            counted = self.rows.get(request.request_id)
            if counted is None:
                counted = self.rows[request.request_id] = _Counted(self._take())
                taken.append(counted.slot)
                prompt[0].extend([counted.slot] * len(request.prompt_token_ids))
                prompt[1].extend(request.prompt_token_ids)
            ids = request.output_token_ids
            if counted.length > len(ids) or (
                counted.length and ids[counted.length - 1] != counted.last
            ):
                recounted.append(counted.slot)
                counted.length = 0
            new = ids[counted.length :]
            outputs[0].extend([counted.slot] * len(new))
            outputs[1].extend(new)
            counted.length, counted.last = len(ids), ids[-1] if ids else -1
            slots.append(counted.slot)
        self._queue(taken, recounted, prompt, outputs)
        return to_device(slots, torch.int64, self.device)

    def drop(self, request_id: str) -> None:
        counted = self.rows.pop(request_id, None)
        if counted is not None:
            self.free.append(counted.slot)

    def _queue(
        self, taken: list[int], recounted: list[int], prompt: tuple[list[int], list[int]],
        outputs: tuple[list[int], list[int]],
    ) -> None:  # fmt: skip
        if taken or recounted:
            self.counts.index_fill_(0, to_device(taken + recounted, torch.int64, self.device), 0.0)
        if taken:
            self.prompt.index_fill_(0, to_device(taken, torch.int64, self.device), False)
        if prompt[0]:
            marks = torch.ones(len(prompt[0]), dtype=torch.bool, device=self.device)
            self.prompt.index_put_(pair_index(*prompt, self.device), marks)
        if outputs[0]:
            ones = torch.ones(len(outputs[0]), device=self.device)
            self.counts.index_put_(pair_index(*outputs, self.device), ones, accumulate=True)

    def _take(self) -> int:
        if not self.free:
            old = self.counts.shape[0]
            grown = max(8, 2 * old)
            self.counts = _grown(self.counts, grown)
            self.prompt = _grown(self.prompt, grown)
            self.free = list(range(grown - 1, old - 1, -1))
        return self.free.pop()


def _grown(table: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros(rows, table.shape[1], dtype=table.dtype, device=table.device)
    out[: table.shape[0]] = table
    return out


class LogitsProcessor:
    """Steps 2-4 for a step's rows (`process`), or for rows whose outputs are not the request's
    own (`process_rows(..., counted=False)`: a draft position being verified)."""

    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.output_counts: OutputCounts | None = None
        # request id -> bool [V]: the tokens outside `allowed_token_ids` (built once)
        self.disallowed_masks: dict[str, torch.Tensor] = {}

    def process(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """`logits [N, V]` with the rows of the requests that need it processed (a new tensor;
        `logits` itself when no row does)."""
        rows = [i for i, r in enumerate(requests) if needs_processing(r)]
        if not rows:
            return logits
        if len(rows) == len(requests):
            return self.process_rows(logits.clone(), requests)
        index = to_device(rows, torch.int64, logits.device)
        part = self.process_rows(logits.index_select(0, index), [requests[i] for i in rows])
        return logits.index_copy(0, index, part)

    def process_rows(
        self, logits: torch.Tensor, requests: Sequence[Request], counted: bool = True
    ) -> torch.Tensor:
        """Row `i` of `logits [P, V]` (changed in place) processed for `requests[i]`; `counted`:
        the penalties read `OutputCounts` (False: the rows' outputs counted afresh)."""
        allowed = [i for i, r in enumerate(requests) if r.sampling_params.allowed_token_ids]
        if allowed:
            masks = torch.stack([self._disallowed(requests[i], logits) for i in allowed])
            self._rows(logits, allowed, lambda part: part.masked_fill_(masks, float("-inf")))
        banned_at, banned = self._banned(requests)
        if banned_at:
            minus_inf = torch.full((len(banned),), float("-inf"), device=logits.device)
            logits.index_put_(pair_index(banned_at, banned, logits.device), minus_inf)
        biased = [(i, t, b) for i, r in enumerate(requests)
                  for t, b in (r.sampling_params.logit_bias or {}).items()]  # fmt: skip
        if biased:
            at, tokens, values = zip(*biased, strict=True)
            biases = to_device(values, logits.dtype, logits.device)
            logits.index_put_(pair_index(at, tokens, logits.device), biases, accumulate=True)
        penalized = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
        if penalized:
            self._penalties(logits, penalized, [requests[i] for i in penalized], counted)
        return logits

    def drop(self, request_id: str) -> None:
        self.disallowed_masks.pop(request_id, None)
        if self.output_counts is not None:
            self.output_counts.drop(request_id)

    def _banned(self, requests: Sequence[Request]) -> tuple[list[int], list[int]]:
        """(row, token) pairs at -inf: bad words and the tokens `min_tokens` holds back."""
        at: list[int] = []
        tokens: list[int] = []
        for i, request in enumerate(requests):
            params: SamplingParams = request.sampling_params
            found = banned_tokens(request.bad_words_token_ids, request.output_token_ids)
            if request.num_output_tokens < params.min_tokens:
                found += stop_token_ids(params, self.eos_token_ids)
            at += [i] * len(found)
            tokens += found
        return at, tokens

    def _penalties(
        self, logits: torch.Tensor, rows: list[int], requests: list[Request], counted: bool
    ) -> None:
        params = [r.sampling_params for r in requests]
        repeats = any(p.repetition_penalty != 1.0 for p in params)
        vocab, device = logits.shape[-1], logits.device
        if counted:
            if self.output_counts is None:
                self.output_counts = OutputCounts(vocab, device)
            slots = self.output_counts.slots_of(requests)
            counts = self.output_counts.counts.index_select(0, slots)
            seen = self.output_counts.prompt.index_select(0, slots) if repeats else None
        else:
            counts = count_tokens([r.output_token_ids for r in requests], vocab, device)
            seen = count_tokens([r.prompt_token_ids for r in requests], vocab, device) > 0
            seen = seen if repeats else None
        self._rows(logits, rows, lambda part: penalize(part, counts, seen, params))

    def _disallowed(self, request: Request, logits: torch.Tensor) -> torch.Tensor:
        mask = self.disallowed_masks.get(request.request_id)
        if mask is None:
            mask = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
            allowed = list(request.sampling_params.allowed_token_ids or ())
            mask.index_fill_(0, to_device(allowed, torch.int64, logits.device), False)
            self.disallowed_masks[request.request_id] = mask
        return mask

    @staticmethod
    def _rows(
        logits: torch.Tensor, rows: list[int], change: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """`logits[rows] = change(logits[rows])`, without the gather when `rows` is every row."""
        if len(rows) == logits.shape[0]:
            logits.copy_(change(logits))
            return
        index = to_device(rows, torch.int64, logits.device)
        logits.index_copy_(0, index, change(logits.index_select(0, index)))
