"""A randomized soak of the engine, driven the way a serving loop drives it.

Between steps, requests arrive (sharing prefixes, greedy or seeded, with stop tokens), running
and waiting requests are aborted, duplicate ids and invalid prompts are mixed in, and `generate`
is called while other requests are in flight. The KV pool is small enough that preemption happens
every few steps. After every step the pool, queues and block tables must be consistent; at the
end every block is free and every greedy or seeded request equals the same request run alone.

CI runs a short budget on every preset; `--soak-steps 400 --soak-seeds 5` runs a long one.
"""

from __future__ import annotations

import random
from collections import Counter

import attrs
import pytest

from tests.managers.helpers import walk_free_queue
from unified_attn import LLMEngine, SamplingParams
from unified_attn.models import PRESETS
from unified_attn.request import RequestStatus

MAX_MODEL_LEN = 128
ENGINE = dict(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32, max_num_seqs=6)


@attrs.define
class Submitted:
    prompt: list[int]
    params: SamplingParams
    aborted: bool = False


class Soak:
    def __init__(self, preset: str, seed: int) -> None:
        self.rng = random.Random(f"{preset}-{seed}")
        probe = LLMEngine(preset, **ENGINE)
        blocks = sum(probe.worker.blocks_per_request)
        # one worst-case request and a few spare blocks: requests must take turns
        memory = probe.worker.plan.bytes_per_block * (blocks + 4)
        self.engine = LLMEngine(preset, kv_cache_memory=memory, seed=seed, **ENGINE)
        self.preset, self.seed = preset, seed
        self.vocab = min(self.engine.vocab_size, 256)
        self.prefixes = [self.tokens(self.rng.randint(16, 70)) for _ in range(3)]
        self.stop_tokens = tuple(self.tokens(24))
        self.submitted: dict[str, Submitted] = {}
        self.outputs: dict[str, object] = {}

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    # ---- what a serving loop does between steps ---------------------------------------------

    def random_request(self) -> tuple[list[int], SamplingParams]:
        rng = self.rng
        prefix = rng.choice(self.prefixes) if rng.random() < 0.7 else []
        prompt = (prefix + self.tokens(rng.randint(1, 30)))[: MAX_MODEL_LEN - 8]
        seeded = rng.random() < 0.4
        params = SamplingParams(
            max_tokens=rng.randint(1, 24),
            temperature=0.9 if seeded else 0.0,
            top_k=rng.choice([0, 20]) if seeded else 0,
            seed=rng.randrange(1000) if seeded else None,
            stop_token_ids=self.stop_tokens if rng.random() < 0.3 else (),
            ignore_eos=rng.random() < 0.5,
        )
        return prompt, params

    def add(self) -> None:
        prompt, params = self.random_request()
        request_id = None
        if self.rng.random() < 0.2:  # a caller-chosen id, often one automatic ids would use next
            request_id = f"req-{len(self.submitted) + self.rng.randrange(4)}"
            if request_id in self.submitted:  # ids are kept unique to key the bookkeeping
                request_id = f"mine-{len(self.submitted)}"
        rid = self.engine.add_request(prompt, params, request_id=request_id)
        assert rid not in self.submitted, f"request id {rid} was handed out twice"
        self.submitted[rid] = Submitted(prompt, params)

    def add_invalid(self) -> None:
        live = list(self.engine.scheduler.requests)
        before = (len(self.engine.scheduler.waiting), len(live))
        cases = [
            ([], "is empty"),
            ([1, self.engine.vocab_size + 3], "outside the vocabulary"),
            ([1] * MAX_MODEL_LEN, "leaves no room"),
        ]
        if live:
            cases.append((([1, 2], self.rng.choice(live)), "already in use"))
        prompt, message = self.rng.choice(cases)
        request_id = None
        if isinstance(prompt, tuple):
            prompt, request_id = prompt
        with pytest.raises(ValueError, match=message):
            self.engine.add_request(prompt, SamplingParams(max_tokens=2), request_id=request_id)
        scheduler = self.engine.scheduler
        assert (len(scheduler.waiting), len(scheduler.requests)) == before

    def abort(self) -> None:
        live = list(self.engine.scheduler.requests)
        if live:
            rid = self.rng.choice(live)
            self.engine.abort_request(rid)
            self.submitted[rid].aborted = True

    def generate_one(self) -> None:
        prompt, params = self.random_request()
        (out,) = self.engine.generate([prompt], params)
        assert out.request_id not in self.submitted
        self.submitted[out.request_id] = Submitted(prompt, params)
        self.outputs[out.request_id] = out

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

    def step(self) -> None:
        for out in self.engine.step():
            assert out.request_id not in self.outputs, f"{out.request_id} delivered twice"
            assert not self.submitted[out.request_id].aborted, "an aborted request has an output"
            self.outputs[out.request_id] = out
        check_invariants(self.engine)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.between_steps()
            self.step()
        while self.engine.has_unfinished_requests():
            self.step()
        self.step()  # delivers outputs kept by a generate in the last round

    # ---- the end ---------------------------------------------------------------------------

    def check_end(self) -> None:
        engine = self.engine
        pool = engine.kv_cache_manager.block_pool
        assert engine.kv_cache_manager.usage == 0.0
        assert walk_free_queue(pool) and pool.get_num_free_blocks() == pool.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert not engine.runner.block_tables.rows and not engine.runner.sampler.generators
        expected = {rid for rid, s in self.submitted.items() if not s.aborted}
        assert set(self.outputs) == expected, "a request finished without an output"
        assert engine.scheduler.num_preemptions > 0, "the pool never forced a preemption"

    def check_against_alone(self) -> None:
        # the same weights (the seed draws them), a pool of the default size, no prefix cache
        alone = LLMEngine(self.preset, enable_prefix_caching=False, seed=self.seed, **ENGINE)
        for rid, out in self.outputs.items():
            submitted = self.submitted[rid]
            params = attrs.evolve(submitted.params, return_logits=True)
            (ref,) = alone.generate([submitted.prompt], params)
            if (out.output_token_ids, out.finish_reason) == (
                ref.output_token_ids,
                ref.finish_reason,
            ):
                continue
            # Batches change float rounding in the last bits: a greedy request may take the
            # other side of an exact tie. Accept that, and only that.
            assert submitted.params.greedy and is_tie(out, ref), (
                f"{self.preset}: {rid} ({submitted.params}) differs from the same request alone"
            )


TIE = 1e-5  # logits closer than this are a tie in float32


def is_tie(out, ref) -> bool:
    """The first differing token of `out` was within `TIE` of the reference's choice."""
    pairs = zip(out.output_token_ids, ref.output_token_ids, strict=False)
    j = next((j for j, (a, b) in enumerate(pairs) if a != b), None)
    if j is None:
        return False  # same tokens, another finish reason: not a tie
    logits = ref.logits[j]
    return bool(logits[ref.output_token_ids[j]] - logits[out.output_token_ids[j]] < TIE)


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
    for request in running:
        assert 0 < request.num_computed_tokens <= request.num_tokens
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


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_soak(preset, soak_steps, soak_seeds):
    for seed in range(soak_seeds):
        soak = Soak(preset, seed)
        soak.run(soak_steps)
        soak.check_end()
        soak.check_against_alone()
