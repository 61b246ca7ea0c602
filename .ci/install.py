"""`python .ci/install.py VENV ARGS...`: `pip install ARGS` into the virtual environment VENV, done by uv.

uv downloads and unpacks in parallel where pip goes one package after the other: a fresh install of
plait's development environment took 26 s with uv against 65 s with pip on the same machine
(benchmarks/reports/2026-12-06-ci-time.md). uv does not read pip's configuration, so the indexes pip is
configured with (`pip config list`: index-url, extra-index-url, find-links) are given to it, and it may
take each package from whichever of them has the best match, as pip does. Where uv cannot be installed
(no network to PyPI, an odd platform), pip installs as before.

Files are hard-linked from uv's cache into the venv (uv's default on Linux; where the cache is on another
file system uv copies instead, and says so). Copying them (`--link-mode copy`, ~1.5 GiB: torch, Ray,
pyarrow) made the install 42 s instead of 13 on this machine, 27-35 s of it system CPU (2026-12-06
report). Nothing writes into an installed file: Python's bytecode goes to new files beside them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CONSTRAINTS = str(Path(__file__).resolve().parents[1] / "constraints-dev.txt")  # uv's version among them
OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}


def pip_indexes(pip: str) -> list[str]:
    """uv's options for the indexes pip is configured with (global, user, site and environment alike)."""
    listed = subprocess.run([pip, "config", "list"], capture_output=True, text=True).stdout
    args: list[str] = []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        option = OPTIONS.get(key.rsplit(".", 1)[-1])
        if option:
            for item in value.strip().strip("'\"").split():
                args += [option, item]
    return args


def main(venv: str, args: list[str]) -> int:
    bin_dir = Path(venv) / "bin"
    pip, uv = str(bin_dir / "pip"), bin_dir / "uv"
    if not uv.exists() and subprocess.run([pip, "install", "-q", "-c", CONSTRAINTS, "uv"]).returncode != 0:
        print("uv could not be installed: pip installs instead", file=sys.stderr)
        # a current pip first: it resolves against the constraints in seconds where pip 23 takes a minute
        subprocess.run([pip, "install", "-q", "--upgrade", "pip"])
        return subprocess.run([pip, "install", "--no-compile", *args]).returncode
    command = [str(uv), "pip", "install", "--python", str(bin_dir / "python"), "--index-strategy",
               "unsafe-best-match", "--link-mode", "hardlink", *pip_indexes(pip), *args]
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
