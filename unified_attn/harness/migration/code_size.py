"""Lines of code of a backend: `source_lines` (no blanks, comments or docstrings) and
`lines_of_code` over the classes a backend is made of (`backend_classes`)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

from unified_attn.backend import AttentionBackend


def source_lines(obj: Any) -> int:
    """Non-blank lines of `obj`'s source that are neither comments nor docstrings."""
    source = textwrap.dedent(inspect.getsource(obj))
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(body[0].lineno, (body[0].end_lineno or 0) + 1))
    return sum(
        1
        for i, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and i not in docstrings
    )


def backend_classes(cls: type[AttentionBackend]) -> list[type]:
    """The classes a backend is made of: the four legacy ones behind an adapter, else itself."""
    legacy = getattr(cls, "legacy_backend", None)
    if legacy is None:
        return [cls]
    return [legacy, legacy.get_builder_cls(), legacy.get_metadata_cls(), legacy.get_impl_cls()]


def lines_of_code(cls: type[AttentionBackend]) -> dict[str, Any]:
    classes = backend_classes(cls)
    per_class = {c.__qualname__: source_lines(c) for c in classes}
    modules = {inspect.getmodule(c) for c in classes}
    return {
        "classes": per_class,
        "total": sum(per_class.values()),
        "modules": sum(source_lines(m) for m in modules if m is not None),
    }
