"""Drawing from the sources: where the Planner is in every source, and taking chunks from there.

Each source has a cursor (epoch, file_pos, block_pos, position, offset: tokens of the document at
`position` already drawn) and a deficit: the tokens its mixture share still owes. A draw takes chunks
from the cursor on while the next one starts before the deficit is used up (error diffusion at chunk
granularity), reading only block metadata from the provider: sizes and ids, never tokens.
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from plait import packing_phases as phases
from plait.errors import PlaitError, SourceError
from plait.mixture import take_count
from plait.plan import ITEM_AUDIO_COLUMNS, Items
from plait.spec import Spec

log = logging.getLogger("plait.planner")


class MetadataProvider(Protocol):
    """Where the Planner gets block metadata: a SourceLoader (local) or a proxy to loader actors."""

    def first_key(self, source: int) -> tuple[int, int, int]: ...

    def block_meta(self, source: int, key: tuple[int, int, int]): ...


class SourceDraws:
    """The cursors and deficits of all sources, and the draws that move them.

    `limits` (longest chunk per source) and `grains` (chunk numbering) follow the current
    sequence-length phase (packing_phases.py): the Planner sets `limits` when a phase starts.
    """

    def __init__(self, spec: Spec, provider: MetadataProvider, limits: np.ndarray):
        self.spec = spec
        self.provider = provider
        self.limits = limits
        self.grains = phases.granules(spec)
        n = len(spec.sources)
        # epoch, file_pos, block_pos, position, offset (tokens of the document at `position` already drawn)
        self.cursor = np.zeros((n, 5), dtype=np.int64)
        self.deficit = np.zeros(n, dtype=np.float64)
        self.drawn = np.zeros(n, dtype=np.int64)  # tokens drawn per source (metrics only)
        self._meta: dict[int, object] = {}
        self.empty_docs = 0  # zero-token documents skipped in the step being planned
        self.repeat_warned: set[int] = set()  # sources said to repeat within one step (warned once each)
        for i in range(n):
            self.cursor[i, :3] = provider.first_key(i)

    def draw(self, source: int, step: int) -> Items:
        """Take chunks from one source while the next chunk starts before its deficit is used up.

        Error diffusion at chunk granularity: a document longer than seq_len is drawn chunk by chunk over
        as many steps as the source's share allows (the cursor's last field is the offset reached inside
        the current document), so a giant document never floods a step or the carry and every source
        stays within one chunk of its target share. A document of at most seq_len tokens is one chunk.
        """
        parts: list[Items] = []
        got = 0  # tokens: a source of only empty documents must fail, not loop forever
        start_epoch = int(self.cursor[source, 0])
        S = int(self.limits[source])
        while self.deficit[source] > 0:
            epoch, fpos, bpos, pos, offset = (int(x) for x in self.cursor[source])
            meta = self.block_meta(source, (epoch, fpos, bpos))
            first = int(np.searchsorted(meta.positions, pos))
            remaining = meta.lengths[first:].astype(np.int64)
            if offset:
                if not len(remaining) or int(meta.positions[first]) != pos or offset >= remaining[0]:
                    raise PlaitError(
                        f"source {self.spec.sources[source].name!r}: the data state points {offset} tokens into "
                        f"document {pos} of block {(epoch, fpos, bpos)}, which that block does not hold")
                remaining[0] -= offset
            deficit = float(self.deficit[source])
            k = take_count(remaining, deficit)  # documents whose rest starts before the deficit is used up
            end = 0  # chunks taken of the last of them (0: the whole rest)
            if k:
                start = int(remaining[:k - 1].sum())
                rest = int(remaining[k - 1])
                if start + rest > deficit:  # the last one ends past the deficit: take its chunks that start before
                    m = int((deficit - start) // S)
                    end = m + (start + m * S < deficit)
                    if end * S >= rest:
                        end = 0
                sel = np.arange(first, first + k)
                items = self._docs_to_items(meta, sel, offset, end, S, int(self.grains[source]))
                parts.append(items)
                taken = int(items.length.sum())
                got += taken
                self.deficit[source] -= taken
                self.drawn[source] += taken
            if end:
                self.cursor[source, 3:] = (meta.positions[first + k - 1], (offset if k == 1 else 0) + end * S)
            elif first + k < len(meta.positions):
                self.cursor[source, 3:] = (meta.positions[first + k], 0)
            else:
                self.cursor[source] = (*meta.next_key, 0, 0)
                self._meta.pop(source, None)
                if not got and self.cursor[source, 0] > start_epoch + 1:
                    name = self.spec.sources[source].name
                    raise SourceError(name, None, None, "no readable, non-empty documents in a whole epoch")
        self._warn_repeats(source, int(self.cursor[source, 0]) - start_epoch, got, step)
        return Items.concat(parts)

    def _warn_repeats(self, source: int, epochs: int, tokens: int, step: int) -> None:
        """A source read whole more than once in one draw is smaller than its share of a step (e.g. a
        seq_len above its total tokens): the step repeats its documents. Said once per source."""
        if epochs < 2 or source in self.repeat_warned:
            return
        self.repeat_warned.add(source)
        log.warning(
            "source %r was read whole (at least %d time(s)) for step %d (%d tokens drawn from it): it holds fewer tokens than "
            "its share of one step, so the step repeats its documents; add data, lower its weight, or lower "
            "packing.seq_len / microbatches", self.spec.sources[source].name, epochs - 1, step, tokens)

    def block_meta(self, source: int, key: tuple[int, int, int]):
        """The metadata of the block at `key` (the last one asked of each source is kept)."""
        meta = self._meta.get(source)
        if meta is None or tuple(meta.key) != key:
            meta = self.provider.block_meta(source, key)
            self._meta[source] = meta
        return meta

    def _docs_to_items(self, meta, sel: np.ndarray, offset: int, end: int, S: int, grain: int) -> Items:
        """Chunks of at most S tokens of the documents `sel`: the first one from `offset` tokens in (its
        earlier chunks were drawn in earlier steps); of the last one only its first `end` chunks when end > 0.
        Chunk numbers: ceil(offset / grain) (packing_phases.py)."""
        lengths = meta.lengths[sel].astype(np.int64)
        skip = np.zeros(len(sel), dtype=np.int64)
        skip[:1] = offset
        # Offsets are exact token counts; chunk numbers continue the document's (rounded up, so that a
        # state resumed with a smaller seq_len cannot reuse a number already delivered).
        nchunks = -(-(lengths - skip) // S)
        if end:
            nchunks[-1] = end
        nonempty = lengths > 0
        self.empty_docs += int((~nonempty).sum())
        sel, lengths, skip, nchunks = (a[nonempty] for a in (sel, lengths, skip, nchunks))
        doc = np.repeat(np.arange(len(sel)), nchunks)
        j = np.arange(len(doc)) - np.repeat(np.cumsum(nchunks) - nchunks, nchunks)  # chunk within this draw
        offsets = skip[doc] + j * S
        chunk = -(-offsets // grain)
        length = np.minimum(S, lengths[doc] - offsets)
        m = len(doc)

        def full(v: int) -> np.ndarray:
            return np.full(m, v, dtype=np.int64)

        epoch, fpos, bpos = meta.key
        patches = getattr(meta, "patches", None)  # a document with images is never cut: one chunk
        image_columns = {} if patches is None else {
            "patches": patches[sel][doc].astype(np.int64), "patches_sq": meta.patches_sq[sel][doc].astype(np.int64)}
        audio = getattr(meta, "audio", None)  # [docs, 3]: spans, squared spans, placeholder tokens
        if audio is not None:
            image_columns.update(zip(ITEM_AUDIO_COLUMNS, audio[sel][doc].astype(np.int64).T))
        return Items(
            source=full(meta.source), epoch=full(epoch), fpos=full(fpos), bpos=full(bpos),
            position=meta.positions[sel][doc].astype(np.int64), shard=full(meta.shard),
            row=meta.rows[sel][doc].astype(np.int64), chunk=chunk.astype(np.int64), offset=offsets.astype(np.int64),
            length=length.astype(np.int64), delayed=full(0), **image_columns,
        )

    def source_states(self, fingerprints: list[str]) -> dict:
        """The data state's "sources" section: per source name its cursor, deficit, tokens drawn and
        fingerprint (what decides its order)."""
        return {s.name: {"cursor": self.cursor[i].tolist(), "deficit": float(self.deficit[i]), "drawn": int(self.drawn[i]),
                         "fingerprint": fingerprints[i]}
                for i, s in enumerate(self.spec.sources)}

    def load_source_states(self, sources: dict) -> None:
        """Continue from a (validated) data state's "sources" section; the kept block metadata is dropped."""
        for i, s in enumerate(self.spec.sources):
            src = sources[s.name]
            cursor = list(src["cursor"])
            self.cursor[i] = cursor + [0] * (5 - len(cursor))  # states before chunk-level drawing: 4 fields
            self.deficit[i] = src["deficit"]
            self.drawn[i] = src["drawn"]
        self._meta.clear()

    def cursor_blocks(self) -> set[tuple[int, int, int, int]]:
        """(source, epoch, file_pos, block_pos) of every cursor: the blocks the next draws read from."""
        return {(i, *map(int, self.cursor[i, :3])) for i in range(len(self.spec.sources))}

    def check_cursors(self) -> None:
        """Every cursor must name a block of its source and a document in it (a tampered or foreign
        state would otherwise fail later, or silently read elsewhere)."""
        for i, s in enumerate(self.spec.sources):
            epoch, fpos, bpos, pos, offset = (int(x) for x in self.cursor[i])
            try:
                meta = self.block_meta(i, (epoch, fpos, bpos))
            except (IndexError, KeyError, ValueError) as e:
                raise PlaitError(
                    f"the data state's cursor of source {s.name!r} (file {fpos}, block {bpos}) is outside the "
                    f"source ({type(e).__name__}: {e}); the state was edited or belongs to other data"
                ) from None
            ends = meta.positions
            if pos > (int(ends[-1]) if len(ends) else 0) or (offset and pos not in set(ends.tolist())):
                raise PlaitError(
                    f"the data state's cursor of source {s.name!r} points at document {pos} (offset {offset}), "
                    "which its block does not hold; the state was edited or belongs to other data"
                )
