"""Every backend the package ships keeps its per-step data in one declared plan object:
`prep_forward` sets `self.plan` (a frozen attrs instance of the type the class is
parameterised with) and no other attribute, and `forward` before `prep_forward` is a clear
error."""

from __future__ import annotations

import typing

import attrs
import pytest
import torch

from unified_attn import AttentionBackend, LLMEngine, SamplingParams

PORTS = "unified_attn.legacy_adapter.ports"
# On a GPU the Triton cases run on CUDA, with decode steps captured in CUDA graphs.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (preset, backend): together they cover every AttentionBackend subclass the package ships.
CASES = [
    ("tiny-hybrid", "reference"),
    ("tiny-hybrid", "triton"),
    ("hybrid-linear", "reference"),  # state layers: LinearStateBackend
    ("tiny-mamba-hybrid", "reference"),  # Mamba2StateBackend
    ("tiny-hybrid", f"{PORTS}:LegacyReferenceAdapter"),
    ("tiny-llama", f"{PORTS}:LegacyTritonAdapter"),
]


def declared_plan_type(cls: type) -> type:
    """The `PlanT` of `class X(AttentionBackend[PlanT])` (or of a generic subclass of it, as
    `StateBackend[PlanT]`), the first concrete one along the MRO."""
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            if isinstance(origin, type) and issubclass(origin, AttentionBackend):
                plan = typing.get_args(base)[0]
                if not isinstance(plan, typing.TypeVar):
                    return plan
    raise AssertionError(f"{cls.__name__} does not declare its plan type")


def watch_prep_forward(backend: AttentionBackend, seen: list) -> None:
    original = backend.prep_forward

    def prep_forward(*args, **kwargs):
        before = dict(vars(backend))
        original(*args, **kwargs)
        after = vars(backend)
        changed = {k for k in after if k not in before or after[k] is not before[k]}
        seen.append((set(after) - set(before), changed - {"plan"}, backend.plan))

    backend.prep_forward = prep_forward  # type: ignore[method-assign]


@pytest.mark.parametrize("preset, backend_name", CASES)
def test_prep_forward_sets_only_its_declared_frozen_plan(preset, backend_name):
    engine = LLMEngine(preset, backend=backend_name, device=DEVICE, max_num_batched_tokens=16)
    backends = {id(b): b for _, b in engine.model.attention_layers()}.values()
    seen: dict[str, list] = {}
    for backend in backends:
        watch_prep_forward(backend, seen.setdefault(type(backend).__name__, []))
    engine.generate([list(range(30)), [7] * 21], SamplingParams(max_tokens=3))
    assert seen and all(seen.values())
    for backend in backends:
        plan_type = declared_plan_type(type(backend))
        assert attrs.has(plan_type), f"{plan_type} is not an attrs class"
        for new, replaced, plan in seen[type(backend).__name__]:
            assert not new, f"{type(backend).__name__}.prep_forward created {sorted(new)}"
            assert not replaced, f"{type(backend).__name__}.prep_forward set {sorted(replaced)}"
            assert isinstance(plan, plan_type)
            field = attrs.fields(plan_type)[0].name
            with pytest.raises(attrs.exceptions.FrozenInstanceError):
                setattr(plan, field, None)


def test_forward_before_prep_forward_names_the_call_order():
    engine = LLMEngine("tiny-llama")
    _layer, backend = next(iter(engine.model.attention_layers()))
    backend.plan = None
    with pytest.raises(RuntimeError, match="forward ran before prep_forward"):
        backend.current_plan()
