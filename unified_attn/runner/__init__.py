"""Running a model step over the contract, below the engine.

- KV planning and allocation: `worker` (grouping by `(manager_cls, config)`, sizing, page
  balance in `page_balance`, allocation, binding), `kv_layout` and `kv_access` (where a
  request's tokens sit in the bound caches), `memory` (sizes such as "64MiB").
- Scheduling: `scheduler` (`Scheduler`, the typed `SchedulerOutput` of a step).
- Execution: `model_runner` (`ModelRunner`: block tables, the flat `prep_forward` loop, the
  forward, sampling), `step_inputs` (the typed `StepInputs`), `cuda_graphs`, `sampler`.
- Loading and naming: `model_source` (a preset or checkpoint to a model and its backend),
  `catalog` (what `unified-attn backends` and `models` list), `device`.
"""
