"""Every ```python block in the README and docs/ runs, in order, one namespace per file; so
does the example backend in `unified_attn.backend`'s docstring."""

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


def run_blocks(blocks: list[str], where: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{Path(where).stem}"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{where} block {i + 1}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{where}, python block {i + 1} fails: {error!r}") from error


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_python_blocks_run(path, tmp_path, monkeypatch, clean_registry):
    blocks = python_blocks(path.read_text())
    run_blocks(blocks, str(path.relative_to(ROOT)), tmp_path, monkeypatch)


def test_the_example_backend_on_the_contract_runs(tmp_path, monkeypatch, clean_registry):
    (example,) = python_blocks(unified_attn.backend.__doc__ or "")
    run_blocks([example], "unified_attn/backend/__init__.py", tmp_path, monkeypatch)
    from unified_attn import LLMEngine, SamplingParams

    engine = LLMEngine("tiny-llama", backend="value-copy")
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0]
    assert len(out.output_token_ids) == 3
    _layer, backend = next(iter(engine.model.attention_layers()))
    assert type(backend.plan).__name__ == "CopyPlan"
