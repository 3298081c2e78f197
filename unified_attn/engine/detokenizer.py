"""Incremental detokenization of one completion, with its stop strings (vLLM's offsets)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unified_attn.sampling_params import SamplingParams


class IncrementalText:
    """Incremental detokenization of one completion, with its stop strings.

    vLLM's prefix and read offsets: a token's text is added once the tokens read so far decode
    to whole characters (no trailing U+FFFD), decoding only a window that starts one read
    earlier, so tokenizers that glue tokens together see them in context. The final call adds
    whatever is left. A fast (Rust) tokenizer's `decode_stream` does the same a token at a time,
    about ten times faster (as vLLM's `FastIncrementalDetokenizer`); it is used unless special
    tokens are kept without spaces between them (`spaces_between_special_tokens=False`, which
    only the window decode honours), and a stream that fails hands over to the windows. Stop
    strings are looked for in the new text (and the `len(stop) - 1` characters before it) once
    the output has more than `min_tokens` tokens; a hit cuts the text before it (after it, with
    `include_stop_str_in_output`) and freezes it.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stop = params.stop
        self.min_tokens = params.min_tokens
        self.options = {
            "skip_special_tokens": params.skip_special_tokens,
            "spaces_between_special_tokens": params.spaces_between_special_tokens,
        }
        # keep a stop string (and a stop token's text) at the end of the text
        self.include_stop = params.include_stop_str_in_output
        # characters a stream holds back: they could still be the start of a stop string
        longest = max((len(s) for s in self.stop), default=1)
        self.holdback = 0 if self.include_stop else longest - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters already streamed
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_string: str | None = None
        self.stream: Callable[[int], str | None] | None = None
        self.fed = 0  # tokens given to the stream
        make_stream = getattr(tokenizer, "decode_stream", None)
        if make_stream is not None and (
            params.skip_special_tokens or params.spaces_between_special_tokens
        ):
            self.stream = make_stream(params.skip_special_tokens)

    def add(self, token_ids: list[int], num_output_tokens: int, *, final: bool) -> None:
        if self.stop_string is not None:
            return
        self.token_ids.extend(token_ids)
        before = len(self.text)
        self._decode(final)
        if self.stop and num_output_tokens > self.min_tokens:
            self._find_stop(before)

    def _decode(self, final: bool) -> None:
        if self.stream is not None:
            try:
                self._decode_stream()
            except Exception:  # e.g. tokenizers' "Invalid prefix": decode windows from here on
                self.stream = None
            else:
                if not final or self.read_offset == len(self.token_ids):
                    return
        self._decode_window(final)

    def _decode_stream(self) -> None:
        """Feed the stream the new tokens; each whole piece of text moves the offsets as the
        window decode would, so a final call or a failure continues from the same place."""
        assert self.stream is not None
        for token_id in self.token_ids[self.fed :]:
            piece = self.stream(token_id)
            self.fed += 1
            if piece:
                self.text += piece
                self.prefix_offset, self.read_offset = self.read_offset, self.fed

    def _decode_window(self, final: bool) -> None:
        ids = self.token_ids
        decode = self.tokenizer.decode
        prefix_text = decode(ids[self.prefix_offset : self.read_offset], **self.options)
        new_text = decode(ids[self.prefix_offset :], **self.options)
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)

    def _find_stop(self, before: int) -> None:
        """vLLM 0.33's rule: of the stop strings in the new text, the one that ends first wins
        (ties: the first listed), as if the tokens had come one at a time."""
        found = []
        for order, stop in enumerate(self.stop):
            index = self.text.find(stop, max(0, before - len(stop) + 1))
            if index != -1:
                found.append((index + len(stop), order, index, stop))
        if found:
            end, _, index, stop = min(found)
            self.stop_string = stop
            self.text = self.text[: end if self.include_stop else index]

    def visible(self, finished: bool) -> str:
        """The text so far, less what could still become a stop string."""
        if finished or self.stop_string is not None:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]

    def delta(self, finished: bool) -> str:
        """Text not streamed yet, less what could still become a stop string."""
        end = max(self.sent, len(self.visible(finished)))
        out, self.sent = self.text[self.sent : end], end
        return out
