"""A randomized soak of the engine, driven the way a serving loop drives it.

Between steps, requests arrive (sharing prefixes, greedy or seeded, with stop tokens, stop
strings, penalties, `min_tokens`, `n` completions and log-probabilities), running and waiting
requests are aborted, duplicate ids and invalid requests are mixed in, and `generate` and
`stream` run while other requests are in flight (some streams are closed early). The KV pool is
small enough that preemption happens every few steps. After every step the pool, queues and
block tables must be consistent; at the end every block is free, every greedy or seeded request
equals the same request run alone (tokens, text, finish and stop reasons, log-probabilities),
and an aborted request's tokens are the start of that run's.

CI runs a short budget on every preset; `--soak-steps 400 --soak-seeds 5` runs a long one.
"""

from __future__ import annotations

import random
from collections import Counter

import attrs
import pytest
import torch

from tests.managers.helpers import walk_free_queue
from unified_attn import LLMEngine, SamplingParams
from unified_attn.models import MLA_PRESETS, PRESETS, V4_PRESETS
from unified_attn.request import RequestStatus
from unified_attn.runner.logits_processing import apply_penalties
from unified_attn.sampling_params import RequestOutputKind
from unified_attn.spec_decode.draft_model import DraftModelProposer

MAX_MODEL_LEN = 128
ENGINE = dict(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32, max_num_seqs=6)


@attrs.define
class Submitted:
    prompt: list[int]
    params: SamplingParams
    aborted: bool = False


@attrs.frozen
class Completion:
    """What a caller got for one completion, from an output or from a stream's deltas."""

    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[float] | None = None  # the sampled tokens'
    logits: torch.Tensor | None = attrs.field(default=None, eq=False)


def sampled_logprobs(logprobs, token_ids) -> list[float] | None:
    if logprobs is None:
        return None
    return [entry[t].logprob for entry, t in zip(logprobs, token_ids, strict=True)]


def completions(out) -> list[Completion]:
    return [
        Completion(
            c.token_ids,
            c.text,
            c.finish_reason,
            c.stop_reason,
            sampled_logprobs(c.logprobs, c.token_ids),
            c.logits,
        )
        for c in out.outputs
    ]


def joined(before: Completion, got: Completion, kind: RequestOutputKind) -> Completion:
    """A completion after one more `step()` output: DELTA adds to it, the others replace it."""
    assert before.finish_reason is None, "a completion had an output after its last"
    if kind != RequestOutputKind.DELTA:
        return got
    logprobs = got.logprobs
    if logprobs is not None:
        logprobs = (before.logprobs or []) + logprobs
    return Completion(
        before.token_ids + got.token_ids,
        None if got.text is None else (before.text or "") + got.text,
        got.finish_reason,
        got.stop_reason,
        logprobs,
    )


def streamed(deltas, n: int) -> list[Completion]:
    """Completions put together from a stream's deltas; each index finishes exactly once."""
    parts = [Completion([], "", None, None) for _ in range(n)]
    for d in deltas:
        part = parts[d.index]
        assert part.finish_reason is None, f"completion {d.index} got a delta after its last"
        logprobs = sampled_logprobs(d.logprobs, d.token_ids)
        if logprobs is not None:
            logprobs = (part.logprobs or []) + logprobs
        parts[d.index] = Completion(
            part.token_ids + d.token_ids,
            part.text + d.text,
            d.finish_reason,
            d.stop_reason,
            logprobs,
        )
    return parts


# speculative decoding: drafts are verified, rolled back and aborted under preemption; the
# draft model has a sliding window (its rewinds must not need freed blocks)
SPECULATIVE = {
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=3),
    "draft": dict(speculative_method="draft", draft_model="mistral-like", num_speculative_tokens=3),
}
# Options a soak can run with beyond the default engine: each variant is what shipped since
# the soak was written, under the same memory pressure and checks.
VARIANTS = {
    # draft model = target (same weights): its first draft often equals the target's next
    # token; an 8-token budget leaves no room to verify drafts, 8-token blocks
    "self-draft-tight": dict(
        options=dict(
            speculative_method="draft", draft_model="tiny-llama", num_speculative_tokens=3
        ),
        engine=dict(max_num_batched_tokens=8, max_num_seqs=8, block_size=8),
    ),
    "window-aware": dict(options=dict(kv_cache_eviction="window_aware"), engine={}),
    "fp8": dict(options=dict(kv_cache_dtype="fp8"), engine={}),
    # overlapped steps: scheduled before the previous step's tokens reach the host, and plain
    # steps whenever a request needs its outputs on the host (penalties, logprobs, ...)
    "async": dict(options=dict(async_scheduling=True), engine={}),
}
ALL_PRESETS = sorted([*PRESETS, *MLA_PRESETS, *V4_PRESETS])


class Soak:
    def __init__(
        self, preset: str, seed: int, speculative: str | None = None, variant: str | None = None
    ) -> None:
        self.rng = random.Random(f"{preset}-{seed}")
        options = SPECULATIVE[speculative] if speculative else {}
        self.engine_options = {**ENGINE}
        if variant is not None:
            options = VARIANTS[variant]["options"]
            self.engine_options.update(VARIANTS[variant]["engine"])
        probe = LLMEngine(preset, seed=seed, **self.engine_options, **options)
        blocks = sum(probe.worker.blocks_per_request)
        # one worst-case request and a few spare blocks: requests must take turns
        memory = probe.worker.plan.bytes_per_block * (blocks + 4)
        if "draft_model" in options:  # the draft's pool takes its share of the budget
            memory += draft_share(probe, memory, options["draft_model"])
        self.engine = LLMEngine(
            preset, kv_cache_memory=memory, seed=seed, **self.engine_options, **options
        )
        self.options = options
        self.preset, self.seed = preset, seed
        self.speculative = speculative or ("draft" if "draft_model" in options else None)
        self.vocab = min(self.engine.vocab_size, 256)
        self.prefixes = [self.tokens(self.rng.randint(16, 70)) for _ in range(3)]
        self.stop_tokens = tuple(self.tokens(24))
        self.stop_strings = self.likely_stop_strings(probe)
        self.submitted: dict[str, Submitted] = {}
        self.outputs: dict[str, list[Completion]] = {}  # final, by request id
        self.partial: dict[str, list[Completion]] = {}  # step() outputs so far

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def likely_stop_strings(self, probe: LLMEngine) -> tuple[list[str], list[str]]:
        """Characters of what the model writes greedily (it repeats itself) and pieces of 1 or
        2 characters of what it samples, so that stop strings hit."""
        greedy = probe.generate([self.tokens(8) for _ in range(4)], SamplingParams(max_tokens=8))
        params = SamplingParams(max_tokens=24, temperature=0.9, seed=self.seed, ignore_eos=True)
        sampled = probe.generate([self.tokens(8) for _ in range(2)], params)
        chars = sorted({c for out in greedy for c in out.text}) or ["a"]
        texts = [out.text for out in sampled]
        pieces = {t[i : i + k] for t in texts for k in (1, 2) for i in range(len(t) - k + 1)}
        return chars, sorted(pieces) or ["a"]

    # ---- what a serving loop does between steps ---------------------------------------------

    def random_request(self) -> tuple[list[int], SamplingParams]:
        rng = self.rng
        prefix = rng.choice(self.prefixes) if rng.random() < 0.7 else []
        prompt = (prefix + self.tokens(rng.randint(1, 30)))[: MAX_MODEL_LEN - 8]
        seeded = rng.random() < 0.4
        max_tokens = rng.randint(1, 24)
        params = SamplingParams(
            n=rng.choice([1, 1, 1, 2, 3]),
            max_tokens=max_tokens,
            min_tokens=rng.randint(0, max_tokens) if rng.random() < 0.3 else 0,
            temperature=0.9 if seeded else 0.0,
            top_k=rng.choice([-1, 0, 20]) if seeded else 0,
            seed=rng.randrange(1000) if seeded else None,
            stop=[rng.choice(self.stop_strings[0]), rng.choice(self.stop_strings[1])]
            if rng.random() < 0.4
            else (),
            stop_token_ids=self.stop_tokens if rng.random() < 0.3 else (),
            ignore_eos=rng.random() < 0.5,
            logprobs=rng.choice([0, 3]) if rng.random() < 0.2 else None,
            output_kind=rng.choice(list(RequestOutputKind)),  # step() outputs; generate: final
            **self.random_penalties(),
        )
        return prompt, params

    def random_penalties(self) -> dict[str, float]:
        rng = self.rng
        if rng.random() < 0.7:
            return {}
        return dict(
            presence_penalty=rng.choice([0.0, -0.5, 1.5]),
            frequency_penalty=rng.choice([0.0, 0.5, -1.0]),
            repetition_penalty=rng.choice([1.0, 0.8, 1.3]),
        )

    def add(self) -> None:
        prompt, params = self.random_request()
        request_id = None
        if self.rng.random() < 0.2:  # a caller-chosen id, often one automatic ids would use next
            request_id = f"req-{len(self.submitted) + self.rng.randrange(4)}"
            if request_id in self.submitted:  # ids are kept unique to key the bookkeeping
                request_id = f"mine-{len(self.submitted)}"
        rid = self.engine.add_request(request_id, prompt, params)
        assert rid not in self.submitted, f"request id {rid} was handed out twice"
        self.submitted[rid] = Submitted(prompt, params)

    def add_invalid(self) -> None:
        engine = self.engine
        scheduler = engine.scheduler
        live = list(scheduler.requests)  # with `n > 1`: `<id>#0`, `<id>#1`, ...
        before = (len(scheduler.waiting), list(scheduler.requests), engine.unfinished_request_ids())
        ok = SamplingParams(max_tokens=2)
        cases = [
            ([], ok, None, "is empty"),
            ([1, engine.vocab_size + 3], ok, None, "outside the vocabulary"),
            ([1] * MAX_MODEL_LEN, ok, None, "leaves no room"),
            ([1], SamplingParams(stop_token_ids=[engine.vocab_size]), None, "stop_token_ids"),
            ([1, 2], SamplingParams(logprobs=engine.vocab_size + 1), None, "logprobs"),
        ]
        if live:  # a running id: a caller's, or one an `n > 1` request runs under
            cases.append(([1, 2], ok, self.rng.choice(live), "already in use"))
            parent = self.rng.choice(engine.unfinished_request_ids())
            cases.append(([1, 2], SamplingParams(n=2), parent, "already in use"))
        prompt, params, request_id, message = self.rng.choice(cases)
        with pytest.raises(ValueError, match=message):
            engine.add_request(request_id, prompt, params)
        after = (len(scheduler.waiting), list(scheduler.requests), engine.unfinished_request_ids())
        assert after == before

    def abort(self) -> None:
        live = self.engine.unfinished_request_ids()
        if live:
            rid = self.rng.choice(live)
            self.engine.abort_request([rid, "never-added"])
            self.submitted[rid].aborted = True
            self.engine.abort_request(rid)  # gone already: ignored, as vLLM does

    def generate_one(self) -> None:
        prompt, params = self.random_request()
        (out,) = self.engine.generate([prompt], params)
        assert out.request_id not in self.submitted
        self.submitted[out.request_id] = Submitted(prompt, params)
        self.outputs[out.request_id] = completions(out)

    def stream_one(self) -> None:
        """Read a stream to its end, or close it after a few deltas (its requests are dropped)."""
        prompt, params = self.random_request()
        close_after = self.rng.choice([None, None, 1, 3])
        deltas = []
        stream = self.engine.stream([prompt], params)
        for delta in stream:
            deltas.append(delta)
            if len(deltas) == close_after:
                stream.close()
        (rid,) = {d.request_id for d in deltas}
        assert rid not in self.submitted and rid not in self.engine.unfinished_request_ids()
        if sum(d.finished for d in deltas) == params.n:  # it ran to its end
            self.submitted[rid] = Submitted(prompt, params)
            self.outputs[rid] = streamed(deltas, params.n)

    def between_steps(self) -> None:
        rng = self.rng
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            self.add()
        if rng.random() < 0.1:
            self.add_invalid()
        if rng.random() < 0.08:
            self.abort()
        if rng.random() < 0.03:
            self.generate_one()
        if rng.random() < 0.05:
            self.stream_one()

    def step(self) -> None:
        for out in self.engine.step():
            rid = out.request_id
            assert rid not in self.outputs, f"{rid} had an output after its final one"
            submitted = self.submitted[rid]
            empty = [Completion([], "", None, None)] * submitted.params.n
            parts = self.partial.setdefault(rid, empty)
            kind = submitted.params.output_kind
            for c, got in zip(out.outputs, completions(out), strict=True):
                parts[c.index] = joined(parts[c.index], got, kind)
            if not out.finished:
                assert kind != RequestOutputKind.FINAL_ONLY
                continue
            assert submitted.aborted == any(c.finish_reason == "abort" for c in out.outputs)
            assert all(c.finish_reason is not None for c in parts)
            self.outputs[rid] = parts
        check_invariants(self.engine)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.between_steps()
            self.step()
        while self.engine.has_unfinished_requests():  # until every output is handed out
            self.step()
        self.step()  # the runner forgets the requests that finished in the last step

    # ---- the end ---------------------------------------------------------------------------

    def check_end(self) -> None:
        engine = self.engine
        pool = engine.kv_cache_manager.block_pool
        assert engine.kv_cache_manager.usage == 0.0
        assert walk_free_queue(pool) and pool.get_num_free_blocks() == pool.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        runner = engine.runner
        assert not runner.block_tables.rows and not runner.sampler.generators
        processor = runner.sampler.logits_processor
        assert not processor.disallowed_masks and not engine.unfinished_request_ids()
        assert processor.output_counts is None or not processor.output_counts.rows
        assert set(self.outputs) == set(self.submitted), "a request ended without an output"
        assert engine.scheduler.num_preemptions > 0, "the pool never forced a preemption"

    def check_draft_pool_is_empty(self) -> None:
        drafter = self.engine.drafter
        assert isinstance(drafter, DraftModelProposer)
        assert drafter.num_shadows == 0 and drafter.kv_cache_manager.usage == 0.0
        assert not drafter.runner.block_tables.rows

    def check_against_alone(self) -> None:
        # the same weights (the seed draws them), a pool of the default size, no prefix cache,
        # no speculation; an fp8 cache with the soak's calibrated scales
        same = {k: v for k, v in self.options.items() if k == "kv_cache_dtype"}
        alone = LLMEngine(
            self.preset, enable_prefix_caching=False, seed=self.seed, **self.engine_options, **same
        )
        if same:
            copy_fp8_scales(self.engine, alone)
        for rid, got in self.outputs.items():
            submitted = self.submitted[rid]
            if self.speculative and not submitted.params.greedy:
                continue  # verification draws other random numbers than plain sampling
            params = attrs.evolve(submitted.params, return_logits=True)
            (ref,) = alone.generate([submitted.prompt], params)
            where = f"{self.preset}: {rid} ({submitted.params})"
            for mine, want in zip(got, completions(ref), strict=True):
                if self.speculative and isinstance(mine.stop_reason, str):
                    mine = stopped_in_a_speculative_step(mine, want)
                check_completion(mine, want, submitted, where)


def stopped_in_a_speculative_step(mine: Completion, want: Completion) -> Completion:
    """A stop string found in a step that accepted several tokens ends the text there, but the
    step's tokens after it stay in `token_ids` (as in vLLM, whose detokenizer cuts only the
    text): `mine` with the tokens past the run alone's dropped, once they are its extension."""
    n = len(want.token_ids)
    if want.stop_reason == mine.stop_reason and mine.token_ids[:n] == want.token_ids:
        return attrs.evolve(mine, token_ids=mine.token_ids[:n])
    return mine


def check_completion(mine: Completion, want: Completion, submitted: Submitted, where: str) -> None:
    """`mine` equals the run alone (an aborted one: its start), or took the other side of an
    exact tie (greedy only)."""
    tokens = want.token_ids
    if mine.finish_reason == "abort":
        tokens = tokens[: len(mine.token_ids)]
    if mine.token_ids != tokens:
        # Batches change float rounding in the last bits: a greedy request may take the
        # other side of an exact tie. Accept that, and only that.
        assert submitted.params.greedy and is_tie(mine, want, submitted), where
        return
    if mine.finish_reason == "abort":
        return
    assert attrs.evolve(mine, logprobs=None) == attrs.evolve(want, logprobs=None), (
        f"{where} differs from the same request alone"
    )
    if want.logprobs is not None:
        assert mine.logprobs == pytest.approx(want.logprobs, abs=1e-4), where


TIE = 1e-5  # logits closer than this are a tie in float32


def is_tie(mine: Completion, want: Completion, submitted: Submitted) -> bool:
    """The first differing token of `mine` was within `TIE` of the reference's choice, on the
    logits the greedy choice was made on (the raw ones, penalized if the request has
    penalties)."""
    pairs = zip(mine.token_ids, want.token_ids, strict=False)
    j = next((j for j, (a, b) in enumerate(pairs) if a != b), None)
    if j is None:
        return False  # one is longer: not a tie
    assert want.logits is not None
    logits, params = want.logits[j], submitted.params
    if params.has_penalties:
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
        mask[submitted.prompt] = True
        logits = apply_penalties(logits, mask, want.token_ids[:j], params)
    return bool(logits[want.token_ids[j]] - logits[mine.token_ids[j]] < TIE)


def check_invariants(engine: LLMEngine) -> None:
    """Pool, queues and block tables after a step."""
    scheduler, kv = engine.scheduler, engine.kv_cache_manager
    pool = kv.block_pool
    running, waiting = scheduler.running, list(scheduler.waiting)
    assert len(running) <= scheduler.max_num_seqs
    assert {r.request_id for r in running}.isdisjoint(r.request_id for r in waiting)
    assert {r.request_id for r in running + waiting} == set(scheduler.requests)
    assert all(r.status == RequestStatus.RUNNING for r in running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in waiting)
    owners: Counter[int] = Counter()
    for request in running:  # with a step in flight its sampled tokens count as known
        known = request.num_tokens + request.num_output_placeholders
        assert 0 < request.num_computed_tokens <= known
        blocks = kv.get_blocks(request).blocks
        owners.update(b.block_id for group in blocks for b in group if not b.is_null)
        check_block_table(engine, request.request_id, blocks)
    for request in waiting:
        assert request.num_computed_tokens == 0
        assert not any(kv.get_block_ids(request)), f"waiting {request} holds blocks"
    for block in pool.blocks[1:]:
        assert block.ref_cnt == owners[block.block_id], f"{block}: wrong ref count"
    free = walk_free_queue(pool)
    assert set(free) == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    null = pool.null_block
    assert null.is_null and null.ref_cnt == 0 and null.block_hash is None
    in_use = pool.num_blocks - 1 - pool.get_num_free_blocks()
    assert kv.usage == pytest.approx(in_use / (pool.num_blocks - 1))


def check_block_table(engine: LLMEngine, request_id: str, blocks) -> None:
    """The runner's row holds every live block id the manager gave the request."""
    tables = engine.runner.block_tables
    row = tables.rows[request_id]
    for gid, group in enumerate(blocks):
        assert tables.lengths[gid][row] == len(group), f"{request_id}: group {gid} length"
        row_ids = tables.tables_np[gid][row]
        for i, block in enumerate(group):
            if not block.is_null:  # freed window positions keep stale ids
                assert row_ids[i] == block.block_id, f"{request_id}: group {gid} entry {i}"


def copy_fp8_scales(source: LLMEngine, target: LLMEngine) -> None:
    """Give `target`'s fp8 layers the K/V scales `source` calibrated, fixed: the first prefill
    calibrates them, so a request alone would otherwise quantize with other scales."""
    scales = {}
    for layer, backend in source.model.attention_layers():
        if getattr(backend, "kv_scales", None) is not None:
            scales[layer.name] = backend.kv_scales.tensors[layer.name]
    assert scales, "no layer has an fp8 cache"
    for layer, backend in target.model.attention_layers():
        if layer.name in scales:
            backend.kv_scales.tensors[layer.name].copy_(scales[layer.name])
            backend.kv_scales.fixed.add(layer.name)


def draft_share(probe: LLMEngine, memory: int, draft_model: str) -> int:
    """Bytes to add to a target's `memory` so that it keeps them beside its draft model's pool
    (the budget is split by bytes per token)."""
    draft = LLMEngine(draft_model, **ENGINE).worker.plan
    target = probe.worker.plan
    per_token = [plan.bytes_per_block / plan.block_size for plan in (draft, target)]
    return int(memory * per_token[0] / per_token[1]) + target.bytes_per_block


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_soak(preset, soak_steps, soak_seeds):
    for seed in range(soak_seeds):
        soak = Soak(preset, seed)
        soak.run(soak_steps)
        soak.check_end()
        soak.check_against_alone()


@pytest.mark.parametrize("preset", [p for p in ALL_PRESETS if p != "hybrid-linear"])
def test_soak_with_speculative_decoding(preset, soak_steps, soak_seeds):
    """Greedy requests equal the run alone without speculation; no block leaks after drafts
    are rolled back, preempted or aborted."""
    for seed in range(soak_seeds):
        soak = Soak(preset, seed, speculative="ngram")
        soak.run(soak_steps)
        soak.check_end()
        stats = soak.engine.stats
        assert stats.spec_drafted > 0 and 0 < stats.spec_accepted <= stats.spec_drafted
        soak.check_against_alone()


@pytest.mark.parametrize("preset", sorted(p for p in PRESETS if p != "hybrid-linear"))
def test_soak_with_a_draft_model(preset, soak_steps, soak_seeds):
    """The same with a draft model: greedy requests equal the run alone, and the draft's pool,
    shadows and block-table rows are empty at the end."""
    for seed in range(soak_seeds):
        soak = Soak(preset, seed, speculative="draft")
        soak.run(soak_steps)
        soak.check_end()
        soak.check_draft_pool_is_empty()
        assert soak.engine.stats.spec_drafted > 0
        soak.check_against_alone()


# the presets each variant applies to: window-aware eviction where windows are, fp8 where the
# backends store it (the V4 caches hold the model dtype)
VARIANT_PRESETS = {
    "self-draft-tight": ["tiny-llama"],
    "window-aware": ["deepseek-v4-like", "gemma2-like", "mistral-like", "streaming-llm"],
    "fp8": ["deepseek-v3-like", "gpt-oss-like", "mistral-like", "tiny-llama"],
    "async": ["deepseek-v3-like", "deepseek-v4-like", "gemma2-like", "hybrid-linear", "tiny-llama"],
}


@pytest.mark.parametrize(
    "variant, preset", [(v, p) for v, presets in VARIANT_PRESETS.items() for p in presets]
)
def test_soak_with_engine_options(variant, preset, soak_steps, soak_seeds):
    """The soak with options that shipped after it: self-drafting under a budget too small to
    verify drafts (it once hung), window-aware eviction, fp8 caches (compared with requests
    alone that quantize with the same scales)."""
    for seed in range(soak_seeds):
        soak = Soak(preset, seed, variant=variant)
        soak.run(soak_steps)
        soak.check_end()
        if soak.speculative == "draft":
            soak.check_draft_pool_is_empty()
        soak.check_against_alone()
