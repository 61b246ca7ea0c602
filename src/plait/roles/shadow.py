"""Shadow: a standby SourceLoader that follows its primary and takes over when it dies.

While standing by, a Shadow applies its primary's deltas (plait.state.deltas) in order: it learns which
blocks the primary buffers and which of their samples were already served. If `warm`, it decodes the
newly buffered blocks as they are announced, so it holds the same ready samples as its primary, one
delta interval behind; otherwise it keeps only their keys.

Takeover (`promote`) needs no help from the dead primary. Reading is deterministic (a block is
re-decodable from its key), so the shadow re-reads exactly the blocks that were buffered and still
hold samples not yet delivered and that it does not already hold, then serves `block_meta` and
`gather` like any SourceLoader. Anything the primary read after its last delta is read again on demand
by the same rule. The stream does not change: which bytes a sample id names never depends on who reads
them.
"""

from __future__ import annotations

import time

from plait.state.deltas import FollowerView
from plait.roles.source_loader import SourceLoader
from plait.spec import Spec


MAX_EARLY_DELTAS = 32  # deltas held while waiting for a missing one


class ShadowLoader(SourceLoader):
    def __init__(
        self, spec: Spec, source_indices: list[int] | None = None, max_cached_blocks: int = 256, *,
        primary: str | None = None, warm: bool = True, **loader_options,
    ):
        super().__init__(spec, source_indices, max_cached_blocks, **loader_options)
        from plait.kernels import warm_up

        warm_up()  # a standby must serve at full speed the moment it takes over: compile kernels now
        self.primary = primary or "loader[" + ",".join(str(i) for i in self.sources) + "]"
        self.view = FollowerView(name=self.primary)
        self.warm = warm
        self.standby = True
        self.deltas_applied = 0
        self.delta_bytes = 0
        self.blocks_prefetched = 0
        self._early: dict[int, dict] = {}
        self.resyncs = 0

    # ----- standby ---------------------------------------------------------------------------------
    @property
    def early_deltas(self) -> int:
        """Deltas received ahead of a missing one, held until it arrives (bounded by MAX_EARLY_DELTAS)."""
        return len(self._early)

    def follow(self, delta: dict) -> int:
        """Apply the primary's next delta; returns the number of blocks now buffered here.

        Deltas that arrive early (a runtime may deliver them out of order) wait for their turn; stale
        ones (already covered by a snapshot) are ignored."""
        from plait.state.log import nbytes

        self.delta_bytes += nbytes(delta)
        if delta["seq"] <= self.view.seq:
            return len(self._blocks)
        self._early[delta["seq"]] = delta
        while self.view.seq + 1 in self._early:
            self._apply(self.view.apply(self._early.pop(self.view.seq + 1)))
            self.deltas_applied += 1
        if len(self._early) > MAX_EARLY_DELTAS:
            # A delta never came (lost in transit): stop waiting for it, bounded memory first. Apply the
            # rest past the gap; the view may miss blocks of the lost delta (re-read on demand at
            # takeover, still exact) until the runtime sends a snapshot (`sync`).
            for seq in sorted(self._early):
                self.view.seq = seq - 1
                self._apply(self.view.apply(self._early.pop(seq)))
                self.deltas_applied += 1
            self.resyncs += 1
        return len(self._blocks)

    def sync(self, snapshot: dict) -> int:
        """Start following from the primary's snapshot (a shadow started after the primary)."""
        self._early = {s: d for s, d in self._early.items() if s > snapshot["seq"]}
        self._apply(self.view.sync(snapshot))
        while self.view.seq + 1 in self._early:
            self._apply(self.view.apply(self._early.pop(self.view.seq + 1)))
        return len(self._blocks)

    def _apply(self, change) -> None:
        added, dropped = change
        for k in dropped:
            self._blocks.pop(k, None)
        if self.warm:
            for k in added:
                if k not in self._blocks and self._mine(k):
                    self.block(k[0], k[1:])
                    self.blocks_prefetched += 1

    def pending_blocks(self) -> list:
        """Blocks the primary buffered at its last delta: they hold the samples not yet consumed (or the
        Planner still reads them). Exactly these are re-read on takeover, less what is already here."""
        return sorted(k for k in self.view.buffered if self._mine(k))

    def pending_samples(self) -> int:
        """Buffered samples (document chunks) not yet served, over the blocks held here."""
        n = 0
        for k in self.pending_blocks():
            block = self._blocks.get(k)
            if block is not None:
                n += max(0, len(block.positions) - len(self.view.served.get(k, ())))
        return n

    # ----- takeover --------------------------------------------------------------------------------
    def promote(self) -> dict:
        """Become the primary: read what is buffered-but-undelivered and not yet here; serve from now on."""
        t0 = time.perf_counter()
        missing = [k for k in self.pending_blocks() if k not in self._blocks]
        for k in missing:
            self.block(k[0], k[1:])
        self.standby = False
        # Continue the primary's delta sequence so followers of the new primary see one stream.
        tracker = self.delta_tracker
        tracker.name = self.primary
        tracker.seq = self.view.seq + 1
        tracker.reported_blocks = set(self.view.buffered)
        tracker.read = dict(self.view.read)
        tracker.active = True
        return {
            "primary": self.primary,
            "reread_blocks": len(missing),
            "held_blocks": len(self._blocks),
            "deltas_applied": self.deltas_applied,
            "seconds": time.perf_counter() - t0,
        }

    def _mine(self, key) -> bool:
        if key[0] not in self.sources:
            return False
        owns = getattr(self, "owns", None)
        return owns(key[0], tuple(key[1:])) if owns is not None and getattr(self, "partitions", None) else True
