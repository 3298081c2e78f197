"""`EngineConfig`: every option of `LLMEngine`, checked by name before anything is built, and
`EngineStats`, the counters an engine keeps."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from unified_attn.managers.eviction import EVICTION_POLICIES
from unified_attn.managers.state import STATE_CACHE_MODES
from unified_attn.tensor_specs.paged import kv_cache_dtype_name

if TYPE_CHECKING:
    from unified_attn.runner.scheduler import SchedulerOutput
    from unified_attn.runner.step_inputs import StepResult


@attrs.frozen
class EngineConfig:
    """Everything `LLMEngine(model, **kwargs)` accepts (see docs/architecture.md)."""

    model: str = "tiny-llama"
    device: str = "cpu"
    backend: str | type | None = None  # a name, `module:Class`, or a backend class
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    block_size: int | None = None
    # None: on CUDA `gpu_memory_utilization` of the memory free once the model is loaded, on
    # CPU 64 MiB (`runner.worker.CPU_KV_CACHE_MEMORY`); with tensor parallelism, one budget
    # per rank (or one list entry per rank)
    kv_cache_memory: int | str | list[int | str] | None = None
    gpu_memory_utilization: float = attrs.field(default=0.9)
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    # which cached block a new block evicts: "lru" (vLLM's order) or "window_aware" (blocks no
    # prefix hit can use first; docs/kv-cache.md)
    kv_cache_eviction: str = attrs.field(default="lru")
    # state layers (Mamba, linear attention): "align" (vLLM's with prefix caching) checkpoints
    # a state when a step ends on a block boundary, "all" at every boundary a step crosses,
    # "none" keeps one state per request (and a slot per draft token) and caches none; None:
    # "none" with speculative decoding, else "align" (docs/hybrid-models.md)
    mamba_cache_mode: str | None = attrs.field(default=None)
    batch_invariant: bool = False
    # "auto": the model dtype; "fp8" (or "fp8_e4m3"): float8 e4m3 with per-layer scales, half
    # the bytes of bfloat16 (docs/kv-cache.md, "fp8 KV cache")
    kv_cache_dtype: str = attrs.field(default="auto")
    seed: int = 0
    cuda_graphs: bool = True  # decode steps on CUDA, when every backend supports them
    # schedule and prepare each step while the device runs the previous one (vLLM's async
    # scheduling; engine/step_loop.py says when steps may overlap); None: on for one CUDA
    # device, off with tensor parallelism until its GPU test has run (True turns it on)
    async_scheduling: bool | None = attrs.field(default=None)
    # ranks of tensor parallelism: one process each (docs/distributed.md)
    tensor_parallel_size: int = attrs.field(default=1)
    # Speculative decoding: "ngram" (prompt lookup) proposes up to `num_speculative_tokens`
    # drafts per decoding request from n-grams of `prompt_lookup_min..prompt_lookup_max` tokens;
    # "draft" takes them from `draft_model` (a preset or checkpoint sharing the tokenizer).
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    draft_model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # freeze the objects alive once the engine is built, so the serving loop's oldest-generation
    # garbage collections skip them (vLLM's EngineCore does); `shutdown()` unfreezes them.
    # An engine dropped without `shutdown()` may then keep its memory until another shuts down:
    # False for programs that build many engines (`UNIFIED_ATTN_FREEZE_GC=0` too; runner/gc_heap)
    freeze_gc: bool = attrs.field(default=True)

    @tensor_parallel_size.validator
    def _check_tp(self, _attribute: Any, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"tensor_parallel_size must be a positive int, got {value!r}; 1 runs on one device"
            )

    @freeze_gc.validator
    def _check_freeze_gc(self, _attribute: Any, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"freeze_gc must be True or False, got {value!r}")

    @async_scheduling.validator
    def _check_async(self, _attribute: Any, value: bool | None) -> None:
        if value is not None and not isinstance(value, bool):
            raise ValueError(
                f"async_scheduling must be True, False or None (on for one CUDA device), got "
                f"{value!r}"
            )

    @gpu_memory_utilization.validator
    def _check_utilization(self, _attribute: Any, value: float) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1
        if not ok:
            raise ValueError(
                f"gpu_memory_utilization must be a fraction in (0, 1], got {value!r}; vLLM's "
                "default is 0.9"
            )

    @kv_cache_dtype.validator
    def _check_kv_cache_dtype(self, _attribute: Any, value: str) -> None:
        kv_cache_dtype_name(value)  # a ValueError naming the choices

    @mamba_cache_mode.validator
    def _check_mamba_mode(self, _attribute: Any, value: str | None) -> None:
        if value is not None and value not in STATE_CACHE_MODES:
            raise ValueError(
                f"mamba_cache_mode={value!r} is not a mode; pick one of "
                f"{', '.join(STATE_CACHE_MODES)} ('align' is vLLM's with prefix caching)"
            )

    @kv_cache_eviction.validator
    def _check_eviction(self, _attribute: Any, value: str) -> None:
        if value not in EVICTION_POLICIES:
            raise ValueError(
                f"kv_cache_eviction={value!r} is not a policy; pick one of "
                f"{', '.join(EVICTION_POLICIES)} ('lru' is vLLM's order)"
            )


# vLLM options people pass out of habit, with what to do here instead.
_VLLM_OPTION_HINTS = {
    "pipeline_parallel_size": "use tensor_parallel_size to spread a model over devices",
    "enforce_eager": "pass cuda_graphs=False to run decode steps eagerly",
    "trust_remote_code": "checkpoints load without remote code",
    "tokenizer": "the tokenizer comes with the model (preset or checkpoint directory)",
}


def check_engine_options(kwargs: Mapping[str, Any]) -> None:
    """Refuse options `EngineConfig` does not have, naming them and listing the ones it has."""
    known = sorted(f.name for f in attrs.fields(EngineConfig) if f.name != "model")
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        name = unknown[0]
        hint = f" ({_VLLM_OPTION_HINTS[name]})" if name in _VLLM_OPTION_HINTS else ""
        raise ValueError(
            f"LLMEngine: unknown option {name!r}{hint}; the options are {', '.join(known)}"
        )


@attrs.define
class EngineStats:
    """Counters over the engine's life: steps, tokens, time in `step`."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    step_time_s: float = 0.0
    # speculative decoding: request-steps that verified drafts, drafts, accepted drafts
    spec_verifications: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        """Accepted drafts per verifying request-step (each also adds one token of its own)."""
        return self.spec_accepted / self.spec_verifications if self.spec_verifications else 0.0

    @property
    def mean_step_ms(self) -> float:
        return 1e3 * self.step_time_s / self.steps if self.steps else 0.0

    def record_step(
        self,
        output: SchedulerOutput,
        result: StepResult,
        appended: dict[str, int],
        elapsed_s: float,
    ) -> None:
        """Count one step: its prefill and decode tokens, generated tokens and drafts."""
        self.steps += 1
        self.step_time_s += elapsed_s
        for entry in output.scheduled:
            if entry.num_computed_before + entry.num_new_tokens > entry.request.num_prompt_tokens:
                self.decode_tokens += entry.num_new_tokens
            else:
                self.prefill_tokens += entry.num_new_tokens
        self.generated_tokens += sum(appended.values())
        for rid, num_drafts in result.num_drafts.items():
            self.spec_verifications += 1
            self.spec_drafted += num_drafts
            self.spec_accepted += len(result.sampled[rid]) - 1


BATCH_INVARIANT_ENV = "UNIFIED_ATTN_BATCH_INVARIANT"
FREEZE_GC_ENV = "UNIFIED_ATTN_FREEZE_GC"
ENV_TRUE, ENV_FALSE = ("1", "true", "yes"), ("0", "false", "no")


def with_environment(config: EngineConfig, environ: Mapping[str, str] = os.environ) -> EngineConfig:
    """The one place the package reads the environment for a mode: `UNIFIED_ATTN_BATCH_INVARIANT`
    set to 1 / true / yes turns batch-invariant mode on, and `UNIFIED_ATTN_FREEZE_GC` set to 0 /
    false / no turns `freeze_gc` off (unset, or the other answer: as configured; anything else is
    refused). The engine resolves its config with it once; everything below takes the values."""
    if _switch(environ, BATCH_INVARIANT_ENV) is True and not config.batch_invariant:
        config = attrs.evolve(config, batch_invariant=True)
    if _switch(environ, FREEZE_GC_ENV) is False and config.freeze_gc:
        config = attrs.evolve(config, freeze_gc=False)
    return config


def _switch(environ: Mapping[str, str], name: str) -> bool | None:
    """`name` as a switch: True, False, or None when unset; any other value is refused."""
    value = environ.get(name, "").strip().lower()
    if value not in ("", *ENV_TRUE, *ENV_FALSE):
        raise ValueError(
            f"{name}={environ[name]!r} is not a switch; set it to 1, true or yes (on) or 0, "
            "false or no (off), or unset it"
        )
    return None if not value else value in ENV_TRUE


def check_batch_invariant_options(config: EngineConfig) -> None:
    """Refuse the engine options batch-invariant mode cannot honour, before anything starts."""
    if config.tensor_parallel_size > 1:
        raise ValueError(
            f"batch-invariant mode cannot run with tensor_parallel_size="
            f"{config.tensor_parallel_size}: row-parallel layers sum the ranks' partial results "
            "with an all-reduce whose algorithm (and so its order of additions) NCCL picks by "
            "message size, i.e. by the batch; use tensor_parallel_size=1 or turn the mode off"
        )
