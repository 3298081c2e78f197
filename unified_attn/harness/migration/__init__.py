"""Migration harness: a legacy backend (through `LegacyBackendAdapter`) against a native one.

Two `LLMEngine`s with the same weights (same preset and seed, or the same checkpoint) run the
same workload: shared prefixes (prefix hits), prompts longer than the token budget (chunked
prefill), staggered admission (mixed prefill/decode steps) and a KV cache one request wide
(forced preemption). Per generated-token index the logits (max abs difference) and the sampled
tokens are compared. The report adds lines of code per backend and host time per step.

Modules: `workload` (the workload and engine settings), `engine_run` (one engine through it),
`compare` (outputs per token index), `code_size` (lines of code), `timing` (host time per
decode step), `run` (`run_migration`), `report` (`print_report`) and `command`
(`unified-attn migrate`).
"""

from unified_attn.harness.migration.code_size import source_lines
from unified_attn.harness.migration.compare import compare_outputs
from unified_attn.harness.migration.migration_report import print_report
from unified_attn.harness.migration.migration_run import run_migration
from unified_attn.harness.migration.migration_workload import SMALL_WORKLOAD, Workload
from unified_attn.harness.migration.timing import decode_budget, decode_engine, time_prep_forward

__all__ = [
    "SMALL_WORKLOAD",
    "Workload",
    "compare_outputs",
    "decode_budget",
    "decode_engine",
    "print_report",
    "run_migration",
    "source_lines",
    "time_prep_forward",
]
