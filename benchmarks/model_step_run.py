"""One configuration of `model_step.py` (a model at one tensor-parallel size), measured in a
process of its own: the ceilings, one engine, its decode steps at every batch and its prefill
steps at every length.

Decode at batch B: B requests of `prompt_len` random tokens (EOS ignored) are added and stepped
until every one has its first token, then `warmup` steps, then `steps` timed steps. The wall
step is the time of the timed `engine.step()` calls (the device drained after them) over the
steps, with the engine's async scheduling (overlapped steps, on for CUDA) and again with plain
steps (`decode_plain_steps`); the device step is the decode graph of B replayed alone
(`model_step_device.device_step_ms`) right after, on the last step's inputs. Prefill at T
tokens: one request of T random tokens, one step (CUDA events around `engine.step()`), after
one untimed step of the same length (Triton compiles and tunes for the shape).
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter
from typing import Any

import attrs
import torch
from model_step_device import device_step_ms, probe, step_ms
from model_step_shapes import (
    AttentionShape,
    RankWeights,
    attention_shape,
    bound,
    decode_cost,
    prefill_flops,
    rank_weights,
    roofline_s,
    shape_summary,
)

from unified_attn import LLMEngine, SamplingParams
from unified_attn.models.presets import get_preset
from unified_attn.sampling_params import RequestOutputKind

MAX_SETUP_STEPS = 1000  # steps to get every request its first token, at most
# tokens a request may decode while later prompts of its batch prefill (B * prompt_len /
# max_num_batched_tokens steps: 4 for 256 prompts of 128 tokens in 8192-token steps)
SETUP_ROOM = 64


def _ints(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@attrs.frozen(kw_only=True)
class Settings:
    """What every configuration of one run measures (the job a parent hands its children)."""

    device: str
    batches: tuple[int, ...] = attrs.field(converter=_ints)
    prompt_len: int
    warmup: int
    steps: int
    replays: int
    prefill: tuple[int, ...] = attrs.field(converter=_ints)
    prefill_reps: int
    gpu_memory_utilization: float
    kv_cache_memory: str | None
    repetition_penalty: float = 1.0  # != 1: decode requests whose sampling reads their outputs

    @property
    def max_model_len(self) -> int:
        """Room for the longest prefill, and for the decode requests' prompts and tokens."""
        decode = self.prompt_len + self.warmup + self.steps + SETUP_ROOM
        return max(max(self.prefill, default=0) + 16, decode)

    @property
    def max_num_batched_tokens(self) -> int:
        return max(max(self.prefill, default=0), self.prompt_len)


@attrs.frozen
class Ceilings:
    copy_bytes_per_s: float
    matmul_flops_per_s: float


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct random prompts: none shares a block with another (no prefix-cache hits)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(count)]


def build_engine(settings: Settings, model: str, tp: int) -> LLMEngine:
    return LLMEngine(
        model, device=settings.device, tensor_parallel_size=tp,
        max_num_seqs=max(settings.batches), max_model_len=settings.max_model_len,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        kv_cache_memory=settings.kv_cache_memory,
        gpu_memory_utilization=settings.gpu_memory_utilization,
    )  # fmt: skip


def drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


class DecodeBatch:
    """B running requests and the tokens each has generated (from `DELTA` outputs)."""

    def __init__(self, engine: LLMEngine, settings: Settings, batch: int) -> None:
        self.engine, self.prompt_len = engine, settings.prompt_len
        params = SamplingParams(max_tokens=engine.max_model_len - settings.prompt_len,
                                ignore_eos=True, output_kind=RequestOutputKind.DELTA,
                                repetition_penalty=settings.repetition_penalty)  # fmt: skip
        prompts = random_prompts(batch, settings.prompt_len, engine.vocab_size, seed=batch)
        self.ids = [engine.add_request(prompt=p, params=params) for p in prompts]
        self.generated: Counter[str] = Counter()

    def step(self) -> None:
        for out in self.engine.step():
            self.generated[out.request_id] += len(out.outputs[0].token_ids)

    def start(self) -> None:
        """Step until every request has its first token (its prompt is prefilled)."""
        for _ in range(MAX_SETUP_STEPS):
            if all(self.generated[i] for i in self.ids):
                return
            self.step()
        raise RuntimeError(f"decode batch of {len(self.ids)}: prompts still prefilling")

    def mean_context(self) -> float:
        """Mean sequence length the next step attends over (cached tokens and the new one)."""
        return self.prompt_len + statistics.fmean(self.generated[i] for i in self.ids)

    def stop(self) -> None:
        self.engine.abort_request(self.ids)
        drain(self.engine)


def decode_case(
    engine: LLMEngine, settings: Settings, batch: int, overlap: bool | None = None
) -> dict[str, Any]:
    """One decode batch: the wall step is the time of `settings.steps` back-to-back
    `engine.step()` calls, the device drained after the last (with overlapped steps the last
    call launched one more step, so this over-counts by at most that step's remainder), over
    the steps; `engine_step_ms` is the engine's own per-step figure (`engine.stats`). `overlap`
    sets the engine's async scheduling for the case (None: the engine's setting)."""
    loop = engine._loop  # the engine's step loop: finish its step in flight, then switch
    loop.finish_pending()
    default = loop.enabled
    if overlap is not None:
        loop.enabled = overlap
    requests = DecodeBatch(engine, settings, batch)
    try:
        requests.start()
        for _ in range(settings.warmup):
            requests.step()
        context = requests.mean_context() + (settings.steps - 1) / 2
        stats = engine.stats
        before = (stats.steps, stats.step_time_s, stats.decode_tokens, stats.prefill_tokens)
        start = time.perf_counter()
        for _ in range(settings.steps):
            requests.step()
        synchronize(engine)
        wall_s = time.perf_counter() - start
        steps, engine_s = stats.steps - before[0], stats.step_time_s - before[1]
        pure = (stats.decode_tokens - before[2], stats.prefill_tokens - before[3]) == (
            batch * steps, 0)  # fmt: skip
        device_ms = device_step_ms(engine, batch, settings.replays)
    finally:
        requests.stop()
        loop.finish_pending()
        loop.enabled = default
    return {"batch": batch, "steps": steps, "pure_decode": pure, "mean_context": context,
            "overlap": loop.enabled if overlap is None else overlap,
            "wall_step_ms": 1e3 * wall_s / steps, "engine_step_ms": 1e3 * engine_s / steps,
            "device_step_ms": device_ms}  # fmt: skip


def synchronize(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def prefill_case(engine: LLMEngine, settings: Settings, tokens: int) -> dict[str, Any]:
    device = torch.device(settings.device)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    times, scheduled = [], []
    for rep in range(settings.prefill_reps + 1):  # the first: untimed (compiles, tunes)
        prompt = random_prompts(1, tokens, engine.vocab_size, seed=tokens + rep)[0]
        engine.add_request(prompt=prompt, params=params)
        before = engine.stats.prefill_tokens
        ms = step_ms(engine.step, device)
        scheduled.append(engine.stats.prefill_tokens - before)
        drain(engine)
        if rep:
            times.append(ms)
    return {"tokens": tokens, "tokens_in_step": min(scheduled), "reps": len(times),
            "step_ms": statistics.median(times)}  # fmt: skip


def add_decode_roofline(
    row: dict[str, Any], w: RankWeights, attn: AttentionShape, c: Ceilings
) -> None:
    """Tokens/s, the roofline and the fractions of it the wall and device steps reach."""
    cost = decode_cost(w, attn, row["batch"], row["mean_context"])
    limit_ms = 1e3 * roofline_s(cost, c.copy_bytes_per_s, c.matmul_flops_per_s)
    wall, device = row["wall_step_ms"], row["device_step_ms"]
    row.update({
        "tokens_per_s": row["batch"] / (wall * 1e-3),
        "bytes_per_step": cost.bytes, "flops_per_step": cost.flops, "roofline_ms": limit_ms,
        "roofline_bound": bound(cost, c.copy_bytes_per_s, c.matmul_flops_per_s),
        "roofline_fraction": limit_ms / wall,
        "device_roofline_fraction": None if device is None else limit_ms / device,
        "host_overhead_ms": None if device is None else wall - device,
    })  # fmt: skip


def add_prefill_rate(
    row: dict[str, Any], w: RankWeights, attn: AttentionShape, c: Ceilings
) -> None:
    flops = prefill_flops(w, attn, row["tokens"])
    seconds = row["step_ms"] * 1e-3
    row.update({"tokens_per_s": row["tokens"] / seconds, "flops_per_step": flops,
                "tflops": flops / seconds / 1e12,
                "matmul_fraction": flops / seconds / c.matmul_flops_per_s})  # fmt: skip


def measure(settings: Settings, model: str, tp: int) -> dict[str, Any]:
    """Every figure of one configuration (rank 0's view; per-rank quantities are its own)."""
    device = torch.device(settings.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the engine's default
    ceilings = Ceilings(**probe(device, dtype))
    start = time.perf_counter()
    engine = build_engine(settings, model, tp)
    build_s = time.perf_counter() - start
    try:
        config = get_preset(model)
        weights = rank_weights(engine.model, config)
        attn = attention_shape(engine.kv_cache_report, config, tp)
        decode = [decode_case(engine, settings, b) for b in settings.batches]
        # the same batches with plain steps (host work not overlapped), for comparison
        plain = [decode_case(engine, settings, b, overlap=False) for b in settings.batches]
        prefill = [prefill_case(engine, settings, t) for t in settings.prefill]
        graphs = engine.runner.graphs is not None
    finally:
        engine.shutdown()
    for row in decode + plain:
        add_decode_roofline(row, weights, attn, ceilings)
    for row in prefill:
        add_prefill_rate(row, weights, attn, ceilings)
    return {
        "model": model, "tp": tp, "settings": attrs.asdict(settings), "dtype": str(dtype),
        "cuda_graphs": graphs, "shape": shape_summary(config), "build_s": build_s,
        "ceilings": attrs.asdict(ceilings),
        "rank_weights": {**attrs.asdict(weights), "bytes": weights.bytes},
        "attention": attrs.asdict(attn), "decode": decode, "decode_plain_steps": plain,
        "prefill": prefill,
    }  # fmt: skip
