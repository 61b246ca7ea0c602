"""Exactly-once, checked by sample ids: what a stream that met failures delivered against a reference.

A sample id is the int64 row (source, epoch, shard, row, chunk) that names every delivered chunk
(MicroBatch.sample_ids, StepPlan.sample_ids). A run with killed loaders, a Planner takeover or a rescale must deliver the same ids
as an undisturbed run: none lost, none twice, and in the same order where the layout did not change.
The chaos tests and the recovery benchmarks share these two helpers: the comparison, and the seeded
steps at which to inject the failures.
"""

from __future__ import annotations

import numpy as np


def compare_streams(reference: list[np.ndarray], observed: list[np.ndarray]) -> dict:
    """lost / duplicated / same order between two streams of sample-id arrays ([n, 5] each).

    "duplicated" counts ids delivered more than once and ids the reference never delivered (a sample
    from elsewhere is as wrong as a second copy)."""
    ref = np.concatenate(reference) if reference else np.zeros((0, 5), np.int64)
    got = np.concatenate(observed) if observed else np.zeros((0, 5), np.int64)
    ref_set = {tuple(r) for r in ref.tolist()}
    got_list = [tuple(r) for r in got.tolist()]
    got_set = set(got_list)
    return {"delivered": len(got_list), "lost": len(ref_set - got_set),
            "duplicated": len(got_list) - len(got_set) + len(got_set - ref_set),
            "same_order": bool(ref.shape == got.shape and np.array_equal(ref, got))}


def kill_points(steps: int, failures: int, seed: int, num_loaders: int) -> dict[int, int]:
    """step -> loader (source) index to kill at that step: seeded, distinct steps, not the first two."""
    rng = np.random.default_rng(seed)
    at = sorted(rng.choice(np.arange(2, max(3, steps - 1)), size=min(failures, max(1, steps - 3)), replace=False).tolist())
    first = int(rng.integers(num_loaders))
    return {int(s): (first + j) % num_loaders for j, s in enumerate(at)}
