"""Reading prompts: text or token ids, a vLLM-style dict, and the encoder input of
encoder-decoder models; every check that needs the model (vocabulary, lengths, tokenizer)."""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from unified_attn.engine.outputs import EncodeOutput
from unified_attn.models.families.base import ModelKind

# what `generate`, `stream` and `add_request` take as one prompt
PromptType = str | Sequence[int] | Mapping[str, Any]

DECODER_KEYS = ("prompt", "prompt_token_ids")
ENCODER_KEYS = ("encoder_prompt", "encoder_prompt_token_ids")


@attrs.frozen
class ReadPrompt:
    """A prompt's token ids and text (when given as text); for encoder-decoder models also the
    encoder's input."""

    token_ids: list[int]
    text: str | None
    encoder_token_ids: list[int] | None = None
    encoder_text: str | None = None


@attrs.frozen
class PromptReader:
    """Turns what a caller passes into checked token ids for one model.

    Decoder models take text, token ids, `{"prompt": text}` or `{"prompt_token_ids": ids}`.
    Encoder-decoder models take a dict with one of `encoder_prompt` / `encoder_prompt_token_ids`
    and optionally one of the decoder keys (default: the decoder start token), or a plain
    prompt, which is the encoder's input (as vLLM does). Encoder-only models take what decoder
    models take (`LLMEngine.encode`)."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    kind: ModelKind = "decoder"
    decoder_start_token_id: int | None = None
    max_encoder_len: int | None = None

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Text through the tokenizer, or token ids as a list of ints."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids instead of text")
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (bytes, Mapping)) or not isinstance(prompt, Sequence):
            raise ValueError(
                f"a prompt must be text, a list of token ids or a dict with one of "
                f"{list(self._keys())}, got {type(prompt).__name__}"
            )
        ids: list[Any] = list(prompt)
        bad = [t for t in ids if isinstance(t, bool) or not hasattr(t, "__index__")]
        if bad:
            raise ValueError(f"token ids must be ints, got {bad[0]!r} in the prompt")
        return [operator.index(t) for t in ids]

    def read(self, what: str, prompt: Any, *, generating: bool = True) -> ReadPrompt:
        """The checked prompt; `generating` leaves room for at least one generated token."""
        if self.kind == "encoder_decoder":
            return self._read_encoder_decoder(what, prompt)
        if isinstance(prompt, Mapping) and any(k in prompt for k in ENCODER_KEYS):
            raise ValueError(
                f"{what}: {sorted(k for k in prompt if k in ENCODER_KEYS)} given but this "
                f"{self.kind.replace('_', '-')} model has no encoder input; pass the prompt as "
                f"one of {list(DECODER_KEYS)}"
            )
        text, ids = self._read_part(what, prompt)
        self._check(what, "prompt", ids, self.max_model_len - (1 if generating else 0))
        return ReadPrompt(ids, text)

    def _keys(self) -> tuple[str, ...]:
        return DECODER_KEYS + (ENCODER_KEYS if self.kind == "encoder_decoder" else ())

    def _read_encoder_decoder(self, what: str, prompt: Any) -> ReadPrompt:
        encoder: Any = prompt  # a plain prompt is the encoder's input (vLLM's rule)
        decoder: dict[str, Any] = {}
        if isinstance(prompt, Mapping) and any(k in prompt for k in ENCODER_KEYS):
            unknown = sorted(set(prompt) - set(DECODER_KEYS) - set(ENCODER_KEYS))
            if unknown:
                raise ValueError(
                    f"{what}: unknown prompt keys {unknown}; an encoder-decoder prompt has one "
                    f"of {list(ENCODER_KEYS)} and at most one of {list(DECODER_KEYS)}"
                )
            # the encoder keys read as the plain ones ("encoder_prompt" -> "prompt")
            encoder = {
                k.removeprefix("encoder_"): v for k, v in prompt.items() if k in ENCODER_KEYS
            }
            decoder = {k: v for k, v in prompt.items() if k in DECODER_KEYS}
        encoder_text, encoder_ids = self._read_part(what, encoder, "encoder_")
        assert self.max_encoder_len is not None
        self._check(what, "encoder prompt", encoder_ids, self.max_encoder_len)
        if decoder:
            text, ids = self._read_part(what, decoder)
        elif self.decoder_start_token_id is None:
            raise ValueError(
                f"{what}: the model's config has no decoder_start_token_id; give the decoder "
                "prompt as prompt_token_ids"
            )
        else:
            text, ids = None, [self.decoder_start_token_id]
        self._check(what, "prompt", ids, self.max_model_len - 1)
        return ReadPrompt(ids, text, encoder_ids, encoder_text)

    def _read_part(self, what: str, prompt: Any, prefix: str = "") -> tuple[str | None, list[int]]:
        """(text or None, token ids) of text, ids, or a dict with exactly one decoder key
        (`prefix` names the keys in messages: "encoder_" for the encoder's)."""
        if isinstance(prompt, Mapping):
            keys = [k for k in DECODER_KEYS if k in prompt]
            if len(keys) != 1 or set(prompt) - set(DECODER_KEYS):
                raise ValueError(
                    f"{what}: a prompt dict needs exactly one of {list(self._keys())} and "
                    f"nothing else, got the keys {sorted(prefix + k for k in prompt)}"
                )
            prompt = prompt[keys[0]]
            if keys[0] == "prompt" and not isinstance(prompt, str):
                raise ValueError(
                    f"{what}: '{prefix}prompt' must be text, got {type(prompt).__name__}"
                )
            if keys[0] == "prompt_token_ids" and isinstance(prompt, str):
                raise ValueError(f"{what}: '{prefix}prompt_token_ids' must be token ids, got text")
        try:
            token_ids = self.tokenize(prompt)
        except ValueError as error:
            raise ValueError(f"{what}: {error}") from None
        return (prompt if isinstance(prompt, str) else None), token_ids

    def _check(self, what: str, part: str, token_ids: list[int], limit: int) -> None:
        if not token_ids:
            raise ValueError(f"{what}: the {part} is empty; give at least one token")
        if len(token_ids) > limit:
            if part == "encoder prompt":
                reason = f", more than the model's max_encoder_len={self.max_encoder_len}"
            elif limit < self.max_model_len:
                reason = (
                    f" but max_model_len={self.max_model_len} leaves no room to generate; "
                    "shorten the prompt or raise max_model_len"
                )
            else:
                reason = f", more than max_model_len={self.max_model_len}"
            raise ValueError(
                f"{what}: the {part} has {len(token_ids)} tokens{reason}"
                + ("" if "shorten" in reason else "; shorten it")
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            where = "" if part == "prompt" else f" (in the {part})"
            raise ValueError(
                f"{what}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                + where
            )


def as_list(what: str, prompts: Any) -> list[Any]:
    """One prompt or a list of them, as a list."""
    if is_single_prompt(prompts):
        return [prompts]
    if isinstance(prompts, Iterable) and not isinstance(prompts, bytes):
        return list(prompts)
    raise ValueError(
        f"{what}: prompts must be a prompt or a list of prompts, got {type(prompts).__name__}"
    )


def pack_prompts(prompts: list[list[int]], max_tokens: int, max_seqs: int) -> Iterator[list[int]]:
    """Indices of consecutive prompts whose tokens fit `max_tokens` (at most `max_seqs` of
    them); a prompt longer than `max_tokens` goes alone."""
    chunk: list[int] = []
    used = 0
    for i, ids in enumerate(prompts):
        if chunk and (used + len(ids) > max_tokens or len(chunk) == max_seqs):
            yield chunk
            chunk, used = [], 0
        chunk.append(i)
        used += len(ids)
    if chunk:
        yield chunk


def is_single_prompt(prompts: Any) -> bool:
    return isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, Sequence)
        and bool(prompts)
        and isinstance(prompts[0], int)
        and not isinstance(prompts[0], bool)
    )


class RequestIds:
    """Automatic request ids `req-N`: a counter that skips every N a caller chose as `req-N`
    itself, so an automatic id never equals an id a caller chose, now or earlier."""

    _AUTO = re.compile(r"req-(\d+)")

    def __init__(self) -> None:
        self._next = 0
        self._taken: set[int] = set()  # N of caller ids `req-N` the counter must skip

    def new(self) -> str:
        while self._next in self._taken:
            self._taken.discard(self._next)
            self._next += 1
        self._next += 1
        return f"req-{self._next - 1}"

    def reserve(self, request_id: str) -> None:
        """Note a caller's id (the counter skips it if it is an automatic-looking one ahead)."""
        match = self._AUTO.fullmatch(request_id)
        if match and int(match.group(1)) >= self._next:
            self._taken.add(int(match.group(1)))


def encode_packed(
    runner: Any, read: Sequence[Any], max_tokens: int, max_prompts: int
) -> list[EncodeOutput]:
    """Encoder-only models: each read prompt's last hidden states, in input order, from forwards
    of at most `max_tokens` tokens and `max_prompts` prompts (`pack_prompts`; `runner` is the
    engine's `ModelRunner`)."""
    outputs: list[EncodeOutput] = []
    for chunk in pack_prompts([r.token_ids for r in read], max_tokens, max_prompts):
        hidden = runner.encode([read[i].token_ids for i in chunk])
        for i, states in zip(chunk, hidden, strict=True):
            outputs.append(EncodeOutput(read[i].token_ids, states.cpu(), read[i].text))
    return outputs
