"""Error types. A PlaitError is a user-facing problem: the CLI prints it without a stack trace."""

from __future__ import annotations


class PlaitError(Exception):
    """A problem the user can fix (bad spec, bad data, bad arguments)."""


class SpecError(PlaitError):
    """The spec is invalid. `problems` lists (field path, reason) pairs."""

    def __init__(self, problems: list[tuple[str, str]], origin: str | None = None):
        self.problems = problems
        self.origin = origin
        where = f" in {origin}" if origin else ""
        lines = [f"invalid spec{where}:"] + [f"  {field}: {reason}" for field, reason in problems]
        super().__init__("\n".join(lines))


def field_path(loc: tuple, data) -> str:
    """Turn pydantic's location into a readable path, naming sources by their name."""
    parts: list[str] = []
    node = data
    for item in loc:
        if isinstance(item, int):
            name = None
            if isinstance(node, list) and 0 <= item < len(node) and isinstance(node[item], dict):
                name = node[item].get("name")
            label = f"[{item}]" + (f"({name})" if name else "")
            if parts:
                parts[-1] += label
            else:
                parts.append(label)
        else:
            parts.append(str(item))
        try:
            node = node[item]
        except (KeyError, IndexError, TypeError):
            node = None
    return ".".join(parts) or "<spec>"


class SourceError(PlaitError):
    """Bad input data: names the source, the shard (file) and the record (row / line / row group)."""

    def __init__(self, source: str, shard: str | None, record: str | None, reason: str):
        self.source, self.shard, self.record, self.reason = source, shard, record, reason
        parts = [f"source {source!r}"]
        if shard is not None:
            parts.append(f"shard {shard!r}")
        if record is not None:
            parts.append(f"record {record}")
        super().__init__(", ".join(parts) + f": {reason}")
