"""`LLMEngine`: model + worker + KV-cache manager + scheduler + runner behind `generate`."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from unified_attn.managers import KVCacheManager
from unified_attn.request import Request, RequestStatus
from unified_attn.runner.device import resolve_device
from unified_attn.runner.memory import parse_memory
from unified_attn.runner.model_runner import ModelRunner
from unified_attn.runner.model_source import load_model
from unified_attn.runner.scheduler import Scheduler
from unified_attn.runner.worker import KVCacheReport, Worker, agree_on_num_blocks
from unified_attn.sampling_params import SamplingParams


@attrs.frozen
class EngineConfig:
    """Everything `LLMEngine(model, **kwargs)` accepts (see docs/architecture.md)."""

    model: str = "tiny-llama"
    device: str = "cpu"
    backend: str | None = None
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    block_size: int | None = None
    kv_cache_memory: int | str | None = "64MiB"  # None on CUDA: a fraction of free memory
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    batch_invariant: bool = False
    seed: int = 0
    cuda_graphs: bool = True  # decode steps on CUDA, when every backend supports them


@attrs.define
class RequestOutput:
    """A finished request: its tokens, why it stopped, and the logits it asked for."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    num_preemptions: int = 0
    prompt_logits: torch.Tensor | None = None  # [prompt_len, vocab] float32, if asked for
    logits: torch.Tensor | None = None  # [num_generated, vocab] float32, if asked for


@attrs.define
class EngineStats:
    """Counters over the engine's life: steps, tokens, time in `step`."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    step_time_s: float = 0.0

    @property
    def mean_step_ms(self) -> float:
        return 1e3 * self.step_time_s / self.steps if self.steps else 0.0


_AUTO_ID = re.compile(r"req-(\d+)")

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class LLMEngine:
    """A model on one device behind `generate`, or driven step by step.

    Construction loads the model (a preset or a Hugging Face checkpoint directory) with the
    selected backends, lets the worker plan, size and allocate the KV cache, and builds the
    `KVCacheManager`, the `Scheduler` and the `ModelRunner`. Then either `generate(prompts,
    params)` runs prompts to completion, or a serving loop calls `add_request`,
    `abort_request` and `step()`. Bad input raises `ValueError` before any state changes.
    """

    def __init__(self, model: str = "tiny-llama", **kwargs: Any) -> None:
        self.config = config = EngineConfig(model=model, **kwargs)
        self.device = resolve_device(config.device)
        source = load_model(config)
        self.model, self.tokenizer, self.backend_cls = (
            source.model,
            source.tokenizer,
            source.backend_cls,
        )
        self.vocab_size = source.vocab_size
        self.max_model_len = source.max_model_len
        memory = None if config.kv_cache_memory is None else parse_memory(config.kv_cache_memory)
        max_in_flight = min(config.max_num_batched_tokens, self.max_model_len)
        self.worker = Worker(
            self.model,
            device=self.device,
            max_model_len=self.max_model_len,
            max_in_flight_tokens=max_in_flight,
            block_size=config.block_size,
            kv_cache_memory=memory,
            gpu_memory_utilization=config.gpu_memory_utilization,
        )
        num_blocks = agree_on_num_blocks([self.worker])
        self.worker.allocate(num_blocks)
        self.kv_cache_manager = KVCacheManager(
            self.worker.plan.scheduler_config(num_blocks),
            self.max_model_len,
            max_in_flight_tokens=max_in_flight,
            enable_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=source.eos_token_ids,
        )
        self.runner = ModelRunner(
            self.model,
            self.worker.plan,
            device=self.device,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            seed=config.seed,
            cuda_graphs=config.cuda_graphs,
        )
        self.stats = EngineStats()
        self._next_id = 0
        self._caller_numbers: set[int] = set()  # N of caller ids `req-N` the counter must skip
        # Outputs of requests that `generate` saw finish but did not add: `step` returns them.
        self._pending_outputs: list[RequestOutput] = []
        # request id -> (prompt logits parts, generated-token logits)
        self._logits: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    # ---- requests ------------------------------------------------------------------------------

    @property
    def kv_cache_report(self) -> KVCacheReport:
        return self.worker.report()

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids instead of text")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Bad input raises before any state
        changes, so the engine stays usable."""
        token_ids = self.encode(prompt)
        if request_id is None:
            request_id = self._new_request_id()
        self._check_prompt(f"request {request_id}", token_ids)
        self._reserve_caller_id(request_id)
        params = params or SamplingParams()
        request = Request(
            request_id,
            token_ids,
            block_hasher=self.kv_cache_manager.make_block_hasher(),
            cache_salt=cache_salt,
            sampling_params=params,
        )
        request.skip_reading_prefix_cache = params.prompt_logits
        self.scheduler.add_request(request)
        self._logits[request_id] = ([], [])
        return request_id

    def _new_request_id(self) -> str:
        """`req-N` with a counter that skips every N a caller chose as `req-N` itself, so an
        automatic id never equals an id a caller chose, now or earlier."""
        while self._next_id in self._caller_numbers:
            self._caller_numbers.discard(self._next_id)
            self._next_id += 1
        self._next_id += 1
        return f"req-{self._next_id - 1}"

    def _reserve_caller_id(self, request_id: str) -> None:
        match = _AUTO_ID.fullmatch(request_id)
        if match and int(match.group(1)) >= self._next_id:
            self._caller_numbers.add(int(match.group(1)))

    def _check_prompt(self, what: str, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError(f"{what}: the prompt is empty; give at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"{what}: the prompt has {len(token_ids)} tokens but "
                f"max_model_len={self.max_model_len} leaves no room to generate; shorten the "
                "prompt or raise max_model_len"
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"{what}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)
        self._logits.pop(request_id, None)

    # ---- running -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the outputs of requests that finished in it, and of
        requests that finished while `generate` was driving the engine for other prompts."""
        pending, self._pending_outputs = self._pending_outputs, []
        return pending + self._step()

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        output = self.scheduler.schedule()
        result = self.runner.execute(output)
        self._keep_logits(output, result)
        sampled = result.sampled
        finished = self.scheduler.update_from_output(output, sampled)
        stats = self.stats
        stats.steps += 1
        stats.step_time_s += time.perf_counter() - start
        for entry in output.scheduled:
            if entry.num_computed_before + entry.num_new_tokens > entry.request.num_prompt_tokens:
                stats.decode_tokens += entry.num_new_tokens
            else:
                stats.prefill_tokens += entry.num_new_tokens
        stats.generated_tokens += len(sampled)
        return [self._output(r) for r in finished]

    def _keep_logits(self, output, result) -> None:
        for request in output.preempted:
            self._logits[request.request_id][0].clear()  # the prompt is recomputed
        for rid, rows in result.prompt_logits.items():
            self._logits[rid][0].append(rows)
        for rid, row in result.sample_logits.items():
            self._logits[rid][1].append(row)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (text or token ids) to completion; outputs in input order.

        Returns exactly these prompts' outputs. Requests added earlier with `add_request` keep
        running alongside; their outputs, if they finish meanwhile, come from the next `step()`.
        Every prompt is validated before any is queued; if stepping raises (or is interrupted),
        these prompts' requests are aborted and the others are left as they were.
        """
        batch: list[Any] = [prompts] if _is_single_prompt(prompts) else list(prompts)
        all_params = params if isinstance(params, Sequence) else [params] * len(batch)
        if len(all_params) != len(batch):
            raise ValueError(
                f"generate: got {len(all_params)} SamplingParams for {len(batch)} prompts; "
                "pass one SamplingParams, or one per prompt"
            )
        token_lists = [self.encode(prompt) for prompt in batch]
        for i, token_ids in enumerate(token_lists):  # nothing is queued unless all are valid
            self._check_prompt(f"generate: prompt {i}", token_ids)
        ids = [self.add_request(t, sp) for t, sp in zip(token_lists, all_params, strict=True)]
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(ids):
                if not self.has_unfinished_requests():
                    missing = sorted(wanted - done.keys())
                    raise RuntimeError(f"generate: requests {missing} ended without an output")
                for out in self._step():
                    if out.request_id in wanted:
                        done[out.request_id] = out
                    else:
                        self._pending_outputs.append(out)
        except BaseException:
            for request_id in wanted - done.keys():
                self.abort_request(request_id)
            raise
        return [done[i] for i in ids]

    def _output(self, request: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids)
        prompt_parts, sample_rows = self._logits.pop(request.request_id, ([], []))
        return RequestOutput(
            request.request_id,
            request.prompt_token_ids,
            request.output_token_ids,
            _FINISH_REASONS.get(request.status),
            text,
            request.num_preemptions,
            torch.cat(prompt_parts) if prompt_parts else None,
            torch.stack(sample_rows) if sample_rows else None,
        )


def _is_single_prompt(prompts: Any) -> bool:
    return isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and bool(prompts) and isinstance(prompts[0], int)
    )
