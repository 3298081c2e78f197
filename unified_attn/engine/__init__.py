"""The request front end and the step loop.

- `llm_engine`: `LLMEngine` (add, step, abort, generate, stream) over a scheduler, a worker
  and a model runner; `engine_config`: `EngineConfig`, every engine option checked once (and
  the environment read once, `with_environment`).
- Requests: `prompts` (prompt forms and validation), `request_intake` (a prompt and its
  sampling parameters to requests), `sequences` (a request's completions), `request_tracker`
  (progress, text and stop strings, stream deltas), `detokenizer`, `outputs` (`RequestOutput`,
  `CompletionOutput`, `StreamDelta`, `Logprob`, `EncodeOutput`).

Offered here: `EngineConfig` and the output types (the engine itself is `unified_attn.LLMEngine`).
"""

from unified_attn.engine.engine_config import EngineConfig
from unified_attn.engine.outputs import (
    CompletionOutput,
    EncodeOutput,
    Logprob,
    RequestOutput,
    StreamDelta,
)

__all__ = [
    "CompletionOutput",
    "EncodeOutput",
    "EngineConfig",
    "Logprob",
    "RequestOutput",
    "StreamDelta",
]
