"""The request front end and the step loop.

- `llm_engine`: `LLMEngine` (add, step, abort, generate, stream) over a scheduler, a worker
  and a model runner; `engine_config`: `EngineConfig`, every engine option checked once.
- Requests: `prompts` (prompt forms and validation), `request_intake` (a prompt and its
  sampling parameters to requests), `sequences` (a request's completions), `request_tracker`
  (progress, text and stop strings, stream deltas), `detokenizer`, `outputs` (`RequestOutput`,
  `CompletionOutput`, `StreamDelta`).
"""
