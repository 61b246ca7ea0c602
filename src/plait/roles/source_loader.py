"""SourceLoader: reads and preprocesses blocks of its sources, announces their metadata, serves payloads.

It holds a bounded cache of decoded blocks keyed by (source, block key). The Planner asks for a block's
metadata (`block_meta`): the loader decodes the block once and keeps it until the blocks' documents have
been delivered (`retain` tells it which blocks are still live); a source that can give lengths without
tokens (`length_field`, Megatron's index) answers from them and is decoded only when a payload is gathered. Constructors ask for payloads by
(source, block key, position, offset, length) (`gather`); a block that was evicted (or never read by
this process, e.g. after a restart) is simply decoded again: reading is deterministic.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from plait.batch import Payload
from plait.state.deltas import DeltaTracker
from plait.kernels import copy_spans
from plait.heap import HEAP_TRIM
from plait.sources import BlockKey, DocBlock, Source
from plait.sources.blocks import late_failures, without_late_failures
from plait.sources.buffer_budget import (CursorHeads, FullKey, drop_over_count, fit_budgets, retain_blocks,
                                         window_limit)
from plait.sources.media_payload import ImageWork, decode_payload
from plait.sources.reader import OpenStreams
from plait.sources.workers import WorkerPool, resolve_workers
from plait.spec import Spec

log = logging.getLogger("plait.data")
TRIM_EVERY = 16 << 20  # bytes of dropped blocks between two heap trims (glibc keeps freed blocks of up to
# 32 MiB in its heap: dropped decoded blocks would stay resident, ~20 MiB at 64 sources in an in-process probe)


def loader_budget(spec: Spec, sources, partitions: dict[int, tuple[int, frozenset]]) -> int | None:
    """A loader's share of the job-wide cap (loading.max_buffer_mb): its share of the job's sources,
    a source split into partitions counting for the partitions it owns (all of it on the local runtime),
    and never less than one of its sources' buffer_mb."""
    cap = spec.loading.max_buffer_mb
    if cap is None:
        return None
    owned = sum(len(partitions[s][1]) / partitions[s][0] if s in partitions else 1.0 for s in sources)
    largest = max((spec.sources[s].buffer_bytes for s in sources), default=0)
    return max(largest, int(cap * 2**20 * owned / len(spec.sources)))


def partition_of(file_idx: int, num_partitions: int) -> int:
    """The partition owning a file (index in the source's sorted file list): files are dealt out
    round-robin, so every partition gets a similar share of a source's data."""
    return file_idx % num_partitions


@dataclass
class GatheredMedia:
    """A gather's tokens (`length` per item) and the media still to decode (plait.sources.media_payload)."""

    tokens: np.ndarray
    work: ImageWork
    length: np.ndarray
    failed: np.ndarray | None = None  # items that failed late (sources/blocks.py): left out of the payload


@dataclass
class BlockMeta:
    """What the Planner needs of a block: sizes and ids, never tokens."""

    source: int
    key: BlockKey
    next_key: BlockKey
    shard: int
    positions: np.ndarray
    rows: np.ndarray
    lengths: np.ndarray
    num_positions: int
    # image sources: per document its images' patches and squared patches summed (the Planner's second
    # capacity and the encoder's cost, quadratic per image); None for text
    patches: np.ndarray | None = None
    patches_sq: np.ndarray | None = None
    audio: np.ndarray | None = None  # audio sources: [docs, 3] encoder spans, squared spans, placeholder tokens


class SourceLoader:
    def __init__(
        self, spec: Spec, source_indices: list[int] | None = None, max_cached_blocks: int = 256,
        partitions: dict[int, tuple[int, set[int]]] | None = None, workers: int | None = None,
    ):
        """`partitions` (optional): source -> (its number of partitions, the partitions owned here).

        A loader owning only some partitions of a source decodes only the blocks of the files those
        partitions own (`partition_of`); it still reads other files' footers when the source's order
        crosses them (block counts are metadata, needed to step a key past a file's end).
        `workers`: threads of the preprocessing pool (default: the spec's loading.workers, resolved here).
        """
        self.spec = spec
        self.workers = workers if workers is not None else resolve_workers(spec.loading.workers)
        self.pool = WorkerPool(self.workers)
        idx = range(len(spec.sources)) if source_indices is None else source_indices
        if partitions is not None:
            idx = sorted(set(idx) & set(partitions)) if source_indices is not None else sorted(partitions)
        self.partitions = {int(s): (int(n), frozenset(owned)) for s, (n, owned) in (partitions or {}).items()}
        self.sources: dict[int, Source] = {i: Source.of_job(spec, i) for i in idx}
        self.open_streams = OpenStreams(spec.loading.max_open_streams)  # row-range readers, over all sources
        for source in self.sources.values():
            source.reader.share_open_streams(self.open_streams)
        self.images_decoded = 0  # images decoded for payloads (each delivered image exactly once)
        self.counts_lock = threading.Lock()  # the counts: media decode outside the caller's lock (decode_gathered)
        self.max_cached_blocks = max_cached_blocks
        self._blocks: OrderedDict[FullKey, DocBlock] = OrderedDict()
        # One budget shared by the sources (buffer_budget; a source's buffer_mb caps it when the spec sets
        # it). `_window`: blocks the next steps draw from (the last `retain`'s, plus every block read since).
        self.source_budget = {i: spec.sources[i].buffer_bytes for i in self.sources if spec.sources[i].buffer_mb}
        self.loader_budget = loader_budget(spec, self.sources, self.partitions)
        self.dropped_bytes = 0  # since the last heap trim
        self.buffer_over_budget = 0  # blocks kept although they alone put a budget over (never a deadlock)
        self._window: set[FullKey] = set()
        self.heads = CursorHeads(spec)  # what a cursor block keeps of its documents
        self.blocks_read = 0
        self.busy_seconds = 0.0  # reading and decoding blocks, copying payloads (for the busy ratio)
        self.started = time.perf_counter()
        self.skip_warnings = SkipWarnings()

    # ----- metadata (to the Planner) -------------------------------------------------------------
    def first_key(self, source: int) -> BlockKey:
        return self.sources[source].first_key()

    def block_meta(self, source: int, key: BlockKey) -> BlockMeta:
        """A block's sizes and ids. From the decoded block when it is buffered; else, when the source
        can give lengths without tokens (a `length_field`, or a format whose index holds them), from
        those alone: the tokens are decoded later, by the `gather` that needs them."""
        src = self.sources[source]
        if (source, *key) not in self._blocks and src.reads_lengths(tuple(key)):
            if self.partitions and not self.owns(source, tuple(key)):
                raise ValueError(f"block {(source, *key)} belongs to a partition this loader does not own")
            block = src.read_lengths(tuple(key))
        else:
            block = self.block(source, key)
        self.skip_warnings.say(self.sources[source], source, int(key[0]))
        table = getattr(block, "images", None)
        return BlockMeta(
            source, key, src.next_key(key), block.shard, block.positions, block.rows, block.lengths, block.num_positions,
            None if table is None else table.doc_sums(1), None if table is None else table.doc_sums(2),
            None if table is None or table.spans is None else table.audio_sums(),
        )

    # ----- payloads (to Constructors) ------------------------------------------------------------
    def gather(self, *request) -> np.ndarray | Payload:
        """`copy_tokens`' tokens; a Payload where a document failed after planning (sources/blocks.py)."""
        return without_late_failures(*self.copy_tokens(*request), request[-1])

    def copy_tokens(self, source, keys: list[FullKey], block_index, position, offset, length) -> tuple:
        """Tokens of the requested spans in request order (span i: tokens [offset, offset+length) of the
        document at shuffled `position[i]` of block `keys[block_index[i]]`), and which failed late (unwritten)."""
        t0 = time.perf_counter()
        length = np.asarray(length, dtype=np.int64)
        self.delta_tracker.note_served(keys, block_index, position, np.asarray(offset) // self.spec.packing.seq_len)
        out = np.empty(int(length.sum()), dtype=np.int32)
        out_start = np.cumsum(length) - length
        failed = np.zeros(len(length), dtype=bool)
        for b in np.unique(block_index):
            sel = np.flatnonzero(block_index == b)
            full = keys[int(b)]
            block = self.block(full[0], full[1:], position[sel])
            self.heads.note(full, position[sel])
            t_copy = time.perf_counter()
            sel, doc = late_failures(block, sel, np.searchsorted(block.positions, position[sel]), failed)
            src_start = block.starts[doc] + offset[sel]
            copy_spans(block.tokens, src_start, length[sel], out, out_start[sel])
            with self.counts_lock:
                count_production(self, full[0], time.perf_counter() - t_copy, tokens=int(length[sel].sum()),
                                 samples=int(np.count_nonzero(np.asarray(offset)[sel] == 0)))
        with self.counts_lock:
            self.busy_seconds += time.perf_counter() - t0
        return out, failed

    @property
    def has_images(self) -> bool:
        return any(s.images is not None for s in self.sources.values())

    def gather_payload(
        self, source: np.ndarray, keys: list[FullKey], block_index: np.ndarray, position: np.ndarray,
        offset: np.ndarray, length: np.ndarray,
    ) -> Payload:
        """`gather`'s tokens, and the images of the requested documents, each decoded here exactly once
        (only documents holding images are looked at; a document with images is never cut, so it is
        one span from offset 0). A document with an image that fails to decode (on_error: skip) is
        dropped whole: its tokens and images left out, its index in `Payload.dropped`."""
        return self.decode_gathered(self.gather_media(source, keys, block_index, position, offset, length))

    def gather_media(
        self, source: np.ndarray, keys: list[FullKey], block_index: np.ndarray, position: np.ndarray,
        offset: np.ndarray, length: np.ndarray,
    ) -> "GatheredMedia":
        """`gather_payload`'s first half: the tokens and the media to decode, found in the decoded blocks.
        It touches the block cache (callers that share the loader between threads hold their lock for
        it); the second half, `decode_gathered`, touches only the pool and the counts, so several threads'
        gathers decode at once and the pool stays full between them."""
        tokens, failed = self.copy_tokens(source, keys, block_index, position, offset, length)
        work = ImageWork.of_gather(self.sources, self.block, keys, block_index, position)
        return GatheredMedia(tokens, work, np.asarray(length, dtype=np.int64), failed)

    def decode_gathered(self, gathered: "GatheredMedia") -> Payload:
        """The payload of a `gather_media`: its media decoded on the pool (thread-safe: the blocks it
        reads are held by `gathered`, even once the cache has dropped them)."""
        work = gathered.work
        if not work.tasks:
            return without_late_failures(Payload(gathered.tokens, None), gathered.failed, gathered.length)
        t0 = time.perf_counter()
        payload, done = decode_payload(work, gathered.tokens, gathered.length, self.pool)
        with self.counts_lock:
            for (_, source_idx, *_), (seconds, _) in zip(work.tasks, done):
                count_production(self, source_idx, seconds, images=1)
            self.images_decoded += len(work.tasks)
            self.busy_seconds += max(time.perf_counter() - t0, float(sum(seconds for seconds, _ in done)))
        return without_late_failures(payload, gathered.failed, gathered.length)

    def retain(self, live: set[FullKey], drawn: set[FullKey] | None = None) -> None:
        """Drop cached blocks that no pending or future step needs; `drawn` (default: all of `live`): those
        the planned steps draw from, the plan window the shared budget is sized to."""
        self._window = set(live if drawn is None else drawn)
        self.dropped_bytes += self.heads.trim(self._blocks, live, self._window)
        self.dropped_bytes += retain_blocks(self._blocks, live, self._window, self.loader_budget)
        if self.dropped_bytes >= TRIM_EVERY:  # once a step at most, outside the read path
            HEAP_TRIM.now()
            self.dropped_bytes = 0

    # ----- internals ---------------------------------------------------------------------------
    def owns(self, source: int, key: BlockKey) -> bool:
        """Whether this loader decodes the block at `key` of `source` (always, without partitions)."""
        if source not in self.sources:
            return False
        part = self.partitions.get(source)
        if part is None:
            return True
        file_idx = int(self.sources[source].file_order(key[0])[key[1]])
        return partition_of(file_idx, part[0]) in part[1]

    def num_files(self) -> dict[int, int]:
        return {i: len(s.files) for i, s in self.sources.items()}

    def block(self, source: int, key: BlockKey, positions: np.ndarray | None = None) -> DocBlock:
        """A source's decoded block, read when not buffered or its head lacks `positions` (None: all of it)."""
        full = (source, *key)
        block = self._blocks.get(full)
        if block is None or not block.holds(positions):
            if self.partitions and not self.owns(source, tuple(key)):
                raise ValueError(f"block {full} belongs to a partition this loader does not own")
            t0 = time.perf_counter()
            block = self.sources[source].read_block(tuple(key))
            with self.counts_lock:
                self.busy_seconds += time.perf_counter() - t0
                count_production(self, source, time.perf_counter() - t0)
            self.blocks_read += 1
            self._blocks[full] = block
            self._window.add(full)
            self.dropped_bytes += drop_over_count(self._blocks, self.max_cached_blocks, full)
            self._fit_budgets(full)
        self._blocks.move_to_end(full)
        return block

    def _fit_budgets(self, newest: FullKey) -> None:
        """Keep the buffer within the shared budget and the source's cap (buffer_budget); a block alone over
        a budget stays, counted in `buffer_over_budget`."""
        shared = window_limit(self._blocks, self._window, self.loader_budget)
        budgets = ((self.source_budget.get(newest[0]), newest[0]), (shared, None))
        dropped, over = fit_budgets(self._blocks, newest, budgets, self._window)
        self.dropped_bytes += dropped
        self.buffer_over_budget += over

    def source_bytes(self, source: int) -> int:
        """Decoded data buffered of one source."""
        return sum(b.nbytes for k, b in self._blocks.items() if k[0] == source)

    @property
    def cached_bytes(self) -> int:
        return sum(b.nbytes for b in self._blocks.values())

    def telemetry(self) -> dict:
        """Live figures for plait.telemetry: buffered bytes, busy fraction of wall time, skipped records."""
        wall = max(time.perf_counter() - self.started, 1e-9)
        return {"buffer_bytes": self.cached_bytes, "buffer_over_budget": self.buffer_over_budget,
                "busy_fraction": min(1.0, self.busy_seconds / wall),
                "skipped": {s.name: s.errors.get("skipped", 0) for s in self.sources.values()},
                "produced": {int(s): list(map(float, v)) for s, v in self.__dict__.get("produced", {}).items()}}

    def error_report(self, records: bool = True) -> dict[str, dict]:
        """{source: {"skipped", "bad_records", "messages"}} (and "placeholder_documents" where documents
        without media hold media placeholder ids) and, with `records`, what each skip was ([file, record, epoch]),
        so that the reports of several processes that read the same block (a replaced or re-partitioned
        loader decodes it again, every process of a torchrun job plans every step) merge into the job's,
        each bad sample once per epoch (plait.sources.bad_records.merge_reports)."""
        out = {s.name: {"skipped": s.errors.get("skipped", 0), "bad_records": len(s.bad.distinct),
                        "messages": list(s.error_log)} for s in self.sources.values()}
        for s in self.sources.values():  # documents without media holding placeholder ids (placeholder_ids.py)
            if s.placeholders.documents:
                out[s.name]["placeholder_documents"] = len(s.placeholders.documents)
        if records:
            for s in self.sources.values():
                out[s.name]["records"] = [list(w) for w in s.bad_records]
                if s.placeholders.documents:
                    out[s.name]["placeholder_records"] = sorted(map(list, s.placeholders.documents))
        return out

    def close(self) -> None:
        self.pool.close()
        for s in self.sources.values():
            s.close()

    # ----- differential checkpoints (to shadows and the Planner) --------------------------------
    @property
    def delta_tracker(self) -> DeltaTracker:
        tracker = self.__dict__.get("_delta_tracker")
        if tracker is None:
            tracker = self._delta_tracker = DeltaTracker(name=self.loader_name)
        return tracker

    @property
    def loader_name(self) -> str:
        return self.__dict__.get("_loader_name") or "loader[" + ",".join(str(i) for i in self.sources) + "]"

    def checkpoint_delta(self, step: int | None = None) -> dict:
        """What changed since the previous delta: read cursors, blocks buffered and dropped, samples
        served (so the buffered samples not yet consumed are known). A few hundred bytes per interval;
        a Shadow applies the deltas in order (plait.state.deltas)."""
        return self.delta_tracker.take(set(self._blocks), step)

    def checkpoint_snapshot(self, step: int | None = None) -> dict:
        """Everything buffered now, for a Shadow that starts following this loader mid-run."""
        return self.delta_tracker.snapshot(set(self._blocks), step)

    def buffered_keys(self) -> list[FullKey]:
        return list(self._blocks)


PRODUCED_FIELDS = ("busy_s", "tokens", "samples", "images")  # SourceLoader.telemetry()["produced"][source]


def count_production(loader: SourceLoader, source: int, busy_s: float, tokens: int = 0, samples: int = 0,
                     images: int = 0) -> None:
    """Per source, what a loader spent and produced (PRODUCED_FIELDS): the run-time autoscaler's rates.
    Kept in `loader.produced` (made on first use: the loader's constructor stays as it is)."""
    row = loader.__dict__.setdefault("produced", {}).setdefault(int(source), [0.0, 0, 0, 0])
    row[0] += busy_s
    row[1] += tokens
    row[2] += samples
    row[3] += images


class SkipWarnings:
    """Logs a warning when a source has skipped new bad records (on_error: skip), once per source and
    epoch, with the count so far: a Python API user sees skips without asking for error_report()."""

    def __init__(self):
        self.said: dict[int, int] = {}  # source -> skips counted when its last warning was logged
        self.epochs_said: set[tuple[int, int]] = set()  # (source, epoch) warned about

    def say(self, src: Source, source: int, epoch: int) -> None:
        # distinct bad records: one met again in a later epoch counts again in the report, but is not news
        count = len(src.bad.distinct)
        if count <= self.said.get(source, 0) or (source, epoch) in self.epochs_said:
            return
        self.said[source] = count
        self.epochs_said.add((source, epoch))
        log.warning("source %r: %d bad record(s) skipped so far (on_error: skip), epoch %d; first: %s. "
                    "Loader.error_report() lists them", src.name, count, epoch, src.error_log[0] if src.error_log
                    else "-")
