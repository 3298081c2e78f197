"""A compiled Triton kernel may read a module-level name only when it is a `tl.constexpr(...)`
(or a function, module or jit function); Triton's CPU interpreter reads any global, so a plain
float constant passes every CPU test and fails to compile on the GPU. This test reads the source
of every module under `unified_attn/` that defines `@triton.jit` functions and refuses plain
module-level numbers, strings and tuples read inside them."""

from __future__ import annotations

import ast
from pathlib import Path

import unified_attn

ROOT = Path(unified_attn.__file__).parent


def _is_jit(node: ast.FunctionDef) -> bool:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr in {"jit", "autotune", "heuristics"}:
            return True
    return False


def _plain_constants(tree: ast.Module) -> dict[str, int]:
    """Module-level `NAME = <literal>` assignments (not `tl.constexpr(...)`): name -> line."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            literal = isinstance(value, ast.Constant | ast.Tuple | ast.BinOp | ast.UnaryOp)
            if literal:
                for t in targets:
                    if isinstance(t, ast.Name):
                        found[t.id] = node.lineno
    return found


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    constants = _plain_constants(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and _is_jit(node):
            local = {a.arg for a in node.args.args}
            for inner in ast.walk(node):
                if isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                    local.add(inner.id)
            for inner in ast.walk(node):
                if (
                    isinstance(inner, ast.Name)
                    and isinstance(inner.ctx, ast.Load)
                    and inner.id in constants
                    and inner.id not in local
                ):
                    out.append(
                        f"{path.relative_to(ROOT.parent)}:{inner.lineno}: {node.name} reads "
                        f"{inner.id} (line {constants[inner.id]}), not a tl.constexpr"
                    )
    return out


def test_jit_functions_read_only_constexpr_globals():
    offences = []
    for path in sorted(ROOT.rglob("*.py")):
        if "triton.jit" in path.read_text():
            offences += _offences(path)
    assert not offences, "\n".join(offences)


def test_the_check_finds_a_plain_global(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import triton\nSCALE = 0.5\n\n@triton.jit\ndef k(x):\n    return x * SCALE\n"
    )
    good = tmp_path / "good.py"
    good.write_text(
        "import triton\nimport triton.language as tl\nSCALE = tl.constexpr(0.5)\n\n"
        "@triton.jit\ndef k(x):\n    return x * SCALE\n"
    )
    assert len(_offences_at(bad, tmp_path)) == 1
    assert _offences_at(good, tmp_path) == []


def _offences_at(path: Path, root: Path) -> list[str]:
    global ROOT
    saved, ROOT = ROOT, root / "pkg"
    try:
        return _offences(path)
    finally:
        ROOT = saved
