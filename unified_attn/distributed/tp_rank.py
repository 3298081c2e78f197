"""Building one tensor-parallel rank: what it holds and how the ranks agree on its cache.

`check_options` refuses, before any process starts, what `tensor_parallel_size` cannot serve.
Every rank then builds the same pieces from the engine's config: its model shard
(`rank_model`: the full model loaded in host memory, cut by `models/tensor_parallel.py`, or
`models/tensor_parallel_deepseek.py` for DeepSeek, `tensor_parallel_hybrid.py` for the
state-space hybrids, onto the rank's device, its
row-parallel layers summing over the process group), its `Worker`
(`make_worker`, with the rank's own KV budget, `rank_memory`) and its `ModelRunner`
(`make_rank_runner`). Each rank sizes its own cache; `agree_on_blocks` makes all use the
minimum. Rank 0 builds these for the engine itself, the other ranks in their serve loop.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist

from unified_attn.distributed.tp_process_group import rank_device, startup_timeout_s, timeout_s
from unified_attn.models.families import family_of
from unified_attn.runner.memory import parse_memory
from unified_attn.runner.model_runner import ModelRunner
from unified_attn.runner.model_source import (
    ModelSource,
    backend_options,
    default_dtype,
    load_model,
    model_config,
    selector_configs,
)
from unified_attn.runner.worker import Worker
from unified_attn.selector import select_backend
from unified_attn.spec_decode.proposers import check_speculative_options
from unified_attn.tensor_specs import as_dtype


def check_options(config: Any) -> None:
    """Refuse, before any process starts, what `tensor_parallel_size` cannot serve."""
    n = config.tensor_parallel_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {n!r}")
    if n == 1:
        return
    timeout_s()  # a bad UNIFIED_ATTN_TP_(STARTUP_)TIMEOUT_S is refused before any process starts
    startup_timeout_s()
    model = model_config(config.model)
    family_of(model).check_tensor_parallel(model, n, config.model)
    # Speculative settings, and that a draft model exists (rank 0 loads it whole).
    check_speculative_options(
        config.speculative_method, config.num_speculative_tokens, config.draft_model,
        model_kind="decoder", state_groups=[],
    )  # fmt: skip
    if config.draft_model is not None:
        model_config(config.draft_model)
    device = torch.device(config.device)
    if device.type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(
            f"tensor_parallel_size={n} needs {n} CUDA devices, this machine has "
            f"{torch.cuda.device_count()}; lower tensor_parallel_size"
        )
    memory = config.kv_cache_memory
    if isinstance(memory, (list, tuple)) and len(memory) != n:
        raise ValueError(
            f"kv_cache_memory has {len(memory)} entries for tensor_parallel_size={n}; give one "
            "budget, or one per rank"
        )


def rank_memory(config: Any, rank: int) -> int | None:
    """This rank's KV budget: `kv_cache_memory`, or its entry `rank` when it is a list."""
    memory = config.kv_cache_memory
    if isinstance(memory, (list, tuple)):
        memory = memory[rank]
    return None if memory is None else parse_memory(memory)


# ---- the model shard ---------------------------------------------------------------------------


def rank_model(config: Any, rank: int, world_size: int) -> ModelSource:
    """Rank `rank`'s model: the full model loaded in host memory (so a model larger than one
    device can be split), cut to its shard on the rank's device."""
    device = rank_device(config, rank)
    on_device = attrs.evolve(config, device=str(device))
    if world_size == 1:
        return load_model(on_device)
    dtype = as_dtype(config.dtype) if config.dtype else default_dtype(device)
    source = load_model(
        attrs.evolve(on_device, device="cpu", dtype=str(dtype).removeprefix("torch."))
    )
    model_cfg = model_config(config.model)
    backend_cls = select_backend(
        selector_configs(model_cfg, dtype, on_device), override=config.backend
    )
    options = backend_options(config, config.batch_invariant, model_cfg)
    model = family_of(model_cfg).shard(
        source.model,
        rank,
        world_size,
        _all_reduce,
        _all_gather,
        backend_cls,
        device=device,
        backend_options=options,
    )
    return attrs.evolve(source, model=model, backend_cls=backend_cls)


def _all_reduce(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)


def _all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """`[..., n]` on every rank -> `[..., world_size * n]`, the ranks' parts in rank order."""
    world = dist.get_world_size()
    parts = torch.empty((world, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    if dist.get_backend() == "nccl":
        dist.all_gather_into_tensor(parts, tensor.contiguous())
    else:
        dist.all_gather(list(parts.unbind(0)), tensor.contiguous())
    return torch.cat(parts.unbind(0), dim=-1)


# ---- the worker, its cache and the runner ------------------------------------------------------


def make_worker(config: Any, source: ModelSource, rank: int) -> Worker:
    return Worker(
        source.model,
        device=rank_device(config, rank),
        max_model_len=source.max_model_len,
        max_in_flight_tokens=min(config.max_num_batched_tokens, source.max_model_len),
        block_size=config.block_size,
        kv_cache_memory=rank_memory(config, rank),
        gpu_memory_utilization=config.gpu_memory_utilization,
    )


def agree_on_blocks(worker: Worker, control: Any) -> tuple[int, list[int]]:
    """Every rank sizes its own cache; all use the minimum (one all-reduce on the `control`
    group). Returns it and every rank's own figure."""
    own = worker.determine_num_blocks()
    counts = torch.zeros(dist.get_world_size(), dtype=torch.int64)
    counts[dist.get_rank()] = own
    dist.all_reduce(counts, group=control)
    per_rank = [int(c) for c in counts.tolist()]
    return min(per_rank), per_rank


def make_rank_runner(
    config: Any, source: ModelSource, worker: Worker, graph_query_lens: tuple[int, ...] = (1,)
) -> ModelRunner:
    """A rank's model runner (rank 0's is the engine's), with `config`'s settings."""
    return ModelRunner(
        source.model,
        worker.plan,
        device=worker.device,
        max_num_seqs=config.max_num_seqs,
        max_model_len=source.max_model_len,
        seed=config.seed,
        cuda_graphs=config.cuda_graphs,
        eos_token_ids=source.eos_token_ids,
        graph_query_lens=graph_query_lens,
    )
