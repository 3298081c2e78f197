"""What an engine hands back, shaped like vLLM's: `RequestOutput` with one `CompletionOutput` per
completion, `Logprob`s, and the `StreamDelta`s of a stream."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class Logprob:
    """vLLM's `Logprob`: a token's log-probability under the model's raw logits (before penalties
    and temperature), its rank in the vocabulary (1 = the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per generated token: token id -> Logprob, the sampled token first, then the top-k
SampleLogprobs = list[dict[int, Logprob]]
# per prompt token: None for the first, then the token's entry as in SampleLogprobs
PromptLogprobs = list[dict[int, Logprob] | None]


@attrs.define
class CompletionOutput:
    """One generated sequence of a request (vLLM's `CompletionOutput`): `outputs[index]`.

    `token_ids` holds every sampled token, a stop token included; `text` leaves out a stop token
    (or EOS) that ended the sequence and is cut before a stop string. `text` is None for a model
    without a tokenizer; `logprobs` and `cumulative_logprob` are None unless
    `SamplingParams.logprobs` was set, `logits` unless `return_logits` was.
    """

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logits: torch.Tensor | None = None  # [num_generated, vocab] float32, if asked for

    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.frozen
class RequestMetrics:
    """A request's timings and counts, as vLLM's `RequestStateStats`: when it was added and
    produced its first and latest tokens (wall clock, `time.time()`), the first token's
    latency in seconds, tokens generated (all completions) and preemptions."""

    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None
    num_generation_tokens: int
    num_preemptions: int

    @property
    def first_token_latency(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@attrs.define
class RequestOutput:
    """A finished request, shaped like vLLM's: `request_id`, `prompt` (the text, when given as
    text), `prompt_token_ids`, `outputs` (one `CompletionOutput` per `SamplingParams.n`) and
    `finished`.

    The first completion's fields are also kept flat for the engine's callers:
    `output_token_ids`, `text`, `finish_reason` and `logits` are `outputs[0]`'s.
    `num_preemptions` counts over all completions; `prompt_logits` (`[prompt_len, vocab]`
    float32) comes with `SamplingParams.prompt_logits`. As vLLM's: `prompt_logprobs` (None for
    the first prompt token, then each token's entry, with `SamplingParams.prompt_logprobs`),
    `num_cached_tokens` (prompt tokens its first admission read from the prefix cache) and
    `metrics`.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    num_preemptions: int = 0
    prompt_logits: torch.Tensor | None = None  # [prompt_len, vocab] float32, if asked for
    logits: torch.Tensor | None = None  # [num_generated, vocab] float32, if asked for
    prompt: str | None = None
    outputs: list[CompletionOutput] = attrs.Factory(list)
    finished: bool = True
    # encoder-decoder models: the encoder's input (its text, when given as text)
    encoder_prompt_token_ids: list[int] | None = None
    encoder_prompt: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@attrs.frozen
class EncodeOutput:
    """What `LLMEngine.encode` returns per prompt (encoder-only models): the prompt's token ids,
    its text when given as text, and the last layer's hidden states `[num_tokens, hidden_size]`
    (host, the model's dtype)."""

    prompt_token_ids: list[int]
    hidden_states: torch.Tensor
    prompt: str | None = None


@attrs.frozen
class StreamDelta:
    """What one step added to one completion of a streamed request: new token ids, the new text
    (None without a tokenizer; text that may still turn into a stop string is held back until
    it cannot), their log-probabilities if asked for, and on the completion's last delta its
    `finish_reason` and `stop_reason`."""

    request_id: str
    index: int  # which of the request's `n` completions
    token_ids: list[int]
    text: str | None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
