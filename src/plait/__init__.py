"""plait: compute-balanced, padding-free, exactly-once data loading from many sources."""

from plait.batch import Batch
from plait.client import DistributedCheckpoint, Loader
from plait.errors import PlaitError, SourceError, SpecError
from plait.spec import Spec, load_spec

__version__ = "0.1.0"
__all__ = ["Batch", "DistributedCheckpoint", "Loader", "PlaitError", "SourceError", "Spec", "SpecError", "load_spec", "__version__"]
