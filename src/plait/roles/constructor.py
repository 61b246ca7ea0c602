"""Constructor: turns one DP rank's share of a step plan into packed micro-batches.

It pulls each micro-batch's payload from the SourceLoaders in one gather per block, then computes the
padding-free fields (packing.py). TP/PP ranks of a replica share the result; CP ranks take a shard.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from plait.batch import MicroBatch
from plait.packing import pack_fields, ragged_arange
from plait.plan import Items, RankPlan


class PayloadSource(Protocol):
    """Where a Constructor gets token payloads: `fetch(items)` returns their tokens, concatenated."""

    def fetch(self, items: Items) -> np.ndarray: ...


class LoaderPayloads:
    """Payloads gathered from SourceLoader objects in this process (one loader per source or shared)."""

    def __init__(self, loader_for: Callable[[int], object]):
        self._loader_for = loader_for

    def fetch(self, items: Items) -> np.ndarray:
        if not len(items):
            return np.zeros(0, dtype=np.int32)
        keys, block_index = items.block_keys()
        # Group by owning loader; locally that is a single call.
        by_loader: dict[int, list[int]] = {}
        for b, key in enumerate(keys):
            by_loader.setdefault(id(self._loader_for(key[0])), []).append(b)
        if len(by_loader) == 1:
            loader = self._loader_for(keys[0][0])
            return loader.gather(items.source, keys, block_index, items.position, items.offset, items.length)
        out = np.empty(int(items.length.sum()), dtype=np.int32)
        starts = np.cumsum(items.length) - items.length
        for blocks in by_loader.values():
            sel = np.flatnonzero(np.isin(block_index, blocks))
            loader = self._loader_for(keys[blocks[0]][0])
            part = loader.gather(items.source[sel], keys, block_index[sel], items.position[sel], items.offset[sel], items.length[sel])
            out[ragged_arange(starts[sel], items.length[sel])] = part
        return out


class Constructor:
    def __init__(self, payloads: PayloadSource):
        self.payloads = payloads

    def build(self, plan: RankPlan, only: set[int] | None = None) -> list[MicroBatch]:
        micros = [m for m in range(plan.microbatches) if only is None or m in only]
        if not micros:
            return []
        # One fetch for all wanted micro-batches of the rank, ordered by micro-batch, then split.
        sel = np.flatnonzero(np.isin(plan.micro, micros)) if only is not None else np.arange(len(plan.micro))
        sel = sel[np.argsort(plan.micro[sel], kind="stable")]
        items = plan.items.take(sel)
        tokens = self.payloads.fetch(items)
        # Positions and labels for the whole rank in one pass; every micro-batch boundary is also a
        # document boundary, so each micro-batch is a slice.
        fields = pack_fields(tokens, items.length)
        cu_all, positions, labels = fields["cu_seqlens"], fields["position_ids"], fields["labels"]
        counts = np.bincount(plan.micro[sel], minlength=plan.microbatches)
        item_bounds = np.concatenate([[0], np.cumsum(counts)])
        sample_ids = items.sample_ids()
        source_ids = items.source.astype(np.int32)
        stats = plan.stats
        out = []
        for m in micros:
            a, b = item_bounds[m], item_bounds[m + 1]
            t0, t1 = cu_all[a], cu_all[b]
            out.append(
                MicroBatch(
                    step=plan.step, microbatch=m, num_microbatches=plan.microbatches, dp_rank=plan.dp_rank,
                    input_ids=tokens[t0:t1], labels=labels[t0:t1], position_ids=positions[t0:t1],
                    cu_seqlens=cu_all[a : b + 1] - t0, sample_ids=sample_ids[a:b], source_ids=source_ids[a:b],
                    stats=stats,
                )
            )
        return out
