"""`python .ci/warm_kernels.py FOLDER`: compile plait's numba kernels into numba's on-disk cache, announced
in FOLDER so that a test session started meanwhile waits for this compile instead of starting its own.

The install starts it (FOLDER: the venv) as soon as numpy and numba are in, and does not wait for it: the
compile (~40 s of CPU on one core) runs on while the rest installs and while pytest starts, collects and
runs its first tests; the few test processes that compile wait for it (tests/conftest.py). A test session
that finds none running starts one itself (FOLDER: a temp folder of the session). Best effort: a failed
compile only costs that compile later.

Files in FOLDER: `numba-warmup.pid` (this process, while it compiles) and `numba-warmup.done` ("ok" or why
not, once it has finished).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PID_FILE, DONE_FILE = "numba-warmup.pid", "numba-warmup.done"


def main(folder: Path) -> int:
    done = folder / DONE_FILE
    done.unlink(missing_ok=True)
    (folder / PID_FILE).write_text(str(os.getpid()))
    try:
        from plait.balance.warmup import warmup
        from plait.kernels import warm_up

        warmup()
        warm_up()
        outcome = "ok"
    except BaseException as e:  # the tests then compile what they need themselves
        outcome = f"failed: {e!r}"
    written = folder / (DONE_FILE + ".tmp")
    written.write_text(outcome)
    os.replace(written, done)  # whole or absent, for a session that polls for it
    (folder / PID_FILE).unlink(missing_ok=True)
    print(outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
