"""`LLM`: vLLM's offline entry point over `LLMEngine` (docs/vllm-api.md).

```
from unified_attn import LLM, SamplingParams

llm = LLM("tiny-llama")
outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, top_p=0.95))
print(outputs[0].outputs[0].text)
```
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from unified_attn.engine.llm_engine import LLMEngine
from unified_attn.engine.outputs import EncodeOutput, RequestOutput, StreamDelta
from unified_attn.engine.prompts import PromptType
from unified_attn.sampling_params import SamplingParams


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
        `SamplingParams()`, greedy, 16 tokens). `use_tqdm` is accepted for vLLM's signature and
        shows nothing: no progress bar is drawn (stream the deltas to show progress).
        """
        if not isinstance(use_tqdm, bool):
            raise ValueError(
                f"LLM.generate: use_tqdm must be True or False, got {use_tqdm!r}; no progress "
                "bar is drawn either way (iterate LLM.stream to follow progress)"
            )
        return self.llm_engine.generate(prompts, sampling_params)

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
