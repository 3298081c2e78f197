"""`LLM`: vLLM's offline entry point over `LLMEngine` (docs/vllm-api.md).

```
from unified_attn import LLM, SamplingParams

llm = LLM("tiny-llama")
outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, top_p=0.95))
print(outputs[0].outputs[0].text)
```
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from unified_attn.engine.llm_engine import LLMEngine
from unified_attn.engine.outputs import EncodeOutput, RequestOutput, StreamDelta
from unified_attn.engine.prompts import PromptType
from unified_attn.sampling_params import SamplingParams


@contextmanager
def progress_bar(what: str) -> Iterator[Callable[[int, int], None]]:
    """A transient progress bar on stderr; yields its `(done, total)` update."""
    columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update


def check_conversation(index: int, conversation: Any) -> None:
    """A conversation is a non-empty list of `{"role": str, "content": str}` messages."""
    ok = isinstance(conversation, list) and conversation and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
        for m in conversation
    )
    if not ok:
        raise ValueError(
            f"LLM.chat: conversation {index} must be a non-empty list of messages "
            f'{{"role": ..., "content": ...}}, got {conversation!r:.80}'
        )


class LLM:
    """A model behind vLLM's `LLM` interface: `LLM(model, **engine_kwargs)`, then
    `generate(prompts, sampling_params)` for finished outputs or `stream(...)` for per-step
    deltas; encoder-only models (BERT) answer `encode(prompts)` with hidden states, and
    encoder-decoder models (BART) take `{"encoder_prompt_token_ids": ..., "prompt_token_ids":
    ...}` prompts (a plain prompt is the encoder's input).

    `model` is a preset name or a Hugging Face checkpoint directory; `engine_kwargs` are
    `EngineConfig`'s (`device`, `dtype`, `max_model_len`, `gpu_memory_utilization`, `seed`,
    ...). The engine is `llm.llm_engine`, as in vLLM: requests added there with `add_request`
    run alongside `generate` and `stream`.
    """

    def __init__(self, model: str = "tiny-llama", **engine_kwargs: Any) -> None:
        self.llm_engine = LLMEngine(model, **engine_kwargs)

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (`encode(text)`, `decode(ids)`), or None if it has none."""
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run prompts to completion; one `RequestOutput` per prompt, in input order.

        A prompt is text, a list of token ids, or a dict `{"prompt": text}` or
        `{"prompt_token_ids": ids}`; `prompts` is one prompt or a list of them.
        `sampling_params` is one `SamplingParams` for all prompts or one per prompt (None:
        `SamplingParams()`, greedy, 16 tokens). `use_tqdm=True` draws a progress bar of
        finished prompts on stderr while it runs (rich's; gone when done).
        """
        if not isinstance(use_tqdm, bool):
            raise ValueError(f"LLM.generate: use_tqdm must be True or False, got {use_tqdm!r}")
        if not use_tqdm:
            return self.llm_engine.generate(prompts, sampling_params)
        with progress_bar("generating") as advance:
            return self.llm_engine.generate(prompts, sampling_params, on_progress=advance)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """vLLM's `chat`: one conversation (a list of `{"role": ..., "content": ...}`) or a
        list of them, each rendered with the checkpoint tokenizer's chat template (or
        `chat_template`), then generated; one `RequestOutput` per conversation."""
        tokenizer = self.llm_engine.tokenizer
        render = getattr(tokenizer, "chat_token_ids", None)
        if render is None:
            raise ValueError(
                f"LLM.chat: model {self.llm_engine.config.model!r} has no tokenizer with a chat "
                "template (the presets' byte tokenizer has none); use generate(prompts), or a "
                "checkpoint whose tokenizer_config.json has a chat_template"
            )
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        for i, conversation in enumerate(conversations):
            check_conversation(i, conversation)
        prompts = [
            render(conversation, chat_template, add_generation_prompt)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamDelta]:
        """`generate`, but yielding a `StreamDelta` per completion for every step that adds to it
        (see `LLMEngine.stream`)."""
        return self.llm_engine.stream(prompts, sampling_params)

    def encode(self, prompts: PromptType | Sequence[PromptType]) -> list[EncodeOutput]:
        """Encoder-only models: one `EncodeOutput` per prompt with `.hidden_states`, the last
        layer's `[num_tokens, hidden_size]` (see `LLMEngine.encode`)."""
        return self.llm_engine.encode(prompts)
