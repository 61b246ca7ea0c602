"""`--path` of `plait bench images` and `plait bench video`: the user's own files, found by folder or glob."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from plait.errors import PlaitError


def find_files(path: str, extensions: tuple[str, ...], limit: int, what: str) -> list[Path]:
    """The first `limit` files (sorted) under the folder `path` (recursively) or matching the glob `path`
    whose extension is one of `extensions`; a PlaitError naming `path` when there is none."""
    if os.path.isdir(path):
        found = (str(p) for p in Path(path).rglob("*"))
    else:
        found = glob.glob(os.path.expanduser(path), recursive=True)
    files = sorted(Path(f).resolve() for f in found
                   if os.path.isfile(f) and f.rsplit(".", 1)[-1].lower() in extensions)
    if not files:
        raise PlaitError(f"--path {path}: no {what} files there (extensions: {', '.join(extensions)})")
    return files[:limit]
