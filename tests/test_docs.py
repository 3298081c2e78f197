"""Every ```python block in the README and docs/ runs on its own, in a fresh namespace named
`__main__`, as a user would paste it into a file (its imports included, nothing from the blocks
before it); so does the example backend in `unified_attn.backend`'s docstring."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import unified_attn.backend
from unified_attn import selector
from unified_attn.models.families import base as family_registry

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[str]:
    return BLOCK.findall(text)


@pytest.fixture
def clean_registry():
    """Examples may register backends and model families: forget them afterwards."""
    selector.registered_backends()  # the built-ins register on first use: before the copy
    saved = dict(selector._REGISTRY)
    saved_families = list(family_registry._FAMILIES)
    yield
    selector._REGISTRY.clear()
    selector._REGISTRY.update(saved)
    family_registry._FAMILIES[:] = saved_families


def run_block(code: str, where: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    try:
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
    except Exception as error:
        raise AssertionError(f"{where} fails on its own: {error!r}") from error


BLOCKS = [
    pytest.param(path, i, id=f"{path.name}#{i + 1}")
    for path in DOCS
    for i in range(len(python_blocks(path.read_text())))
]


@pytest.mark.parametrize("path, index", BLOCKS)
def test_each_python_block_runs_alone(path, index, tmp_path, monkeypatch, clean_registry):
    code = python_blocks(path.read_text())[index]
    run_block(code, f"{path.relative_to(ROOT)}, python block {index + 1}", tmp_path, monkeypatch)


def test_the_example_backend_on_the_contract_runs(tmp_path, monkeypatch, clean_registry):
    (example,) = python_blocks(unified_attn.backend.__doc__ or "")
    run_block(example, "unified_attn/backend/__init__.py", tmp_path, monkeypatch)
    from unified_attn import LLMEngine, SamplingParams

    engine = LLMEngine("tiny-llama", backend="value-copy")
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0]
    assert len(out.output_token_ids) == 3
    _layer, backend = next(iter(engine.model.attention_layers()))
    assert type(backend.plan).__name__ == "CopyPlan"
