"""Conformance of recurrent-state backends: one grid of scenarios (`SCENARIOS`), run for each
state kind a backend's `layer_kinds` names (`state_grid`: gated linear attention
`linear_state`, Mamba-2 `mamba2`, the gated delta-net `gated_delta`; `state_kinds.py`).

A state cell runs several steps of a batch through the contract (prefill in one step, chunked
prefill whose chunks end inside the scan's chunks, decode, mixed batches; prefix hits that
resume from checkpoints in modes "align" and "all"; drafts verified, some rejected, in mode
"none"; preemption and re-prefill): `get_cache_config` must name `StateManager` in the cell's
mode with a `StateSpec`; the state blocks are strided views over garbage; each step's state
tables hold random block ids where the manager's mode puts them (`state_steps.py`). The oracle
runs the kind's recurrence token by token (`state_oracle.py`); every step's outputs and every
state the step must leave (each part of it: e.g. the convolution's carried inputs and the SSM
state) are compared with it (`state_run.py`).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import torch

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.harness.conformance.cells import LAYER
from unified_attn.harness.conformance.state_kinds import STATE_KINDS, StateKind, state_kind
from unified_attn.harness.conformance.state_steps import PlannedStep, Resume, Verify, plan_steps
from unified_attn.selector import SelectorConfig


@attrs.frozen
class StateCell:
    name: str
    # new tokens of each request in each step (0: the request is not in that step)
    steps: tuple[tuple[int, ...], ...]
    num_heads: int = 2
    head_size: int = 16
    block_size: int = 4
    mode: Literal["none", "align", "all"] = "align"
    kind: str = "linear_state"  # the layer kind (`state_kinds.STATE_KINDS`)
    resumes: tuple[Resume, ...] = ()  # prefix hits and re-prefills after preemption
    verifies: tuple[Verify, ...] = ()  # steps verifying drafts (mode "none")

    def __attrs_post_init__(self) -> None:
        state_kind(self.kind)
        if not self.steps or len({len(s) for s in self.steps}) != 1:
            raise ValueError(f"cell {self.name!r}: steps need one entry per request each")
        self._check_events()
        self.plan()  # an impossible schedule (a checkpoint nobody left) fails here

    def _check_events(self) -> None:
        """Resumes and verifies name requests their steps schedule; drafts in mode none."""
        if self.verifies and self.mode != "none":
            raise ValueError(f"cell {self.name!r}: drafts are verified in mode none only")
        num_steps, num_requests = len(self.steps), len(self.steps[0])
        events: list[Resume | Verify] = [*self.resumes, *self.verifies]
        for event in events:
            scheduled = 0 <= event.step < num_steps and 0 <= event.request < num_requests
            if not scheduled or not self.steps[event.step][event.request]:
                raise ValueError(
                    f"cell {self.name!r}: {event} names a request that step {event.step + 1} "
                    "does not schedule"
                )
        for v in self.verifies:
            if not 0 <= v.accepted < self.steps[v.step][v.request]:
                raise ValueError(
                    f"cell {self.name!r}: request {v.request} verifies "
                    f"{self.steps[v.step][v.request] - 1} drafts at step {v.step + 1}, cannot "
                    f"accept {v.accepted}"
                )

    @property
    def num_speculative_blocks(self) -> int:
        return max((self.steps[v.step][v.request] - 1 for v in self.verifies), default=0)

    @property
    def state(self) -> StateKind:
        return state_kind(self.kind)

    def plan(self) -> tuple[list[PlannedStep], int]:
        return plan_steps(self)

    def layer(self) -> LayerConfig:
        heads, size = self.num_heads, self.head_size
        return LayerConfig(LAYER, heads, heads, size, scale=size**-0.5)

    def backend_kwargs(self) -> dict[str, Any]:
        kwargs = {"num_heads": self.num_heads, "head_size": self.head_size,
                  "dtype": torch.float32, "mamba_cache_mode": self.mode}  # fmt: skip
        if self.num_speculative_blocks:
            kwargs["num_speculative_blocks"] = self.num_speculative_blocks
        return kwargs | self.state.backend_kwargs(self)

    def selector_config(self, device: str) -> SelectorConfig:
        return SelectorConfig(
            head_size=self.head_size,
            dtype=torch.float32,
            block_size=self.block_size,
            device=device,
            use_batch_invariant=False,
            layer_kind=self.kind,
        )


# Prefix hits: request 1 resumes from request 0's checkpoint; in mode "all" at boundaries inside
# request 0's steps, off the scan's chunk ends (16).
ALIGN_HIT = (Resume(step=1, request=1, source=0, tokens=16),)
ALL_HITS = (Resume(step=2, request=1, source=0, tokens=20),
            Resume(step=3, request=2, source=0, tokens=36))  # fmt: skip
# Request 0 keeps 1 of 3 drafts, then none of 2, request 1 all of 2, then none of 1; request 2
# is preempted after step 2 and re-prefills from nothing into its old state block.
DRAFTS = (Verify(1, 0, accepted=1), Verify(2, 0, accepted=0), Verify(2, 1, accepted=2),
          Verify(3, 1, accepted=0))  # fmt: skip
# Request 0 re-prefills from its own checkpoint after 16 tokens, request 1 from nothing.
PREEMPTED = (Resume(step=2, request=0, source=0, tokens=16), Resume(step=2, request=1, source=1))

SCENARIOS = (
    StateCell("prefill", steps=((21, 40),)),
    StateCell("prefill, decode", steps=((21, 40), (1, 1), (1, 1))),
    StateCell("chunked prefill across scan chunks, mixed",
              steps=((13, 7, 0), (11, 1, 19), (13, 1, 5), (1, 1, 1))),
    StateCell("mode all: checkpoints inside steps", steps=((21, 40), (6, 3)), mode="all"),
    StateCell("mode align: prefix hit", steps=((16, 0), (1, 7), (1, 1)), resumes=ALIGN_HIT),
    StateCell("mode all: prefix hits inside steps",
              steps=((13, 0, 0), (11, 0, 0), (13, 6, 0), (1, 1, 5)), mode="all",
              resumes=ALL_HITS),
    StateCell("mode all: block size = scan chunk", steps=((40, 21), (9, 1)), mode="all",
              block_size=16),
    StateCell("mode none: drafts rejected, preemption",
              steps=((9, 6, 7), (4, 1, 5), (3, 3, 0), (1, 2, 13)), mode="none",
              verifies=DRAFTS, resumes=(Resume(step=3, request=2, source=2),)),
    StateCell("preemption: re-prefill", steps=((16, 10), (5, 1), (6, 12)), resumes=PREEMPTED),
    StateCell("4 heads of 32", steps=((6, 3), (1, 5)), num_heads=4, head_size=32),
)  # fmt: skip


def state_grid(kind: str) -> tuple[StateCell, ...]:
    """The scenarios for one state kind, named "<kind>: <scenario>"."""
    state_kind(kind)
    return tuple(attrs.evolve(c, name=f"{kind}: {c.name}", kind=kind) for c in SCENARIOS)


STATE_GRID = state_grid("linear_state")


def state_kinds_of(backend_cls: type[AttentionBackend]) -> list[str]:
    """The state kinds among a backend's layer kinds."""
    return [kind for kind in STATE_KINDS if kind in backend_cls.layer_kinds]
