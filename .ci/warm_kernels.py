"""`python .ci/warm_kernels.py VENV`: compile plait's numba kernels into numba's on-disk cache, announced in
VENV so that a test session started meanwhile waits for this compile instead of starting its own.

The install starts it as soon as numpy and numba are in, and does not wait for it: the compile (~40 s of
CPU on one core) runs on while the rest installs and while pytest starts and collects (~13 s of CPU in
each worker), and the tests' session waits for it before the first test (tests/conftest.py, which
otherwise compiles in a process of its own). Best effort: a failed compile only costs that compile later.

Files in VENV: `numba-warmup.pid` (this process, while it compiles) and `numba-warmup.done` ("ok" or why
not, once it has finished).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PID_FILE, DONE_FILE = "numba-warmup.pid", "numba-warmup.done"


def main(venv: Path) -> int:
    done = venv / DONE_FILE
    done.unlink(missing_ok=True)
    (venv / PID_FILE).write_text(str(os.getpid()))
    try:
        from plait.balance.warmup import warmup
        from plait.kernels import warm_up

        warmup()
        warm_up()
        outcome = "ok"
    except BaseException as e:  # the tests then compile what they need themselves
        outcome = f"failed: {e!r}"
    written = venv / (DONE_FILE + ".tmp")
    written.write_text(outcome)
    os.replace(written, done)  # whole or absent, for a session that polls for it
    (venv / PID_FILE).unlink(missing_ok=True)
    print(outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
