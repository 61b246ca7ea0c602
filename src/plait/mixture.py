"""Mixture: token-share weights over steps, and the exact per-step quota of each source.

Quotas use error diffusion: each source carries a deficit = (tokens it should have had so far) -
(tokens drawn from it so far). A step adds weight * budget to every deficit and takes chunks (a document
of at most seq_len tokens is one chunk; a longer one is cut into chunks of seq_len) from a source while
the next chunk *starts* before the deficit is used up. The cumulative share therefore never drifts: at
any step each source is within one chunk (seq_len tokens) of its exact target, however long its
documents. No random draws.
"""

from __future__ import annotations

import numpy as np

from plait.spec import Spec


class MixtureSchedule:
    def __init__(self, spec: Spec):
        self.names = spec.source_names
        self.interpolation = spec.mixture.interpolation
        if spec.mixture.schedule:
            self.steps = np.array([p.step for p in spec.mixture.schedule], dtype=np.int64)
            self.table = np.array(
                [[p.weights.get(n, 0.0) for n in self.names] for p in spec.mixture.schedule], dtype=np.float64
            )
        else:
            self.steps = np.array([0], dtype=np.int64)
            self.table = np.array([[s.weight for s in spec.sources]], dtype=np.float64)

    def weights(self, step: int) -> np.ndarray:
        """Normalised weights at a step."""
        i = int(np.searchsorted(self.steps, step, side="right")) - 1
        w = self.table[i]
        if self.interpolation == "linear" and i + 1 < len(self.steps):
            t = (step - self.steps[i]) / (self.steps[i + 1] - self.steps[i])
            w = (1 - t) * w + t * self.table[i + 1]
        return w / w.sum()


def take_count(lengths: np.ndarray, deficit: float) -> int:
    """How many of the next documents (or chunks) to take: those that start before the deficit is used up.

    The Planner applies it to whole documents, then takes of the last one only its chunks that start
    before the deficit is used up."""
    if deficit <= 0 or len(lengths) == 0:
        return 0
    starts = np.cumsum(lengths) - lengths
    return int(np.searchsorted(starts, deficit, side="left"))
