"""The trainer processes a one-process server knows of (same node): which joined, which are still alive.

Kept apart from the server (plait.runtime.serve_local) so that a trainer that only joins a node's data
plane (plait.runtime.node_share) imports none of the roles."""

from __future__ import annotations

import os
import threading


class Clients:
    """The trainer processes that joined this server (`join` / `leave`, by client id and process id): a
    node-shared local runtime (plait.runtime.node_share) serves until they are done. Same node only: a
    client counts as gone when its process is."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pids: dict[str, int] = {}  # client id -> process id, while joined
        self.seen: set[int] = set()  # every process that ever joined

    def join(self, client: str, pid: int) -> None:
        with self.lock:
            self.pids[str(client)] = int(pid)
            self.seen.add(int(pid))

    def leave(self, client: str) -> None:
        with self.lock:
            self.pids.pop(str(client), None)

    def live(self, exclude_pid: int | None = None) -> int:
        """Joined clients whose process still runs (the others are forgotten), those of `exclude_pid` aside."""
        with self.lock:
            for client, pid in list(self.pids.items()):
                if not process_alive(pid):
                    del self.pids[client]
            return sum(1 for pid in self.pids.values() if pid != exclude_pid)

    def joined_processes(self) -> int:
        with self.lock:
            return len(self.seen)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that id: alive
        return True
    return True
