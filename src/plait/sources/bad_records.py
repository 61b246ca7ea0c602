"""A source's bad records and bad files under its `on_error` policy.

Under `raise` the first one stops the run with a SourceError naming source, file and record. Under
`skip` the rule is one, wherever a record fails (while planning reads its block, or when its media are
decoded for a batch): each bad sample counts once per epoch, the epochs being the plan's. A sample read
again in the same epoch (a block evicted and decoded again, a build retried, a resume, another process
reading the same block) counts once; the next epoch plans it again, fails again and counts again. So the
count is what the job lost: `skipped` = (sample, epoch) pairs. A whole bad file counts once per epoch
whose order passes it. `distinct` holds each bad record (or file) once, whatever the epochs (a report's
`bad_records`), with one message each (the first 100 per source; a failure at gather names its epoch);
`records` lists the counts as (file, record, epoch), so that reports of several processes merge into
the job's (`merge_reports`: the same triple counts once).

A source whose every file is bad has nothing to give: that is an error under either policy.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter

from plait.errors import SourceError

MESSAGES_KEPT = 100


class BadRecords:
    """The bad records and files one source met: `errors["skipped"]`, `error_log`, `records`.

    The epoch of a record reported without one is the epoch being read on this thread (`reading`)."""

    def __init__(self, source: str, on_error: str, num_files: int):
        self.source = source
        self.on_error = on_error
        self.num_files = num_files
        self.errors: Counter[str] = Counter()
        self.error_log: list[str] = []
        self.seen: set[tuple[str, str | None, int | None]] = set()
        self.distinct: set[tuple[str, str | None]] = set()  # each bad record or file once, whatever the epochs
        self.bad_files: dict[str, tuple[str | None, str]] = {}  # unreadable as a whole (skip): record, reason
        self._at = threading.local()

    @contextlib.contextmanager
    def reading(self, epoch: int):
        """Records reported on this thread inside the block belong to `epoch`."""
        before = getattr(self._at, "epoch", None)
        self._at.epoch = int(epoch)
        try:
            yield
        finally:
            self._at.epoch = before

    def record(self, path: str, record: str | None, reason: str, *, epoch: int | None = None) -> None:
        """A bad record (or a bad shard: record None): raise, or count it once for its epoch, with a message
        the first time it is met. `epoch` is given by a failure of one delivery (a media decode at gather),
        whose message then names it; else it is the epoch being read (`reading`)."""
        if self.on_error == "raise":
            raise SourceError(self.source, path, record, reason)
        shown = epoch
        epoch = epoch if epoch is not None else getattr(self._at, "epoch", None)
        where = (path, record, epoch)
        if where in self.seen:
            return
        self.seen.add(where)
        self.errors["skipped"] += 1
        if (path, record) in self.distinct:
            return
        self.distinct.add((path, record))
        if len(self.error_log) < MESSAGES_KEPT:
            self.error_log.append(str(in_epoch(self.source, path, record, reason, shown)))

    def file(self, path: str, record: str | None, reason: str) -> None:
        """A whole file is unreadable: the policy decides; under skip, once every file of the source
        is known bad the source has nothing to give, which is an error naming them."""
        self.record(path, record, reason)
        self.bad_files[path] = (record, reason)
        if len(self.bad_files) == self.num_files:
            raise SourceError(self.source, None, None, "no readable file" + self.hint())

    def passed_file(self, path: str, epoch: int) -> None:
        """The order of `epoch` passed a file found bad before (in another epoch): counted for this one."""
        if path in self.bad_files:
            self.record(path, *self.bad_files[path], epoch=epoch)

    @property
    def records(self) -> list[tuple[str, str | None, int | None]]:
        """(file, record, epoch) of every bad record (or shard: record None) counted, each once."""
        return sorted(self.seen, key=lambda w: (w[0], str(w[1]), -1 if w[2] is None else w[2]))

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


def in_epoch(source: str, path: str, record: str | None, reason: str, epoch: int | None) -> SourceError:
    """The error of a skip, naming its epoch when given (after the record)."""
    if epoch is None or record is None:
        return SourceError(source, path, record, reason)
    return SourceError(source, path, f"{record} (epoch {epoch})", reason)


def merge_reports(reports: list[dict]) -> dict:
    """{source: {"skipped", "bad_records", "messages"}} of several processes' or loaders' reports:
    messages once each; when the reports list their `records`, skipped is the number of distinct (file,
    record, epoch) and bad_records of distinct (file, record) (what several of them met counts once);
    else both are sums."""
    out: dict[str, dict] = {}
    where: dict[str, set] = {}
    placeholders: dict[str, set] = {}  # documents without media holding placeholder ids (placeholder_ids.py)
    for rep in reports:
        for name, r in rep.items():
            agg = out.setdefault(name, {"skipped": 0, "bad_records": 0, "messages": []})
            agg["messages"].extend(m for m in r["messages"] if m not in agg["messages"])
            if "placeholder_records" in r:
                placeholders.setdefault(name, set()).update(tuple(w) for w in r["placeholder_records"])
            elif r.get("placeholder_documents"):
                agg["placeholder_documents"] = agg.get("placeholder_documents", 0) + r["placeholder_documents"]
            if "records" in r:
                where.setdefault(name, set()).update(tuple(w) for w in r["records"])
            else:
                agg["skipped"] += r["skipped"]
                agg["bad_records"] += r.get("bad_records", r["skipped"])
    for name, records in where.items():
        out[name]["skipped"] += len(records)
        out[name]["bad_records"] += len({w[:2] for w in records})
    for name, documents in placeholders.items():
        out[name]["placeholder_documents"] = out[name].get("placeholder_documents", 0) + len(documents)
    return out
