"""Who reads a shared job's stream and how far each has got: the lower edge of the plan window.

A consumer is one trainer's stream of one rank (a Flight client id, or its (dp, cp) rank for a client that
sends none). It is *live* while it reads: a consumer that joined with its process id (the node-shared data
plane: same node) is gone when it leaves or its process dies; one that never joined (a remote trainer of
`plait serve`) when it leaves or has not asked for anything for `silent_s` seconds. A consumer past its last
step (the ticket's `limit`) holds nothing back. Being slow never makes a consumer gone: the window waits
for it (job.window).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Ask:
    """Who asks for a step: `reader` (a Flight client id, or its ranks), its DP and CP rank, the build it
    reads (`rank`: job.cp_builds.served_rank) and its last step + 1 (`limit`, None: no end)."""

    reader: str
    dp_rank: int
    cp_rank: int
    rank: int
    limit: int | None = None

SILENT_S = 600.0  # a consumer that never joined and has not asked for this long is taken for gone


@dataclass
class Consumer:
    key: str
    dp_rank: int = -1
    cp_rank: int = 0
    rank: int = -1  # the build it reads (its DP rank; its pool rank with dynamic CP)
    gen: int = -1
    step: int = -1  # the step it asked for last (it may still ask for it again: other CP ranks, retries)
    done: bool = False  # asked for its last step (the ticket's limit)
    pid: int | None = None
    seen: float = field(default_factory=time.monotonic)

    def describe(self) -> str:
        if self.dp_rank < 0:
            return f"trainer process {self.pid} (joined, has not asked for a step yet)"
        who = f"DP rank {self.dp_rank}"
        if self.cp_rank:
            who += f" (CP rank {self.cp_rank})"
        return who + (f", pid {self.pid}" if self.pid is not None else "")


class Consumers:
    """The trainer processes that joined (`join` / `leave` by client id and process id) and the stream
    position of every consumer. `expected`: processes that will join (a node's LOCAL_WORLD_SIZE); until
    they have, or `grace_s` passed, the ones missing count as reading from the start. One of the plan
    stream's reader policies (job.plan_stream.Readers)."""

    def __init__(self, expected: int = 0, grace_s: float = 60.0, silent_s: float = SILENT_S,
                 every_rank_reads: bool = False):
        self.every_rank_reads = every_rank_reads
        self.lock = threading.Lock()
        self.pids: dict[str, int] = {}  # client id -> process id, while joined
        self.seen: set[int] = set()  # every process that ever joined
        self.readers: dict[str, Consumer] = {}
        self.expected, self.silent_s = int(expected), float(silent_s)
        self.grace_until = time.monotonic() + grace_s

    # ----- processes (same node) ----------------------------------------------------------------------
    def join(self, client: str, pid: int) -> None:
        with self.lock:
            self.pids[str(client)] = int(pid)
            self.seen.add(int(pid))
            self.readers.setdefault(str(client), Consumer(str(client))).pid = int(pid)

    def leave(self, client: str) -> None:
        with self.lock:
            self.pids.pop(str(client), None)
            self.readers.pop(str(client), None)

    def live(self, exclude_pid: int | None = None) -> int:
        """Joined clients whose process still runs (the others are forgotten), those of `exclude_pid` aside."""
        with self.lock:
            self._forget_gone()
            return sum(1 for pid in self.pids.values() if pid != exclude_pid)

    def joined_processes(self) -> int:
        with self.lock:
            return len(self.seen)

    # ----- stream positions ---------------------------------------------------------------------------
    def asked(self, ask: Ask, gen: int, step: int) -> None:
        """A consumer asked for `step` of generation `gen`."""
        with self.lock:
            c = self.readers.setdefault(ask.reader, Consumer(ask.reader))
            c.dp_rank, c.cp_rank, c.rank, c.gen, c.step = ask.dp_rank, ask.cp_rank, ask.rank, gen, step
            c.done = ask.limit is not None and step >= int(ask.limit) - 1
            c.seen = time.monotonic()

    def built(self, gen: int, step: int, rank: int) -> None:
        """Builds say nothing here: a consumer's position is what it asked for."""

    def reading(self, gen: int) -> set[int] | None:
        """The builds (DP ranks, pool ranks with dynamic CP) that live consumers of `gen` still read: a
        step's blocks are kept until these have built it. A rank nobody reads (not joined, gone, past its
        last step) pins nothing: should it read later, its build reads the blocks again. None: every rank
        (`every_rank_reads`: one process reads all ranks by construction; or a process of the node is about
        to read, ranks unknown yet: it joined and has not asked, or is expected and its grace lasts)."""
        if self.every_rank_reads:
            return None
        with self.lock:
            self._forget_gone()
            if self.expected > len(self.seen) and time.monotonic() < self.grace_until:
                return None
            if any(c.rank < 0 for c in self.readers.values()):
                return None
            return {c.rank for c in self.readers.values() if c.gen == gen and not c.done}

    def slowest(self, gen: int, base_step: int) -> tuple[int | None, str]:
        """(the lowest step a live consumer of generation `gen` may still ask for, who that is), or
        (None, "") when nobody holds the stream back. A consumer of another generation, or one not yet
        reading, starts from the generation's base step."""
        with self.lock:
            self._forget_gone()
            low, who = None, ""
            missing = self.expected - len(self.seen)
            if missing > 0 and time.monotonic() < self.grace_until:
                low, who = base_step, f"{missing} process{'es' if missing > 1 else ''} of the node not joined yet"
            for c in self.readers.values():
                if c.done:  # past its last step (asked again after a seek, it counts again)
                    continue
                at = c.step if c.gen == gen else base_step
                if low is None or at < low:
                    low, who = at, c.describe()
            return low, who

    def positions(self) -> dict[str, dict]:
        with self.lock:
            return {c.describe(): {"gen": c.gen, "step": c.step, "done": c.done} for c in self.readers.values()}

    def _forget_gone(self) -> None:
        now = time.monotonic()
        for client, pid in list(self.pids.items()):
            if not process_alive(pid):
                del self.pids[client]
                self.readers.pop(client, None)
        for key, c in list(self.readers.items()):
            if c.pid is None and now - c.seen > self.silent_s:
                del self.readers[key]


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that id: alive
        return True
    return True


class RankProgress:
    """How far each DP rank's builds got, for a runtime that sees builds, not readers (the Ray Planner:
    its Constructors report each build); the plan stream's other reader policy. A rank holds the window back from its first build of a
    generation until it has built nothing for `silent_s` seconds."""

    def __init__(self, silent_s: float = SILENT_S):
        self.silent_s = float(silent_s)
        self.last: dict[int, tuple[int, int, float]] = {}  # DP rank -> (generation, highest step built, when)

    def join(self, client: str, pid: int) -> None:
        """Processes say nothing here: a Ray job's trainers attach to the job (plait.runtime.ray.jobs)."""

    def leave(self, client: str) -> None:
        """As `join`."""

    def asked(self, ask: Ask, gen: int, step: int) -> None:
        """Asks say nothing here: a rank's position is what it built."""

    def built(self, gen: int, step: int, dp_rank: int) -> None:
        g, s, _ = self.last.get(dp_rank, (gen, step, 0.0))
        self.last[dp_rank] = (gen, max(s, step) if g == gen else step, time.monotonic())

    def reading(self, gen: int) -> set[int] | None:
        """Every rank: a Ray job's Constructors build each step for all the ranks they serve."""
        return None

    def slowest(self, gen: int, base_step: int | None = None) -> tuple[int | None, str]:
        """(the highest step the slowest reading rank of `gen` has built, that rank), or (None, "")."""
        now, low, who = time.monotonic(), None, ""
        for rank, (g, s, t) in self.last.items():
            if g == gen and now - t <= self.silent_s and (low is None or s < low):
                low, who = s, f"DP rank {rank}"
        return low, who
