"""Manager conformance: the KV-cache managers a backend's `get_cache_config` returns, each driven
through a real engine under memory pressure.

For every distinct `(manager_cls, config)` the backend returns for the decoder layer kinds of
`LAYER_KINDS`, a tiny-llama whose layers all have that kind runs a workload on the reference
attention with the manager under test (preemption, prefix hits of several lengths, chunked
prefill, window recycling, aborts). While it runs:

- every block the manager frees is poisoned at once (NaN in every layer's page) and dropped
  from the prefix cache, and so is the null block: a later read of a block the manager gave
  back, or of one it left out of a hit, changes the output;
- after every step the pool must be consistent (reference counts equal the blocks requests
  hold, the free queue holds exactly the unreferenced blocks, the null block untouched) and no
  request may hold more blocks than the manager's `max_blocks_per_request()` (the admission cap
  memory sizing relies on);
- at the end nothing may be held, and the greedy tokens of every request that was not aborted
  must equal the same requests run with ample memory under the default manager of that layer
  kind (both engines batch-invariant, so batching and chunking change no bit).

A cell reports what the workload exercised: preemptions, prefix-hit blocks, blocks recycled
early, blocks poisoned.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import torch

from unified_attn.backend import AttentionBackend, AttentionType
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.engine.llm_engine import LLMEngine
from unified_attn.harness.conformance.checks import crash
from unified_attn.models.config import LayerKind
from unified_attn.models.presets import PRESETS
from unified_attn.sampling_params import RequestOutputKind, SamplingParams
from unified_attn.selector import SelectorConfig, backend_reasons

BASE = "tiny-llama"  # 4 query / 2 KV heads of 32, float32 on CPU
PRESET = "manager-conformance"  # the temporary preset a cell registers while it runs
# the decoder layer kinds whose managers are checked: (backend options, the model's layer kind)
LAYER_KINDS: dict[str, tuple[dict[str, Any], LayerKind]] = {
    "full attention": ({}, LayerKind.full()),
    "sliding window 32": ({"sliding_window": 32}, LayerKind.sliding(32)),
    "chunked local 32": ({"attention_chunk_size": 32}, LayerKind.chunked(32)),
    "sinks 4 + window 32": ({"sliding_window": 32, "num_sink_tokens": 4},
                            LayerKind.streaming(32, 4)),
}  # fmt: skip
MAX_BLOCKS = 26  # the pressured cache: about three requests' worth at full attention


@attrs.frozen
class Workload:
    """Requests sharing prefixes of several lengths (hits of 1 to 3 blocks, not all aligned),
    arriving over the first steps; some are aborted; outputs long enough to recycle windows."""

    prefixes: tuple[int, ...] = (20, 37, 53)
    num_requests: int = 12
    max_tokens: int = 40
    arrivals: tuple[int, ...] = (6, 2, 2, 2)  # requests added before steps 0, 1, 2, 3
    aborts: tuple[tuple[int, int], ...] = ((5, 3), (9, 7))  # (step, request index)

    def prompts(self) -> list[list[int]]:
        gen = torch.Generator().manual_seed(0)
        def tokens(n: int) -> list[int]:
            return torch.randint(3, 250, (n,), generator=gen).tolist()

        heads = [tokens(n) for n in self.prefixes]
        return [heads[i % len(heads)] + tokens(5 + 7 * (i % 4)) for i in range(self.num_requests)]


def manager_cells(backend_cls: type[AttentionBackend], device: str) -> list[dict[str, Any]]:
    """One row per distinct manager of the backend's decoder layer kinds (or per kind it does
    not serve, "unsupported" with its reasons)."""
    rows: list[dict[str, Any]] = []
    seen: set[tuple[type, Any]] = set()
    for kind, (options, layer_kind) in LAYER_KINDS.items():
        row: dict[str, Any] = {"cell": f"manager: {kind}", "type": "manager", "max_err": None,
                               "checks": {}}  # fmt: skip
        cfg = SelectorConfig(head_size=32, dtype=torch.float32, device=device,
                             attention_chunk_size=options.get("attention_chunk_size"),
                             sliding_window=options.get("sliding_window"),
                             num_sink_tokens=options.get("num_sink_tokens", 0))  # fmt: skip
        reasons = backend_reasons(backend_cls, cfg)
        if reasons:
            rows.append(row | {"status": "unsupported", "detail": "; ".join(reasons)})
            continue
        try:
            cache = backend_cls(num_kv_heads=2, head_size=32, dtype=torch.float32, **options)
            triple = cache.get_cache_config()
        except Exception as error:  # the backend's own constructor or policy crashed
            rows.append(row | {"status": "fail", "detail": crash(error)})
            continue
        if triple is None or (triple[0], triple[1]) in seen:
            continue
        seen.add((triple[0], triple[1]))
        rows.append(run_manager_cell(row, triple[0], triple[1], options, layer_kind))
    return rows


def run_manager_cell(
    row: dict[str, Any], manager_cls: type, config: Any, options: dict, layer_kind: LayerKind
) -> dict[str, Any]:
    row = row | {"manager": f"{manager_cls.__name__}({config})"}
    try:
        exercised, failures = check_manager(manager_cls, config, layer_kind, Workload())
    except Exception as error:  # a crash fails the cell, not the run
        return row | {"status": "fail", "detail": crash(error),
                      "trace": "".join(traceback.format_exception(error))}  # fmt: skip
    detail = "; ".join(failures) or ", ".join(f"{v} {k}" for k, v in exercised.items())
    return row | {"status": "fail" if failures else "pass", "detail": detail,
                  "exercised": exercised}  # fmt: skip


def check_manager(
    manager_cls: type, config: Any, layer_kind: LayerKind, workload: Workload
) -> tuple[dict[str, int], list[str]]:
    """Run the workload under the manager and against the default manager with ample memory;
    returns what was exercised and the failures, each naming the manager."""
    name = manager_cls.__name__
    with temporary_preset(layer_kind):
        want, ample = expected_tokens(workload)
        cap = ample.kv_cache_manager.max_blocks_per_request()[0]
        # fewer blocks than the six running requests' default caps: someone gets preempted
        memory = min(MAX_BLOCKS, 2 * cap) * ample.worker.plan.bytes_per_block + 1
        engine = pressured_engine(manager_cls, config, memory)
        poisoned = poison_freed_blocks(engine)
        outputs, failures = drive(engine, workload, name)
    for index, tokens in outputs.items():
        if tokens != want[index]:
            first = first_difference(tokens, want[index])
            failures.append(
                f"{name}: request r{index} generated other tokens than with ample memory from "
                f"token {first} on: it read a block the manager freed, left out of a hit or "
                "never kept"
            )
            break
    stats = engine.kv_cache_manager.group_stats()[0]
    exercised = {
        "preemptions": engine.scheduler.num_preemptions,
        "hit blocks": int(stats["hit_blocks"]),  # type: ignore[call-overload]
        "blocks recycled": int(stats["blocks_freed_early"]),  # type: ignore[call-overload]
        "blocks poisoned": poisoned["count"],
    }
    return exercised, failures


def first_difference(a: list[int], b: list[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


@contextmanager
def temporary_preset(layer_kind: LayerKind) -> Iterator[None]:
    """tiny-llama with every layer of `layer_kind`, as the preset `PRESET` while it runs."""
    PRESETS[PRESET] = attrs.evolve(PRESETS[BASE], name=PRESET, layer_kinds=(layer_kind,) * 4)
    try:
        yield
    finally:
        del PRESETS[PRESET]


def engine_options(memory: int | str) -> dict[str, Any]:
    """Float32 on CPU, batch-invariant (batching and chunking change no bit), chunked prefill,
    a cache of `memory`."""
    return dict(max_model_len=256, max_num_seqs=6, max_num_batched_tokens=48,
                batch_invariant=True, kv_cache_memory=memory)  # fmt: skip


def expected_tokens(workload: Workload) -> tuple[list[list[int]], LLMEngine]:
    """The workload's greedy tokens with ample memory under the layer kind's default manager,
    and that engine (its block size and admission cap size the pressured cache)."""
    engine = LLMEngine(PRESET, backend=ReferenceAttentionBackend, **engine_options("64MiB"))
    params = SamplingParams(max_tokens=workload.max_tokens, ignore_eos=True)
    outputs = engine.generate(workload.prompts(), params)
    return [o.output_token_ids for o in outputs], engine


def pressured_engine(manager_cls: type, config: Any, memory: int) -> LLMEngine:
    class ManagerUnderTest(ReferenceAttentionBackend):
        name = "manager-under-test"

        def get_cache_config(self) -> Any:
            cache = super().get_cache_config()
            if cache is None or self.attn_type != AttentionType.DECODER:
                return cache
            return manager_cls, config, cache[2]  # the reference's paged K/V pages

    return LLMEngine(PRESET, backend=ManagerUnderTest, **engine_options(memory))


def poison_freed_blocks(engine: LLMEngine) -> dict[str, int]:
    """From now on every block whose last reference goes is NaN in every layer and leaves the
    prefix cache at once; the null block is NaN too. Returns the running count."""
    pool, worker = engine.kv_cache_manager.block_pool, engine.worker
    pages = list(engine.kv_cache_layout().values())
    assert worker.kv_buffer is not None
    buffer = worker.kv_buffer
    count = {"count": 0}

    def poison(block_id: int) -> None:
        for layout in pages:
            buffer[layout.block_bytes(block_id)].view(torch.float32).fill_(float("nan"))

    free = pool.free_blocks

    def free_and_poison(blocks: Any) -> None:
        blocks = list(blocks)
        free(blocks)
        for block in blocks:
            if not block.is_null and block.ref_cnt == 0:
                pool.evict_blocks([block.block_id])
                poison(block.block_id)
                count["count"] += 1

    pool.free_blocks = free_and_poison  # type: ignore[method-assign, assignment]
    poison(0)
    return count


def drive(
    engine: LLMEngine, workload: Workload, name: str
) -> tuple[dict[int, list[int]], list[str]]:
    """The workload, step by step, with the pool checked after each step; returns the tokens of
    the requests that were not aborted (by index) and the failures."""
    prompts, arrivals = workload.prompts(), list(workload.arrivals)
    params = SamplingParams(max_tokens=workload.max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    ids: list[str] = []
    aborts = dict(workload.aborts)
    outputs: dict[str, list[int]] = {}
    step = 0
    while len(ids) < len(prompts) or engine.has_unfinished_requests():
        for _ in range(arrivals.pop(0) if arrivals else len(prompts) - len(ids)):
            ids.append(engine.add_request(f"r{len(ids)}", prompts[len(ids)], params))
        if step in aborts and aborts[step] < len(ids):
            engine.abort_request(ids[aborts[step]])
        for out in engine.step():
            outputs[out.request_id] = out.output_token_ids
        failures = pool_failures(engine, name)
        if failures:
            return {}, failures
        step += 1
    aborted = {ids[i] for s, i in workload.aborts}
    failures = leak_failures(engine, name)
    kept = {i: outputs[rid] for i, rid in enumerate(ids) if rid not in aborted}
    return kept, failures


def pool_failures(engine: LLMEngine, name: str) -> list[str]:
    """The pool's invariants and the admission cap, after a step."""
    kv, scheduler = engine.kv_cache_manager, engine.scheduler
    pool, cap = kv.block_pool, kv.max_blocks_per_request()[0]
    owners: Counter[int] = Counter()
    for request in scheduler.running:
        held = [b.block_id for b in kv.get_blocks(request).blocks[0] if not b.is_null]
        if len(held) > cap:
            return [f"{name}: request {request.request_id} holds {len(held)} blocks, more than "
                    f"its max_blocks_per_request() = {cap} (the admission cap and memory sizing "
                    "rely on it)"]  # fmt: skip
        if len(set(held)) != len(held):
            return [f"{name}: request {request.request_id} holds a block twice: {held}"]
        owners.update(held)
    for request in scheduler.waiting:
        if any(kv.get_block_ids(request)):
            return [f"{name}: waiting request {request.request_id} still holds blocks"]
    wrong = [b.block_id for b in pool.blocks[1:] if b.ref_cnt != owners[b.block_id]]
    if wrong:
        return [f"{name}: blocks {wrong[:5]} have reference counts that differ from the requests "
                "holding them"]  # fmt: skip
    free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    if free != {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}:
        return [f"{name}: the free queue is not the set of unreferenced blocks"]
    null = pool.null_block
    if null.ref_cnt != 0 or null.block_hash is not None:
        return [f"{name}: the null block was referenced or cached"]
    return []


def leak_failures(engine: LLMEngine, name: str) -> list[str]:
    pool = engine.kv_cache_manager.block_pool
    held = pool.num_blocks - 1 - pool.get_num_free_blocks()
    if held:
        return [f"{name}: {held} blocks are still held after every request ended"]
    return []
