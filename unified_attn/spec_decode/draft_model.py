"""Speculative decoding with a draft model: a small model that shares the target's tokenizer
proposes each request's drafts greedily, `k` batched forwards per step.

The draft model runs over the same contract as the target: its own `Worker` (plan, size,
allocate, bind), its own `KVCacheManager` and `ModelRunner`. It keeps one *shadow* request per
target request that decodes: the target's verified tokens followed by the drafts of the last
round. A round (after every target step) does:

1. **Sync**: the shadow's tokens after the longest prefix it shares with the target's tokens
   are dropped (rejected drafts) and the target's new tokens appended; the draft's cache stays
   valid up to that prefix (`num_computed_tokens` moves back to it, as the target's scheduler
   rolls back rejected drafts).
2. **Catch-up**: one forward over every shadow's uncomputed tokens (usually the bonus token, two
   after a full acceptance; the whole prompt for a new request, in chunks of the token budget);
   the last row's argmax is the first draft. Its slots, and the lookahead slots of the drafts to
   come, are reserved here.
3. **Decode**: `k - 1` forwards of one token per shadow, each feeding the last draft and taking
   the next one. The forwards chain on the device (`ModelRunner.greedy_tokens`: the argmax
   stays there and is the next forward's input), so the host lays out the next forward while
   the GPU runs this one; the round's drafts reach the host in one transfer at its end. On
   CUDA, forwards of 1 or 2 tokens per request replay the draft runner's captured graphs.

Drafts are the draft model's argmax, a point-mass proposal: `Sampler.verify` accepts a draft
with the target's probability of it and resamples from the rest on a rejection, so sampled
requests keep the target distribution and greedy ones the target's tokens. The draft pool keeps
no prefix cache: drafts and rejected tokens are rewritten in place, which a cached block must
never be.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from unified_attn.managers import KVCacheManager, StateManager
from unified_attn.request import Request, RequestStatus
from unified_attn.runner.model_runner import ModelRunner
from unified_attn.runner.model_source import ModelSource, load_model
from unified_attn.runner.scheduler import ScheduledRequest, SchedulerOutput
from unified_attn.runner.worker import Worker
from unified_attn.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)


@attrs.define
class _Shadow:
    """The draft's copy of one target request."""

    target: Request  # the engine's request it drafts for
    request: Request  # the target's verified tokens, then the last round's drafts
    num_synced: int  # tokens of `request` known to equal the target's at the last sync
    is_new: bool = True  # its block-table row is not written in the draft runner yet


@attrs.define
class _Draft:
    """One shadow's share of a round: how many drafts it may propose, and those it has (each
    a row of a forward's device tensor until the round's one host transfer)."""

    shadow: _Shadow
    limit: int
    start: int  # the shadow's length before its first draft (the target's length)
    rows: list[tuple[torch.Tensor, int]] = attrs.Factory(list)


def load_draft_model(
    config: Any, target: ModelSource, max_model_len: int, device: torch.device
) -> tuple[ModelSource, Worker]:
    """The draft model of `config.draft_model` (a preset or checkpoint, loaded like the target:
    same device, dtype and backend option) and its planned, not yet sized, worker. Refuses a
    draft whose tokens the target cannot read or whose cache cannot roll back."""
    name = config.draft_model
    source = load_model(attrs.evolve(config, model=name, max_model_len=None))
    if source.kind != "decoder":
        raise ValueError(
            f"draft_model={name!r} is an {source.kind.replace('_', '-')} model; a draft model "
            "must be a decoder-only model sharing the target's tokenizer"
        )
    if source.vocab_size > target.vocab_size:
        raise ValueError(
            f"draft_model={name!r} has a vocabulary of {source.vocab_size} tokens, more than the "
            f"target's {target.vocab_size}: its drafts would not be target tokens; pick a draft "
            "model with the target's tokenizer"
        )
    worker = Worker(
        source.model,
        device=device,
        max_model_len=min(max_model_len, source.max_model_len),
        max_in_flight_tokens=min(config.max_num_batched_tokens, source.max_model_len),
        kv_cache_memory=None,
        gpu_memory_utilization=config.gpu_memory_utilization,
    )
    state = [g.manager_cls.__name__ for g in worker.plan.groups if _is_state(g.manager_cls)]
    if state:
        raise ValueError(
            f"draft_model={name!r} has state layers ({', '.join(state)}) whose recurrent state "
            "cannot roll back rejected drafts; pick a draft model with attention layers only"
        )
    return source, worker


def _is_state(manager_cls: type) -> bool:
    return issubclass(manager_cls, StateManager)


def split_kv_budget(target: Worker, draft: Worker) -> None:
    """Share the engine's KV budget (`kv_cache_memory`, or the free-memory fraction on CUDA)
    between the target and the draft in proportion to their bytes per token, so both pools
    hold about the same number of tokens."""
    total = target.available_memory()
    per_token = [w.plan.bytes_per_block / w.plan.block_size for w in (target, draft)]
    target.kv_cache_memory = int(total * per_token[0] / sum(per_token))
    draft.kv_cache_memory = total - target.kv_cache_memory


class DraftModelProposer:
    """Proposes each decoding request's drafts with a draft model (see the module docstring).

    Built on an allocated draft `worker`; `draft` runs one round for the requests of a step.
    """

    def __init__(
        self,
        source: ModelSource,
        worker: Worker,
        *,
        name: str,
        num_speculative_tokens: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        seed: int = 0,
        cuda_graphs: bool = False,
    ) -> None:
        self.name = name
        self.num_speculative_tokens = num_speculative_tokens
        self.source = source
        self.worker = worker
        self.max_model_len = worker.max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_cache_manager = KVCacheManager(
            worker.plan.scheduler_config(worker.num_blocks),
            worker.max_model_len,
            max_in_flight_tokens=worker.max_in_flight_tokens,
            enable_caching=False,
        )
        self.runner = ModelRunner(
            source.model,
            worker.plan,
            device=worker.device,
            max_num_seqs=max_num_seqs,
            max_model_len=worker.max_model_len,
            seed=seed,
            cuda_graphs=cuda_graphs,
            # graphs for 1 and 2 tokens per request: the catch-up after a rejection or a full
            # acceptance, and the decode forwards
            graph_query_lens=(1, 2),
        )
        self._shadows: dict[str, _Shadow] = {}

    @property
    def num_shadows(self) -> int:
        return len(self._shadows)

    def draft(self, requests: Sequence[tuple[Request, int]]) -> None:
        """Set `spec_token_ids` of each `(request, limit)`: exactly `min(k, limit)` drafts (no
        more than the draft model's `max_model_len` allows), or none when the draft pool has
        no room for them this step. The round's forwards feed on each other's tokens on the
        device; the drafts reach the host once, at the end."""
        self._forget_finished()
        drafts = []
        for request, limit in requests:
            request.spec_token_ids = []
            limit = min(self.num_speculative_tokens, limit, self.max_model_len - request.num_tokens)
            if limit > 0:
                shadow = self._sync(request)
                drafts.append(_Draft(shadow, limit, shadow.request.num_tokens))
        started = self._catch_up(drafts)
        for _ in range(1, self.num_speculative_tokens):
            started = [d for d in started if len(d.rows) < d.limit]
            if not started:
                break
            self._decode(started)
        self._publish(drafts)

    # ---- shadows -------------------------------------------------------------------------------

    def _forget_finished(self) -> None:
        """Free the shadows of requests that stopped running (finished, aborted, preempted)."""
        for rid, shadow in list(self._shadows.items()):
            if shadow.target.status != RequestStatus.RUNNING:
                self._drop(rid)

    def _drop(self, rid: str) -> None:
        del self._shadows[rid]
        self.kv_cache_manager.free(rid)
        self.runner.block_tables.drop(rid)
        self.runner.sampler.drop(rid)

    def _sync(self, target: Request) -> _Shadow:
        """The target's shadow with the target's tokens; the draft cache's valid prefix kept."""
        rid = target.request_id
        shadow = self._shadows.get(rid)
        if shadow is not None and shadow.target is not target:
            self._drop(rid)  # a new request with a reused id
            shadow = None
        if shadow is None:
            request = Request(rid, target.prompt_token_ids, sampling_params=_GREEDY)
            request.append_output_token_ids(target.output_token_ids)
            request.status = RequestStatus.RUNNING
            shadow = self._shadows[rid] = _Shadow(target, request, target.num_tokens)
            return shadow
        request, tokens = shadow.request, target.all_token_ids
        same, end = shadow.num_synced, min(request.num_tokens, len(tokens))
        while same < end and request.all_token_ids[same] == tokens[same]:
            same += 1
        _truncate(request, same)
        request.append_output_token_ids(tokens[same:])
        # The first draft is the argmax after the last token, so that token is computed again
        # when the draft cache already holds it: the target took the shadow's first draft
        # without verifying it (its drafts did not fit the step's budget). Rewriting its slot
        # stores the same values; the draft pool keeps no prefix cache.
        request.num_computed_tokens = min(request.num_computed_tokens, same, len(tokens) - 1)
        shadow.num_synced = len(tokens)
        return shadow

    # ---- forwards ------------------------------------------------------------------------------

    def _catch_up(self, drafts: list[_Draft]) -> list[_Draft]:
        """Compute every shadow's uncomputed tokens (chunked by the token budget) and take its
        first draft; returns the drafts that started (a shadow the pool cannot hold gets none)."""
        pending, started = list(drafts), []
        while pending:
            batch: list[tuple[_Draft, ScheduledRequest]] = []
            waiting, budget = [], self.max_num_batched_tokens
            for d in pending:
                request = d.shadow.request
                todo = request.num_tokens - request.num_computed_tokens
                num_new = min(todo, budget)
                if num_new <= 0 or len(batch) == self.max_num_seqs:
                    waiting.append(d)
                    continue
                last = num_new == todo
                lookahead = d.limit - 1 if last else 0
                blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new, num_lookahead_tokens=lookahead
                )
                if blocks is None:
                    continue  # no room in the draft pool: this request decodes without drafts
                ids = blocks.get_block_ids()
                batch.append((d, self._entry(d.shadow, num_new, ids, will_sample=last)))
                budget -= num_new
            if not batch and waiting:  # never loop without progress
                raise RuntimeError(
                    f"draft model {self.name!r}: catch-up made no progress for "
                    f"{len(waiting)} request(s) ({waiting[0].shadow.request.request_id!r}: "
                    f"{waiting[0].shadow.request.num_tokens} tokens, "
                    f"{waiting[0].shadow.request.num_computed_tokens} computed); this is a bug, "
                    "please report it"
                )
            self._run(batch)
            started += [d for d, entry in batch if entry.will_sample]
            pending = waiting
        return started

    def _decode(self, drafts: list[_Draft]) -> None:
        """Feed every shadow's last draft (its slot was reserved by `_catch_up`) and take the
        next one."""
        none: tuple[list[int], ...] = tuple([] for _ in self.runner.block_sizes)
        batch = [(d, self._entry(d.shadow, 1, none, will_sample=True)) for d in drafts]
        self._run(batch, _last_tokens(drafts))

    def _entry(
        self, shadow: _Shadow, num_new: int, block_ids: tuple[list[int], ...], *, will_sample: bool
    ) -> ScheduledRequest:
        request = shadow.request
        if shadow.is_new:  # the whole table, as the scheduler gives a (re)starting request
            block_ids = self.kv_cache_manager.get_block_ids(request)
        entry = ScheduledRequest(
            request, num_new, request.num_computed_tokens, block_ids, shadow.is_new, will_sample
        )
        shadow.is_new = False
        request.num_computed_tokens += num_new
        return entry

    def _run(
        self, batch: list[tuple[_Draft, ScheduledRequest]], input_ids: torch.Tensor | None = None
    ) -> None:
        """One draft forward; each sampling row's argmax becomes a draft, kept on the device
        (the shadow holds a placeholder token until `_publish`)."""
        if not batch:
            return
        output = SchedulerOutput([e for _, e in batch], [], [])
        tokens = self.runner.greedy_tokens(output, input_ids)
        row = 0
        for d, entry in batch:
            if entry.will_sample:
                assert tokens is not None
                d.rows.append((tokens, row))
                entry.request.append_output_token_ids(_PLACEHOLDER)
                row += 1

    def _publish(self, drafts: list[_Draft]) -> None:
        """Bring the round's drafts to the host in one transfer; they become the requests'
        `spec_token_ids` and replace the shadows' placeholders."""
        tensors: dict[int, tuple[int, torch.Tensor]] = {}
        for d in drafts:
            for tensor, _ in d.rows:
                if id(tensor) not in tensors:
                    offset = sum(len(t) for _, t in tensors.values())
                    tensors[id(tensor)] = (offset, tensor)
        if not tensors:
            return
        host = torch.cat([t for _, t in tensors.values()]).tolist()
        for d in drafts:
            tokens = [host[tensors[id(tensor)][0] + row] for tensor, row in d.rows]
            d.shadow.target.spec_token_ids = tokens
            request = d.shadow.request
            _truncate(request, d.start)
            request.append_output_token_ids(tokens)


_PLACEHOLDER = 0  # a draft's token in its shadow until the round's drafts reach the host


def _last_tokens(drafts: list[_Draft]) -> torch.Tensor:
    """The device tensor of every draft's latest token, in order: the previous forward's
    output itself when it lines up (the usual case), else gathered."""
    tensor, _ = drafts[0].rows[-1]
    if len(tensor) == len(drafts) and all(
        d.rows[-1][0] is tensor and d.rows[-1][1] == i for i, d in enumerate(drafts)
    ):
        return tensor
    return torch.stack([t[row] for t, row in (d.rows[-1] for d in drafts)])


def _truncate(request: Request, num_tokens: int) -> None:
    """Drop a shadow's tokens from `num_tokens` on (it has no block hashes to undo)."""
    del request.all_token_ids[num_tokens:]
    del request.output_token_ids[max(0, num_tokens - request.num_prompt_tokens) :]
