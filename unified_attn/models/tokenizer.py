"""Tokenizers with one small API: `encode(text) -> ids`, `decode(ids) -> text`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from unified_attn.models.presets import BYTE_BOS_ID, BYTE_EOS_ID


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

    def decode(
        self,
        ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str: ...


class ByteTokenizer:
    """ids 0..255 are UTF-8 bytes; ids from 256 on are specials (bos, eos) and have no text:
    they decode to '' whether special tokens are skipped or not."""

    def __init__(
        self, bos_token_id: int | None = BYTE_BOS_ID, eos_token_id: int = BYTE_EOS_ID
    ) -> None:
        if any(t is not None and t < 256 for t in (bos_token_id, eos_token_id)):
            raise ValueError(
                f"ByteTokenizer: special ids must be >= 256 (0..255 are bytes), got "
                f"bos={bos_token_id}, eos={eos_token_id}"
            )
        self.bos_token_id = bos_token_id
        self.eos_token_ids = (eos_token_id,)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int], **_options: bool) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """`transformers.AutoTokenizer` behind the same API. Decoding skips special tokens unless
    told not to (vLLM's default); `spaces_between_special_tokens` goes to the tokenizer, which
    honours it when it is a slow (Python) one: transformers' fast tokenizers ignore it."""

    def __init__(self, path: str | Path) -> None:
        try:
            from transformers import AutoTokenizer  # optional dependency: the `hf` extra
        except ImportError as error:
            raise ValueError(
                f"checkpoint {path} ships a tokenizer, and loading it needs the transformers "
                f"package, which is not installed ({error}); install the hf extra: "
                "pip install 'unified_attn[hf]'"
            ) from None
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(path))
        self.bos_token_id = self.tokenizer.bos_token_id
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = () if eos is None else (eos,)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(
        self,
        ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        return str(
            self.tokenizer.decode(
                ids,
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens,
            )
        )

    def decode_stream(self, skip_special_tokens: bool) -> Callable[[int], str | None] | None:
        """A decoder of one completion fed one token at a time: each call returns the text the
        token completes (None while its bytes are not whole characters yet), from the `tokenizers`
        library's `DecodeStream` (vLLM 0.33's fast incremental detokenizer uses it too); None
        for a tokenizer that is not a fast (Rust) one."""
        raw = getattr(self.tokenizer, "_tokenizer", None)
        try:
            import tokenizers
            from tokenizers.decoders import DecodeStream
        except ImportError:  # an older tokenizers: the caller decodes windows instead
            return None
        if not isinstance(raw, tokenizers.Tokenizer):
            return None
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda token_id: stream.step(raw, token_id)

    def chat_token_ids(
        self,
        messages: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """A conversation rendered with the tokenizer's chat template (or `chat_template`) and
        tokenized as the template writes it (its special tokens included, none added)."""
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "this checkpoint's tokenizer has no chat template; pass chat_template=..., or "
                "use generate(prompts)"
            )
        text = self.tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(path: str | Path) -> HFTokenizer | None:
    """The checkpoint's own tokenizer, or None if it ships no tokenizer files."""
    if not any((Path(path) / name).exists() for name in TOKENIZER_FILES):
        return None
    return HFTokenizer(path)
