"""`LLMEngine`: model + worker + KV-cache manager + scheduler + runner behind `generate`, `stream`
and a step-by-step serving loop, with vLLM-shaped outputs and stream deltas (`outputs.py`).
`request_intake.py` checks and builds what a request queues, `request_tracker.py` follows
queued requests to their outputs."""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs

from unified_attn.distributed.tp_group import TensorParallelGroup, serve_launched_rank
from unified_attn.distributed.tp_rank import (
    agree_on_blocks,
    make_rank_runner,
    make_worker,
    rank_model,
)
from unified_attn.engine.engine_config import (
    EngineConfig,
    EngineStats,
    check_batch_invariant_options,
    check_engine_options,
    with_environment,
)
from unified_attn.engine.outputs import EncodeOutput, RequestOutput, StreamDelta
from unified_attn.engine.prompts import (
    PromptReader,
    PromptType,
    RequestIds,
    as_list,
    encode_packed,
)
from unified_attn.engine.request_intake import (
    PreparedPrompt,
    check_params,
    check_request_id,
    child_ids,
    new_parent,
    new_request,
    new_sequence,
    params_per_prompt,
    request_id_list,
)
from unified_attn.engine.request_tracker import RequestTracker
from unified_attn.engine.step_loop import StepLoop, overlap_steps
from unified_attn.managers import KVCacheManager, StateManager
from unified_attn.managers.events import KVCacheEvent
from unified_attn.managers.eviction import check_eviction
from unified_attn.models.invariant import require_batch_invariant
from unified_attn.runner.device import resolve_device
from unified_attn.runner.gc_heap import freeze_if_configured, unfreeze_heap
from unified_attn.runner.kv_access import KVCacheAccess
from unified_attn.runner.model_source import load_model
from unified_attn.runner.scheduler import Scheduler
from unified_attn.runner.worker import KVCacheReport, agree_on_num_blocks
from unified_attn.sampling_params import RequestOutputKind, SamplingParams
from unified_attn.spec_decode.proposers import build_drafter


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
        self.config = config = with_environment(EngineConfig(model=model, **kwargs))
        self.batch_invariant = config.batch_invariant
        if self.batch_invariant:
            check_batch_invariant_options(config)
        self.device = resolve_device(config.device)
        # tensor parallelism: under torchrun ranks 1..N-1 serve here, else rank 0 spawns them
        serve_launched_rank(config)
        self._tp = TensorParallelGroup(config) if config.tensor_parallel_size > 1 else None
        try:
            self._build(config)
        except BaseException as error:
            if self._tp is not None:
                self._tp.fail(error)
            raise
        if self._tp is not None:  # once every rank has built, collectives time out sooner
            self._tp.built()
            weakref.finalize(self, self._tp.shutdown)
        # the serving loop's collections skip the startup heap (runner/gc_heap.py)
        self._frozen = freeze_if_configured(config.freeze_gc)

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
        if k and any(issubclass(g.manager_cls, StateManager) for g in self.worker.plan.groups):
            # a state layer's read and write columns depend on the previous step's accepted
            # drafts, which the graphs' device-side plan does not see: decode runs eagerly
            config = attrs.evolve(config, cuda_graphs=False)
        # decode steps verifying k drafts per request replay graphs too
        self.runner = make_rank_runner(config, source, self.worker, (1, 1 + k) if k else (1,))
        self.stats = EngineStats()
        # host work of one step overlapped with the device's previous one (engine/step_loop.py)
        self._loop = StepLoop(self, overlap_steps(config, self.device))
        self._ids = RequestIds()
        # the queued requests, their progress and their outputs not handed out yet
        self._requests = RequestTracker(self.scheduler, lambda: self.tokenizer)
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
        return encode_packed(self.runner, read, self.config.max_num_batched_tokens,
                             self.config.max_num_seqs)  # fmt: skip

    def add_request(
        self,
        request_id: str | None = None,
        prompt: PromptType | None = None,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue a request, as vLLM's `add_request(request_id, prompt, params)`
        (`request_id=None`: the engine picks one); returns its id. `step()` then returns its
        outputs as `params.output_kind` says. Bad input raises before any state changes."""
        check_request_id(request_id, prompt)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"add_request: cache_salt must be a str or None, got {cache_salt!r}")
        what = "add_request" if request_id is None else f"request {request_id}"
        prepared = self._prepare(what, prompt, params)
        return self._add(prepared, request_id, cache_salt, prepared.params.output_kind)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop unfinished requests (all their completions) and free their blocks; ids that
        are not unfinished requests (finished meanwhile, or unknown) are ignored, as vLLM does.
        An aborted request's output, with the tokens generated so far and
        `finish_reason="abort"`, comes from the next `step()` (or from the `generate` or
        `stream` that runs it)."""
        for request_id in request_id_list(request_ids):
            self._requests.abort(request_id)

    def get_num_unfinished_requests(self) -> int:
        """Completions still running or waiting (as vLLM, each of a request's `n` counts)."""
        return self._requests.num_unfinished_sequences()

    def unfinished_request_ids(self) -> list[str]:
        """Ids of the requests still running or waiting, in the order they were added."""
        return self._requests.unfinished_ids()

    def has_unfinished_requests(self) -> bool:
        """Requests still to run, or finished ones whose output `step()` has not returned yet."""
        return self.scheduler.has_unfinished() or self._requests.has_outputs

    def _prepare(self, what: str, prompt: Any, params: Any) -> PreparedPrompt:
        if self.kind == "encoder_only":
            raise ValueError(
                f"{what}: {self.config.model!r} is an encoder-only model, it generates no "
                "tokens; use encode(prompts) for its hidden states"
            )
        params = SamplingParams() if params is None else params
        check_params(what, params, self.tokenizer, self.vocab_size)
        return PreparedPrompt(self.prompts.read(what, prompt), params)

    def _add(
        self,
        prompt: PreparedPrompt,
        request_id: str | None,
        cache_salt: str | None,
        kind: RequestOutputKind | deque[StreamDelta],
    ) -> str:
        """Queue a validated prompt as `n` scheduler requests; `kind` says what `step()` returns
        for it, or is the queue that streams it."""
        if request_id is None:
            request_id = self._ids.new()
        ids = child_ids(request_id, prompt.params.n)
        self._requests.check_new_ids(request_id, ids)
        self._ids.reserve(request_id)
        queue = kind if isinstance(kind, deque) else None
        output_kind = kind if not isinstance(kind, deque) else RequestOutputKind.DELTA
        parent = new_parent(request_id, prompt.read, output_kind)
        incremental = output_kind != RequestOutputKind.FINAL_ONLY
        for index, child_id in enumerate(ids):
            hasher = self.kv_cache_manager.make_block_hasher()
            request = new_request(child_id, prompt, index, hasher, cache_salt, self.tokenizer)
            self.scheduler.add_request(request)
            parent.sequences.append(
                new_sequence(request_id, index, request, self.tokenizer, incremental=incremental)
            )
        self._requests.add(parent, queue)
        return request_id

    # ---- running -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step. Returns, as vLLM's, an output for every `add_request`
        request the step advanced (its whole output so far, or what the step added, by its
        `SamplingParams.output_kind`; FINAL_ONLY: only when it finishes, `finished=True`),
        and the final outputs of requests aborted since the last step."""
        self._step()
        return self._requests.take_all()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_progress: Callable[[int, int], object] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order. `on_progress(done, total)` is
        called after every step (a progress bar's hook).

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
                ids.append(self._add(prompt, None, None, RequestOutputKind.FINAL_ONLY))
            while True:
                self._requests.take(set(ids), done)
                if on_progress is not None:
                    on_progress(len(done), len(ids))
                if len(done) == len(ids):
                    return [done[i] for i in ids]
                self._check_progress("generate", set(ids) - done.keys())
                self._step()
        except BaseException:
            self._requests.drop(set(ids) - done.keys())
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

    def _run_stream(self, batch: list[PreparedPrompt]) -> Iterator[StreamDelta]:
        queue: deque[StreamDelta] = deque()
        ids: list[str] = []
        try:
            for prompt in batch:
                ids.append(self._add(prompt, None, None, queue))
            remaining = sum(prompt.params.n for prompt in batch)
            while remaining:
                if not queue:
                    unfinished = {i for i in ids if self._requests.is_unfinished(i)}
                    self._check_progress("stream", unfinished)
                    self._step()
                    continue
                delta = queue.popleft()
                remaining -= delta.finished
                yield delta
        finally:
            self._requests.end_stream(ids)

    def _batch(self, what: str, prompts: Any, params: Any) -> list[PreparedPrompt]:
        """Every prompt read and validated, with its parameters, before any is queued."""
        batch = as_list(what, prompts)
        all_params = params_per_prompt(what, params, len(batch))
        return [
            self._prepare(f"{what}: prompt {i}", prompt, sp)
            for i, (prompt, sp) in enumerate(zip(batch, all_params, strict=True))
        ]

    def _check_progress(self, what: str, waiting_for: set[str]) -> None:
        if not self.scheduler.has_unfinished():
            raise RuntimeError(f"{what}: requests {sorted(waiting_for)} ended without an output")

    # ---- one step ------------------------------------------------------------------------------

    def _step(self) -> None:
        if self._tp is not None and self._tp.closed:
            raise RuntimeError(
                "this tensor-parallel engine was shut down (or a rank failed); build a new one"
            )
        self._loop.step()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and leave their process group, and give the
        objects frozen at startup back to the garbage collector (`freeze_gc`). The engine
        cannot step afterwards with tensor parallelism."""
        self._loop.finish_pending()
        if self._frozen:
            self._frozen = False
            unfreeze_heap()
        if self._tp is not None:
            self.runner.graphs = None  # graphs hold the group's captured collectives
            self._tp.shutdown()
