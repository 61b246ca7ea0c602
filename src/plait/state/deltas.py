"""Loader deltas: what one SourceLoader changed since its previous delta, for its Shadow to follow.

A delta holds how far the loader has read in each source (cursor moves), which blocks it started or
stopped buffering, and which samples it served (so a follower knows which buffered samples are not yet
consumed). A Shadow applies the deltas in order and therefore holds the same buffer as its primary;
reading is deterministic (a block is re-decodable from its key), so whatever the shadow missed since the
last delta it simply reads again. Deltas are JSON-serialisable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FullKey = tuple[int, int, int, int]  # (source, epoch, file_pos, block_pos)
DELTA_VERSION = 1


def _ranges(sorted_positions: np.ndarray) -> list[int]:
    """[a0, b0, a1, b1, ...]: half-open runs of consecutive integers."""
    if not len(sorted_positions):
        return []
    p = np.asarray(sorted_positions, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(p) != 1) + 1
    starts = p[np.concatenate([[0], breaks])]
    ends = p[np.concatenate([breaks - 1, [len(p) - 1]])] + 1
    return np.stack([starts, ends], axis=1).reshape(-1).tolist()


def _unranges(flat: list[int]) -> np.ndarray:
    if not flat:
        return np.zeros(0, dtype=np.int64)
    a = np.asarray(flat, dtype=np.int64).reshape(-1, 2)
    return np.concatenate([np.arange(s, e) for s, e in a])


@dataclass
class DeltaTracker:
    """Kept by a SourceLoader: accumulates what changed since the last delta it emitted."""

    name: str = "loader"
    seq: int = 0
    reported_blocks: set = field(default_factory=set)
    read: dict = field(default_factory=dict)  # source -> furthest block key read, as last reported
    _served: dict = field(default_factory=dict)  # FullKey -> list of (positions, chunks) arrays
    # Nothing is recorded until someone follows (the first take or snapshot): a loader without
    # shadows must not accumulate served ids forever.
    active: bool = False

    @property
    def pending_served(self) -> int:
        """Blocks with served samples not yet shipped in a delta (0 when nobody takes deltas)."""
        return len(self._served)

    def note_served(self, keys: list, block_index: np.ndarray, position: np.ndarray, chunk: np.ndarray) -> None:
        if not self.active:
            return
        block_index = np.asarray(block_index)
        for b in np.unique(block_index):
            sel = block_index == b
            self._served.setdefault(tuple(int(x) for x in keys[int(b)]), []).append(
                (np.asarray(position)[sel].astype(np.int64), np.asarray(chunk)[sel].astype(np.int64))
            )

    def snapshot(self, buffered: set, step: int | None = None) -> dict:
        """Everything buffered now, as a delta a new follower applies first (`FollowerView.sync`).

        It carries the number of the last delta taken: the next `take` follows it. Applying deltas is
        idempotent for blocks (sets), so overlap between the snapshot and the next delta is harmless."""
        self.active = True
        return {"v": DELTA_VERSION, "loader": self.name, "seq": self.seq - 1, "step": step,
                "read": {str(s): list(k) for s, k in sorted(self.read.items())},
                "add": sorted(list(map(int, k)) for k in buffered), "drop": [], "served": []}

    def take(self, buffered: set, step: int | None = None) -> dict:
        """The delta since the previous take, and start a new interval."""
        self.active = True
        buffered = {tuple(int(x) for x in k) for k in buffered}
        added = sorted(buffered - self.reported_blocks)
        dropped = sorted(self.reported_blocks - buffered)
        moved = {}
        for k in added:  # the read cursor: the furthest block of each source read so far
            s, key = k[0], k[1:]
            if key > moved.get(s, self.read.get(s, (-1, -1, -1))):
                moved[s] = key
        self.read.update(moved)
        served = []
        for key in sorted(self._served):
            pos = np.concatenate([p for p, _ in self._served[key]])
            chk = np.concatenate([c for _, c in self._served[key]])
            first = np.unique(pos[chk == 0])
            later = np.unique(np.stack([pos[chk > 0], chk[chk > 0]], axis=1), axis=0) if (chk > 0).any() else np.zeros((0, 2), np.int64)
            served.append([list(key), _ranges(first), later.reshape(-1).tolist()])
        delta = {
            "v": DELTA_VERSION,
            "loader": self.name,
            "seq": self.seq,
            "step": step,
            "read": {str(s): list(k) for s, k in sorted(moved.items())},
            "add": [list(k) for k in added],
            "drop": [list(k) for k in dropped],
            "served": served,
        }
        self.seq += 1
        self.reported_blocks = buffered
        self._served = {}
        return delta


@dataclass
class FollowerView:
    """What a follower (a Shadow, or the Planner's record) knows of one loader from its deltas."""

    name: str = "loader"
    seq: int = -1  # last applied delta
    read: dict = field(default_factory=dict)  # source -> furthest block key read
    buffered: set = field(default_factory=set)  # FullKeys the primary buffers
    served: dict = field(default_factory=dict)  # FullKey -> set of (position, chunk) consumed

    def sync(self, snapshot: dict) -> tuple[list[FullKey], list[FullKey]]:
        """Start following from a snapshot (a new follower, or one that fell behind)."""
        self.seq = snapshot["seq"] - 1
        added, _ = self.apply(snapshot)
        dropped = sorted(self.buffered - {tuple(k) for k in snapshot["add"]})
        self.buffered = {tuple(k) for k in snapshot["add"]}
        self.served = {k: v for k, v in self.served.items() if k in self.buffered}
        return added, dropped

    def apply(self, delta: dict) -> tuple[list[FullKey], list[FullKey]]:
        """Apply the next delta in order; returns (added, dropped) block keys."""
        if delta.get("v") != DELTA_VERSION:
            raise ValueError(f"loader delta version {delta.get('v')!r} is not supported")
        if delta["seq"] != self.seq + 1:
            raise ValueError(f"{self.name}: delta {delta['seq']} out of order (expected {self.seq + 1})")
        self.seq = delta["seq"]
        for s, k in delta["read"].items():
            self.read[int(s)] = tuple(k)
        added = [tuple(k) for k in delta["add"]]
        dropped = [tuple(k) for k in delta["drop"]]
        self.buffered.update(added)
        for k in dropped:
            self.buffered.discard(k)
            self.served.pop(k, None)
        for key, first, later in delta["served"]:
            key = tuple(key)
            if key not in self.buffered:
                continue  # served and dropped in the same interval
            s = self.served.setdefault(key, set())
            s.update((int(p), 0) for p in _unranges(first))
            s.update((int(later[i]), int(later[i + 1])) for i in range(0, len(later), 2))
        return added, dropped

    def served_count(self) -> int:
        return sum(len(v) for v in self.served.values())
