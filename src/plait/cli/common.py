"""What every command shares: the error console, argument types, tables and --json output."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

console = Console(stderr=True)
PIPED_WIDTH = 400  # columns for tables written to a pipe or a file: wide enough never to cut a cell


def table_console() -> Console:
    """The stdout console for tables. On a terminal, its width; piped or redirected, rich would assume 80
    columns and cut cells short (`plait jobs | grep`, a file), so the table gets the width it needs."""
    if sys.stdout.isatty():
        return Console()
    return Console(width=PIPED_WIDTH)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (`--steps 0` must not silently mean the default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1 (`--dp 8,64`)."""
    try:
        values = [positive_int(x.strip()) for x in str(text).split(",") if x.strip()]
    except argparse.ArgumentTypeError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def loaders_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected `auto` or a positive integer, got {text!r}") from None


def print_table(title: str, rows: list[tuple[str, ...]], columns=("measure", "value"), left=("measure",)):
    """A table on stdout: `columns` (those in `left` left-justified, figures right); returns
    the console, for the lines that follow it."""
    from rich.table import Table

    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right")
    for row in rows:
        t.add_row(*row)
    out = table_console()
    out.print(t)
    return out


def write_json(path: str | None, result) -> None:
    """What a command's --json PATH writes (nothing without one)."""
    if path:
        Path(path).write_text(json.dumps(result, indent=2) + "\n")


def fmt(value, spec: str) -> str:
    """A table's figure, "-" where a row has none."""
    return "-" if value is None else format(value, spec)
