"""The console the commands print their tables on: a table's cells wrap onto more lines
(`overflow="fold"`) instead of being cut with an ellipsis when the output is narrow (a piped
output is 80 columns), so a manager's or backend's name is never shown half."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


class ReportConsole(Console):
    def print(self, *objects: Any, **kwargs: Any) -> None:
        for item in objects:
            if isinstance(item, Table):
                for column in item.columns:
                    column.overflow = "fold"
        super().print(*objects, **kwargs)
