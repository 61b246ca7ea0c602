"""What every command shares: the error console and argument types."""

from __future__ import annotations

import argparse

from rich.console import Console

console = Console(stderr=True)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (`--steps 0` must not silently mean the default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def loaders_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected `auto` or a positive integer, got {text!r}") from None
