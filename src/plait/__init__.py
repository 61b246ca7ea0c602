"""plait: compute-balanced, padding-free, exactly-once data loading from many sources.

The names below load on first use (PEP 562 module __getattr__): a trainer that reads its node's batches
from shared memory (plait.runtime.node_shm) imports numpy and the client, never pyarrow or the sources.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_HOMES = {
    "Batch": "plait.batch",
    "DistributedCheckpoint": "plait.client",
    "Loader": "plait.client",
    "PlaitError": "plait.errors",
    "SourceError": "plait.errors",
    "SpecError": "plait.errors",
    "Spec": "plait.spec",
    "load_spec": "plait.spec",
}
__all__ = [*_HOMES, "__version__"]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ loads them
    from plait.batch import Batch
    from plait.client import DistributedCheckpoint, Loader
    from plait.errors import PlaitError, SourceError, SpecError
    from plait.spec import Spec, load_spec


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'plait' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # loaded once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
