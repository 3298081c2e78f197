"""The package's import layering (docs/architecture.md, "Layers"): every part imports only
the parts below it, read off the source with `ast` (imports under `if TYPE_CHECKING:` are
annotations only and do not count)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "unified_attn"

# part -> the parts it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    part: set(below.split())
    for part, below in {
        "utils": "",
        "request": "",
        "sampling_params": "utils",
        "tensor_specs": "utils",
        "kernels": "utils",
        "managers": "request utils",
        "backend": "managers tensor_specs utils",
        "selector": "backend tensor_specs utils",
        "backends": "backend selector kernels managers tensor_specs utils",
        "legacy_adapter": "backend selector backends kernels managers tensor_specs utils",
        "models": "backend selector kernels tensor_specs utils",
        # legacy backend names resolve in the selector's registry: the engine never imports
        # the legacy package
        "runner": "models backend selector managers tensor_specs request sampling_params utils",
        "spec_decode": "runner models backend selector managers tensor_specs request "
        "sampling_params utils",
        "distributed": "spec_decode runner models backend selector managers tensor_specs "
        "request sampling_params utils",
        "engine": "distributed spec_decode runner models backend selector managers "
        "tensor_specs request sampling_params utils",
        # vLLM's `LLM` over the engine
        "llm": "engine runner sampling_params utils",
        "harness": "engine distributed spec_decode runner models legacy_adapter backends "
        "backend selector managers tensor_specs request sampling_params utils",
        # the top: every command
        "cli": "harness engine distributed spec_decode runner models legacy_adapter backends "
        "backend selector kernels managers tensor_specs request sampling_params utils",
    }.items()
}
# presentation: the commands' tables, the harness reports, `LLM.generate`'s progress bar
MAY_IMPORT_RICH = {"harness", "cli", "llm"}


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def runtime_imports(tree: ast.Module) -> list[str]:
    """Absolute module names imported outside `if TYPE_CHECKING:` blocks."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def modules() -> list[Path]:
    return sorted(
        p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE
    )


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_imports_only_the_parts_below_it(path):
    part = part_of(path)
    assert part in ALLOWED, f"{part} is a new part of the package: give it a layer here"
    tree = ast.parse(path.read_text(), filename=str(path))
    for name in runtime_imports(tree):
        if name == "rich" or name.startswith("rich."):
            assert part in MAY_IMPORT_RICH, f"{path.name}: only harness, cli and llm import rich"
        if not name.startswith("unified_attn."):
            continue
        target = name.split(".")[1]
        assert target == part or target in ALLOWED[part], (
            f"unified_attn/{path.relative_to(PACKAGE)} imports {name}: {part} may import "
            f"{sorted(ALLOWED[part])}"
        )


def test_the_package_root_imports_the_public_api_only():
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    parts = {name.split(".")[1] for name in runtime_imports(tree) if "." in name}
    assert "harness" not in parts and "cli" not in parts and "legacy_adapter" not in parts


def test_every_kernel_lives_in_the_kernels_package():
    """`@triton.jit` and Gluon kernels are in `unified_attn/kernels/` and nowhere else."""
    outside = [
        str(path.relative_to(PACKAGE))
        for path in modules()
        if path.relative_to(PACKAGE).parts[0] != "kernels"
        and any(mark in path.read_text() for mark in ("@triton.jit", "@gluon.jit", "@jit"))
    ]
    assert not outside, f"kernels outside unified_attn/kernels: {outside}"


def test_the_harness_is_library_code():
    """Every command (its argparse parser) is in `cli/`; the harness only offers functions."""
    parsers = [
        str(path.relative_to(PACKAGE))
        for path in modules()
        if part_of(path) == "harness" and "argparse" in runtime_imports(ast.parse(path.read_text()))
    ]
    assert not parsers, f"argument parsing outside cli/: {parsers}"


def test_no_module_outside_the_families_dispatches_on_a_model_config_type():
    """`isinstance(x, <a family's config type>)` only in `models/families/` (the family seam):
    everything else asks `family_of(config)`."""
    from unified_attn.models.families import families

    config_types = {family.config_type.__name__ for family in families()}
    found = []
    for path in modules():
        if path.relative_to(PACKAGE).parts[:2] == ("models", "families"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance":
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if names & config_types:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, f"dispatch on a model config type outside the families: {found}"


# Debt the restructuring has not paid yet: these modules are over 400 lines and these basenames
# repeat. The lists may only shrink: a new long module or a new repeated name fails, and so
# does an entry that no longer needs to be here.
LONG_MODULES: set[str] = set()
REPEATED_BASENAMES: set[str] = set()


def test_no_module_is_over_400_lines():
    long = {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if len(path.read_text().splitlines()) > 400
    }
    assert long == LONG_MODULES, (
        f"over 400 lines, new: {sorted(long - LONG_MODULES)}; "
        f"fixed (remove from LONG_MODULES): {sorted(LONG_MODULES - long)}"
    )


def test_module_basenames_are_distinct():
    """Except `__init__.py` and the conventional `base.py` of a sub-package."""
    from collections import Counter

    counts = Counter(path.name for path in PACKAGE.rglob("*.py"))
    repeated = {name for name, n in counts.items() if n > 1} - {"__init__.py", "base.py"}
    assert repeated == REPEATED_BASENAMES, (
        f"repeated, new: {sorted(repeated - REPEATED_BASENAMES)}; "
        f"fixed (remove from REPEATED_BASENAMES): {sorted(REPEATED_BASENAMES - repeated)}"
    )


def test_jit_code_is_apart_from_launchers():
    """A kernels module holds jit code or launchers (`kernel[grid](...)`), not both."""
    import re

    launch = re.compile(r"\w\[[^\]\n]*\]\(")
    mixed = [
        str(path.relative_to(PACKAGE))
        for path in modules()
        if path.relative_to(PACKAGE).parts[0] == "kernels"
        and any(mark in path.read_text() for mark in ("@triton.jit", "@gluon.jit"))
        and launch.search(path.read_text())
    ]
    assert not mixed, f"jit code and launchers in one module: {mixed}"
