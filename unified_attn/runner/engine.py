"""`LLMEngine`: model + worker + KV-cache manager + scheduler + runner behind `generate`, `stream`
and a step-by-step serving loop, with vLLM-shaped outputs (`RequestOutput`, `CompletionOutput`,
`Logprob`) and stream deltas (`StreamDelta`)."""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from unified_attn.managers import KVCacheManager
from unified_attn.managers.events import KVCacheEvent
from unified_attn.managers.eviction import check_eviction
from unified_attn.models.invariant import require_batch_invariant
from unified_attn.request import Request, RequestStatus
from unified_attn.runner.config import EngineConfig, EngineStats, check_engine_options
from unified_attn.runner.detokenizer import IncrementalText
from unified_attn.runner.device import resolve_device
from unified_attn.runner.kv_access import KVCacheAccess
from unified_attn.runner.model_runner import StepResult
from unified_attn.runner.model_source import load_model
from unified_attn.runner.outputs import (
    EncodeOutput,
    RequestOutput,
    SampleLogprobs,
    StreamDelta,
)
from unified_attn.runner.prompts import (
    PromptReader,
    ReadPrompt,
    RequestIds,
    as_list,
    pack_prompts,
)
from unified_attn.runner.scheduler import Scheduler, SchedulerOutput
from unified_attn.runner.sequences import (
    FINISH_REASONS,
    ParentRequest,
    SequenceState,
    gather_logprobs,
    request_output,
)
from unified_attn.runner.speculative import build_drafter, propose_drafts
from unified_attn.runner.tensor_parallel import (
    TensorParallelGroup,
    agree_on_blocks,
    make_rank_runner,
    make_worker,
    rank_model,
    serve_launched_rank,
)
from unified_attn.runner.worker import KVCacheReport, agree_on_num_blocks
from unified_attn.sampling_params import SamplingParams
from unified_attn.selector import batch_invariant_from_env


def check_batch_invariant_options(config: EngineConfig) -> None:
    """Refuse the engine options batch-invariant mode cannot honour, before anything starts."""
    if config.tensor_parallel_size > 1:
        raise ValueError(
            f"batch-invariant mode cannot run with tensor_parallel_size="
            f"{config.tensor_parallel_size}: row-parallel layers sum the ranks' partial results "
            "with an all-reduce whose algorithm (and so its order of additions) NCCL picks by "
            "message size, i.e. by the batch; use tensor_parallel_size=1 or turn the mode off"
        )


# ---- the engine's per-request state ------------------------------------------------------------


@attrs.frozen
class _Prompt:
    """A validated prompt: its token ids (and the encoder's), its text if given as text, and
    its parameters."""

    read: ReadPrompt
    params: SamplingParams


PromptType = str | Sequence[int] | Mapping[str, Any]


class LLMEngine(KVCacheAccess):
    """A model on one device behind `generate` and `stream`, or driven step by step.

    Construction loads the model (a preset or a Hugging Face checkpoint directory) with the
    selected backends, lets the worker plan, size and allocate the KV cache, and builds the
    `KVCacheManager`, the `Scheduler` and the `ModelRunner`. Then either `generate(prompts,
    params)` runs prompts to completion, `stream(prompts, params)` yields what every step adds,
    or a serving loop calls `add_request`, `abort_request` and `step()`. A prompt is text, token
    ids, or a dict `{"prompt": text}` / `{"prompt_token_ids": ids}`. A request with
    `SamplingParams.n > 1` runs as `n` scheduler requests (`<id>#0`, `<id>#1`, ...) sharing the
    prompt's prefix cache, gathered into one `RequestOutput`. Bad input raises `ValueError`
    before any state changes.
    """

    def __init__(self, model: str = "tiny-llama", **kwargs: Any) -> None:
        check_engine_options(kwargs)
        self.config = config = EngineConfig(model=model, **kwargs)
        self.batch_invariant = config.batch_invariant or batch_invariant_from_env()
        if self.batch_invariant:
            check_batch_invariant_options(config)
        self.device = resolve_device(config.device)
        # tensor parallelism: under torchrun, ranks 1..N-1 serve rank 0 here and never return;
        # else rank 0 spawns them now and they build their shards alongside
        serve_launched_rank(config)
        self._tp = TensorParallelGroup(config) if config.tensor_parallel_size > 1 else None
        try:
            self._build(config)
        except BaseException as error:
            if self._tp is not None:
                self._tp.fail(error)
            raise
        if self._tp is not None:
            weakref.finalize(self, self._tp.shutdown)

    def _build(self, config: EngineConfig) -> None:
        n = config.tensor_parallel_size
        source = rank_model(config, 0, n) if n > 1 else load_model(config)
        if self.batch_invariant:  # what the mode cannot vouch for is refused, never run
            require_batch_invariant(source.model)
        self.model, self.tokenizer, self.backend_cls = (
            source.model,
            source.tokenizer,
            source.backend_cls,
        )
        self.vocab_size = source.vocab_size
        self.max_model_len = source.max_model_len
        self.kind = source.kind
        self._source = source
        max_in_flight = min(config.max_num_batched_tokens, self.max_model_len)
        self.worker = make_worker(config, source, 0)
        # a draft model takes its share of the KV budget before the target sizes its cache
        self.drafter = build_drafter(config, source, self.worker, self.device)
        if self._tp is not None:  # every rank sizes its own cache; all use the minimum
            num_blocks, self.rank_num_blocks = agree_on_blocks(self.worker, self._tp.control)
        else:
            num_blocks = agree_on_num_blocks([self.worker])
            self.rank_num_blocks = [num_blocks]
        self.worker.allocate(num_blocks)
        self.kv_cache_manager = KVCacheManager(
            self.worker.plan.scheduler_config(num_blocks),
            self.max_model_len,
            max_in_flight_tokens=max_in_flight,
            enable_caching=config.enable_prefix_caching,
            eviction=check_eviction(config.kv_cache_eviction),
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=source.eos_token_ids,
        )
        k = 0 if self.drafter is None else self.drafter.num_speculative_tokens
        # decode steps verifying k drafts per request replay graphs too
        self.runner = make_rank_runner(config, source, self.worker, (1, 1 + k) if k else (1,))
        self.stats = EngineStats()
        self._ids = RequestIds()
        self._parents: dict[str, ParentRequest] = {}  # unfinished requests, by the id callers know
        self._sequences: dict[str, SequenceState] = {}  # their scheduler requests, by request id
        # Finished requests' outputs not handed out yet: `step` returns them, `generate` takes
        # its own.
        self._outputs: list[RequestOutput] = []
        # Streamed requests: request id -> the queue of its stream (one queue per `stream`).
        self._stream_queues: dict[str, deque[StreamDelta]] = {}
        # `subscribe_kv_events` callbacks, called after every step with its events
        self._kv_event_callbacks: list[Callable[[list[KVCacheEvent]], object]] = []

    # ---- requests ------------------------------------------------------------------------------

    @property
    def kv_cache_report(self) -> KVCacheReport:
        return self.worker.report()

    @property
    def prompts(self) -> PromptReader:
        """Reads and checks prompts for this model (with the engine's current tokenizer)."""
        source = self._source
        return PromptReader(
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            source.kind,
            source.decoder_start_token_id,
            source.max_encoder_len,
        )

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Text through the tokenizer, or token ids as a list of ints."""
        return self.prompts.tokenize(prompt)

    def encode(self, prompts: PromptType | Sequence[PromptType]) -> list[EncodeOutput]:
        """Encoder-only models: each prompt's last hidden states `[num_tokens, hidden_size]`,
        in input order. Prompts are packed into forwards of at most `max_num_batched_tokens`
        tokens and `max_num_seqs` prompts (a longer prompt runs alone: bidirectional attention
        cannot be chunked). Every prompt is checked before any runs."""
        if self.kind != "encoder_only":
            raise ValueError(
                f"encode: {self.config.model!r} is a {self.kind.replace('_', '-')} model; encode() "
                "serves encoder-only models (BERT), use generate() for this one"
            )
        batch = as_list("encode", prompts)
        read = [
            self.prompts.read(f"encode: prompt {i}", p, generating=False)
            for i, p in enumerate(batch)
        ]
        outputs: list[EncodeOutput] = []
        for chunk in pack_prompts([r.token_ids for r in read], self.config.max_num_batched_tokens,
                           self.config.max_num_seqs):  # fmt: skip
            hidden = self.runner.encode([read[i].token_ids for i in chunk])
            for i, states in zip(chunk, hidden, strict=True):
                outputs.append(EncodeOutput(read[i].token_ids, states.cpu(), read[i].text))
        return outputs

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id (the one `step()`'s output, `abort_request`
        and `unfinished_request_ids()` use). Bad input raises before any state changes, so the
        engine stays usable."""
        if request_id is not None and not (isinstance(request_id, str) and request_id):
            raise ValueError(
                f"add_request: request_id must be a non-empty str or None (the engine picks "
                f"one), got {request_id!r}"
            )
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"add_request: cache_salt must be a str or None, got {cache_salt!r}")
        what = "add_request" if request_id is None else f"request {request_id}"
        prepared = self._prepare(what, prompt, params)
        return self._add(prepared, request_id, cache_salt, None)

    def abort_request(self, request_id: str) -> None:
        """Stop an unfinished request (all its completions) and free its blocks. Its output,
        with the tokens generated so far and `finish_reason="abort"`, comes from the next
        `step()` (or, if `generate` or `stream` runs it, from there). An id that is not an
        unfinished request of this engine raises `ValueError`."""
        parent = self._parents.get(request_id)
        if parent is None:
            raise ValueError(
                f"abort_request: no unfinished request has id {request_id!r} (it finished, was "
                "aborted or was never added); pass an id from unfinished_request_ids()"
            )
        for seq in parent.sequences:
            if seq.finish_reason is None:
                self.scheduler.abort_request(seq.request.request_id)
                seq.finish_reason = "abort"
                if seq.incremental:
                    self._read_text(seq, [], finished_now=True)
                self._stream(seq, [], [] if seq.logprobs is not None else None)
        self._finish(parent)

    def unfinished_request_ids(self) -> list[str]:
        """Ids of the requests still running or waiting, in the order they were added."""
        return list(self._parents)

    def has_unfinished_requests(self) -> bool:
        """Requests still to run, or finished ones whose output `step()` has not returned yet."""
        return self.scheduler.has_unfinished() or bool(self._outputs)

    def _prepare(self, what: str, prompt: Any, params: Any) -> _Prompt:
        if self.kind == "encoder_only":
            raise ValueError(
                f"{what}: {self.config.model!r} is an encoder-only model, it generates no "
                "tokens; use encode(prompts) for its hidden states"
            )
        params = SamplingParams() if params is None else params
        self._check_params(what, params)
        return _Prompt(self.prompts.read(what, prompt), params)

    def _check_params(self, what: str, params: Any) -> None:
        """What `SamplingParams` cannot check alone: it needs the model's tokenizer or vocab."""
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"{what}: expected SamplingParams, got {type(params).__name__}; build one with "
                "SamplingParams(max_tokens=..., ...)"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"{what}: SamplingParams.stop={list(params.stop)} needs a tokenizer to read the "
                "text and this model has none; use stop_token_ids, or a checkpoint that ships "
                "tokenizer files"
            )
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"{what}: SamplingParams.stop_token_ids holds {bad[0]}, outside the vocabulary "
                f"[0, {self.vocab_size}); drop it"
            )
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(
                f"{what}: SamplingParams.logprobs={params.logprobs} exceeds the vocabulary size "
                f"{self.vocab_size}; ask for at most {self.vocab_size}"
            )

    def _add(
        self,
        prompt: _Prompt,
        request_id: str | None,
        cache_salt: str | None,
        queue: deque[StreamDelta] | None,
    ) -> str:
        """Queue a validated prompt as `n` scheduler requests; `queue` streams it."""
        if request_id is None:
            request_id = self._ids.new()
        n = prompt.params.n
        child_ids = [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
        self._check_ids(request_id, child_ids)
        self._ids.reserve(request_id)
        read = prompt.read
        parent = ParentRequest(
            request_id, read.text, read.token_ids, read.encoder_text, read.encoder_token_ids
        )
        for index, child_id in enumerate(child_ids):
            params = _child_params(prompt.params, index)
            request = Request(
                child_id,
                read.token_ids,
                block_hasher=self.kv_cache_manager.make_block_hasher(),
                cache_salt=cache_salt,
                sampling_params=params,
                encoder_token_ids=read.encoder_token_ids,
            )
            request.skip_reading_prefix_cache = params.prompt_logits
            self.scheduler.add_request(request)
            seq = self._new_sequence(request_id, index, request, streamed=queue is not None)
            parent.sequences.append(seq)
            self._sequences[child_id] = seq
        self._parents[request_id] = parent
        if queue is not None:
            self._stream_queues[request_id] = queue
        return request_id

    def _check_ids(self, request_id: str, child_ids: list[str]) -> None:
        taken = [i for i in child_ids if i in self.scheduler.requests]
        if request_id in self._parents or taken:
            raise ValueError(
                f"request id {(taken or [request_id])[0]!r} is already in use; pick another id "
                "or let the engine choose one"
            )

    def _new_sequence(
        self, parent_id: str, index: int, request: Request, *, streamed: bool
    ) -> SequenceState:
        params: SamplingParams = request.sampling_params
        text = None
        if self.tokenizer is not None:
            text = IncrementalText(self.tokenizer, params.stop, params.min_tokens)
        wants_logprobs = params.logprobs is not None
        return SequenceState(
            parent_id,
            index,
            request,
            text,
            incremental=streamed or bool(params.stop),
            logprobs=[] if wants_logprobs else None,
            cumulative_logprob=0.0 if wants_logprobs else None,
        )

    # ---- running -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the outputs of requests that finished in it, of
        requests aborted since the last step, and of requests that finished while `generate`
        or `stream` was driving the engine for other prompts."""
        self._step()
        outputs, self._outputs = self._outputs, []
        return outputs

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order.

        Returns exactly these prompts' outputs. Requests added earlier with `add_request` keep
        running alongside; their outputs, if they finish meanwhile, come from the next `step()`.
        Every prompt is validated before any is queued; if stepping raises (or is interrupted),
        these prompts' requests are aborted and the others are left as they were.
        """
        batch = self._batch("generate", prompts, params)
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        try:
            for prompt in batch:
                ids.append(self._add(prompt, None, None, None))
            while True:
                self._take_outputs(set(ids), done)
                if len(done) == len(ids):
                    return [done[i] for i in ids]
                self._check_progress("generate", set(ids) - done.keys())
                self._step()
        except BaseException:
            self._drop(set(ids) - done.keys())
            raise

    def stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamDelta]:
        """Run prompts, yielding a `StreamDelta` per completion for every step that adds to it.

        Like vLLM's `AsyncLLM.generate` with delta outputs, but synchronous: iterating steps the
        engine, so requests added with `add_request` (and other streams) progress alongside.
        Prompts are validated now; they are queued when iteration starts. A completion's last
        delta has its `finish_reason` ("abort" if `abort_request` stopped it); the iterator
        ends when every completion of these prompts has finished. Closing it early (or an
        error while stepping) aborts its unfinished requests.
        """
        return self._run_stream(self._batch("stream", prompts, params))

    def _run_stream(self, batch: list[_Prompt]) -> Iterator[StreamDelta]:
        queue: deque[StreamDelta] = deque()
        ids: list[str] = []
        try:
            for prompt in batch:
                ids.append(self._add(prompt, None, None, queue))
            remaining = sum(prompt.params.n for prompt in batch)
            while remaining:
                if not queue:
                    self._check_progress("stream", set(ids) & self._parents.keys())
                    self._step()
                    continue
                delta = queue.popleft()
                remaining -= delta.finished
                yield delta
        finally:
            self._drop({i for i in ids if i in self._parents})
            for request_id in ids:
                self._stream_queues.pop(request_id, None)

    def _batch(self, what: str, prompts: Any, params: Any) -> list[_Prompt]:
        """Every prompt read and validated, with its parameters, before any is queued."""
        batch = as_list(what, prompts)
        if params is None or isinstance(params, SamplingParams):
            all_params = [params] * len(batch)
        elif isinstance(params, Sequence):
            all_params = list(params)
        else:
            raise ValueError(
                f"{what}: expected SamplingParams or a list of them, got {type(params).__name__}"
            )
        if len(all_params) != len(batch):
            raise ValueError(
                f"{what}: got {len(all_params)} SamplingParams for {len(batch)} prompts; "
                "pass one SamplingParams, or one per prompt"
            )
        return [
            self._prepare(f"{what}: prompt {i}", prompt, sp)
            for i, (prompt, sp) in enumerate(zip(batch, all_params, strict=True))
        ]

    def _check_progress(self, what: str, waiting_for: set[str]) -> None:
        if not self.scheduler.has_unfinished():
            raise RuntimeError(f"{what}: requests {sorted(waiting_for)} ended without an output")

    def _take_outputs(self, wanted: set[str], done: dict[str, RequestOutput]) -> None:
        keep = []
        for out in self._outputs:
            if out.request_id in wanted:
                done[out.request_id] = out
            else:
                keep.append(out)
        self._outputs = keep

    def _drop(self, request_ids: set[str]) -> None:
        """Abort requests whose caller is gone (an interrupted `generate`, a closed stream);
        their outputs go nowhere."""
        for request_id in request_ids:
            parent = self._parents.pop(request_id, None)
            for seq in parent.sequences if parent else ():
                self.scheduler.abort_request(seq.request.request_id)
                self._sequences.pop(seq.request.request_id, None)
        self._outputs = [o for o in self._outputs if o.request_id not in request_ids]

    # ---- one step ------------------------------------------------------------------------------

    def _step(self) -> None:
        if self._tp is not None and self._tp.closed:
            raise RuntimeError(
                "this tensor-parallel engine was shut down (or a rank failed); build a new one"
            )
        start = time.perf_counter()
        output = self.scheduler.schedule()
        result = self._execute(output)
        before = {e.request.request_id: e.request.num_output_tokens for e in output.scheduled}
        finished = self.scheduler.update_from_output(output, result.sampled)
        appended = {
            e.request.request_id: e.request.num_output_tokens - before[e.request.request_id]
            for e in output.scheduled
        }
        self._count(output, result, appended, start)
        self._keep_logits(output, result, appended)
        if self.drafter is not None:
            propose_drafts(self.drafter, output, self.max_model_len)
        finished_ids = {r.request_id for r in finished}
        touched: dict[str, ParentRequest] = {}
        for entry in output.scheduled:
            seq = self._sequences.get(entry.request.request_id)
            if seq is None:
                continue
            finished_now = seq.request.request_id in finished_ids
            if finished_now or seq.request.num_output_tokens > seq.num_seen:
                self._advance(seq, result, finished_now)
                touched[seq.parent_id] = self._parents[seq.parent_id]
        for parent in touched.values():
            if parent.done:
                self._finish(parent)
        self._publish_kv_events()

    def _execute(self, output: SchedulerOutput) -> StepResult:
        """Run the step on this process's runner; with tensor parallelism, on every rank."""
        tp = self._tp
        if tp is None:
            return self.runner.execute(output)
        try:
            tp.broadcast(output)
            return self.runner.execute(output)
        except Exception as error:
            tp.fail(error)
            raise

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and leave their process group (nothing to do
        on one device). The engine cannot step afterwards."""
        if self._tp is not None:
            self.runner.graphs = None  # graphs hold the group's captured collectives
            self._tp.shutdown()

    def _count(
        self, output: SchedulerOutput, result: StepResult, appended: dict[str, int], start: float
    ) -> None:
        stats = self.stats
        stats.steps += 1
        stats.step_time_s += time.perf_counter() - start
        for entry in output.scheduled:
            if entry.num_computed_before + entry.num_new_tokens > entry.request.num_prompt_tokens:
                stats.decode_tokens += entry.num_new_tokens
            else:
                stats.prefill_tokens += entry.num_new_tokens
        stats.generated_tokens += sum(appended.values())
        for rid, num_drafts in result.num_drafts.items():
            stats.spec_verifications += 1
            stats.spec_drafted += num_drafts
            stats.spec_accepted += len(result.sampled[rid]) - 1

    def _keep_logits(
        self, output: SchedulerOutput, result: StepResult, appended: dict[str, int]
    ) -> None:
        for request in output.preempted:
            seq = self._sequences.get(request.request_id)
            if seq is not None:
                seq.prompt_logits.clear()  # the prompt is recomputed
        for rid, rows in result.prompt_logits.items():
            self._sequences[rid].prompt_logits.append(rows)
        for rid, rows in result.sample_logits.items():  # the rows of the tokens kept
            self._sequences[rid].sample_logits.append(rows[: appended[rid]])

    def _advance(self, seq: SequenceState, result: StepResult, finished_now: bool) -> None:
        """Gather a sequence's new tokens: log-probabilities, finish, text and stop strings, and
        its stream's delta."""
        request = seq.request
        new = request.output_token_ids[seq.num_seen :]
        seq.num_seen = request.num_output_tokens
        kept = result.logprobs.get(request.request_id, [])[: len(new)]
        new_logprobs = gather_logprobs(seq, kept, self.tokenizer)
        if finished_now:
            seq.finish_reason = FINISH_REASONS[request.status]
            seq.stop_reason = request.stop_reason
        if seq.incremental:
            self._read_text(seq, new, finished_now)
        self._stream(seq, new, new_logprobs)

    def _read_text(self, seq: SequenceState, new: list[int], finished_now: bool) -> None:
        """Add new tokens to the text (a token that stopped the sequence stays out of it); a
        stop string found there stops the sequence."""
        state, request = seq.text, seq.request
        if state is None:
            return
        by_token = finished_now and request.status == RequestStatus.FINISHED_STOPPED
        state.add(new[:-1] if by_token else new, request.num_output_tokens, final=finished_now)
        if state.stop_string is None or seq.finish_reason == "abort":
            return
        if not finished_now:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        request.stop_reason = seq.stop_reason = state.stop_string
        seq.finish_reason = "stop"  # also when a length cap ended it in the same step, as vLLM

    def _stream(self, seq: SequenceState, new: list[int], logprobs: SampleLogprobs | None) -> None:
        queue = self._stream_queues.get(seq.parent_id)
        if queue is None:
            return
        finished = seq.finish_reason is not None
        text = None if seq.text is None else seq.text.delta(finished)
        queue.append(
            StreamDelta(
                seq.parent_id, seq.index, new, text, logprobs, seq.finish_reason, seq.stop_reason
            )
        )

    def _finish(self, parent: ParentRequest) -> None:
        """Forget a finished request; its output goes to `step()` (a stream had its deltas)."""
        del self._parents[parent.request_id]
        for seq in parent.sequences:
            self._sequences.pop(seq.request.request_id, None)
        if parent.request_id not in self._stream_queues:
            self._outputs.append(request_output(parent))


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` of `n`: one sequence, seeded `seed + index`."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return attrs.evolve(params, n=1, seed=seed)
