"""A source's bad records and bad files under its `on_error` policy.

Under `raise` the first one stops the run with a SourceError naming source, file and record. Under
`skip` each is counted once, however often it is read again (next epochs, a block evicted from the cache
and decoded again, a resume), so the count is a fact about the data; the first 100 messages are kept.
A source whose every file is bad has nothing to give: that is an error under either policy.
"""

from __future__ import annotations

from collections import Counter

from plait.errors import SourceError

MESSAGES_KEPT = 100


class BadRecords:
    """The bad records and files one source met: `errors["skipped"]`, `error_log`, `records`."""

    def __init__(self, source: str, on_error: str, num_files: int):
        self.source = source
        self.on_error = on_error
        self.num_files = num_files
        self.errors: Counter[str] = Counter()
        self.error_log: list[str] = []
        self.seen: set[tuple[str, str | None]] = set()
        self.bad_files: set[str] = set()  # files found unreadable as a whole (skip policy)

    def record(self, path: str, record: str | None, reason: str) -> None:
        """A bad record (or a bad shard: record None): raise, or count it once and keep its message."""
        err = SourceError(self.source, path, record, reason)
        if self.on_error == "raise":
            raise err
        where = (path, record)
        if where in self.seen:
            return
        self.seen.add(where)
        self.errors["skipped"] += 1
        if len(self.error_log) < MESSAGES_KEPT:
            self.error_log.append(str(err))

    def file(self, path: str, record: str | None, reason: str) -> None:
        """A whole file is unreadable: the policy decides; under skip, once every file of the source
        is known bad the source has nothing to give, which is an error naming them."""
        self.record(path, record, reason)
        self.bad_files.add(path)
        if len(self.bad_files) == self.num_files:
            raise SourceError(self.source, None, None, "no readable file" + self.hint())

    @property
    def records(self) -> list[tuple[str, str | None]]:
        """(file, record) of every bad record (or shard: record None) met, each once."""
        return sorted(self.seen, key=lambda w: (w[0], str(w[1])))

    def hint(self) -> str:
        """What was skipped, for an error that ends the source: the count, the first message, bad files."""
        if not self.error_log:
            return ""
        hint = f" ({self.errors['skipped']} skipped; first: {self.error_log[0]})"
        if self.bad_files:
            names = sorted(self.bad_files)
            more = f", ... ({len(names)} in all)" if len(names) > 5 else ""
            hint += f"; bad files: {', '.join(names[:5])}{more}"
        return hint
