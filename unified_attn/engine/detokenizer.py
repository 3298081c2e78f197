"""Incremental detokenization of one completion, with its stop strings (vLLM's offsets)."""

from __future__ import annotations

from typing import Any


class IncrementalText:
    """Incremental detokenization of one completion, with its stop strings.

    vLLM's prefix and read offsets: a token's text is added once the tokens read so far decode
    to whole characters (no trailing U+FFFD), decoding only a window that starts one read
    earlier, so tokenizers that glue tokens together see them in context. The final call adds
    whatever is left. Stop strings are looked for in the new text (and the `len(stop) - 1`
    characters before it) once the output has more than `min_tokens` tokens; a hit cuts the
    text before it and freezes it.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], min_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens
        # characters a stream holds back: they could still be the start of a stop string
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters already streamed
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_string: str | None = None

    def add(self, token_ids: list[int], num_output_tokens: int, *, final: bool) -> None:
        if self.stop_string is not None:
            return
        self.token_ids.extend(token_ids)
        before = len(self.text)
        self._decode(final)
        if self.stop and num_output_tokens > self.min_tokens:
            self._find_stop(before)

    def _decode(self, final: bool) -> None:
        ids = self.token_ids
        prefix_text = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)

    def _find_stop(self, before: int) -> None:
        """vLLM's rule: the first stop string of the list found in the new text wins."""
        for stop in self.stop:
            index = self.text.find(stop, max(0, before - len(stop) + 1))
            if index != -1:
                self.stop_string = stop
                self.text = self.text[:index]
                return

    def delta(self, finished: bool) -> str:
        """Text not streamed yet, less what could still become a stop string."""
        end = len(self.text)
        if not finished and self.stop_string is None:
            end = max(self.sent, end - self.holdback)
        out, self.sent = self.text[self.sent : end], end
        return out
