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
