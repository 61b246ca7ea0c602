"""Scaling: measuring what each source costs to preprocess, and reporting the loader layout.

  * `probe_costs` measures each source's preprocessing cost, in seconds per token (read + decode +
    tokenize, and the decode of its media: images, videos, audio clips), by reading its first blocks
    through the same `plait.sources.Source` a loader uses.
  * `describe` / `format_layout` report a `LoaderLayout` (one row per loader) for the CLI and the logs.

The decision itself (demand per source -> loaders and partitions, and which loader owns which block) is
plait.runtime.placement: the measurement is kept apart from the pure function it feeds. Only the
*layout* depends on the measurement (timings vary from run to run); the data stream never does.
"""

from __future__ import annotations

import math
import time

import numpy as np
from collections.abc import Sequence

from plait.runtime.placement import LoaderLayout
from plait.spec import Spec


def probe_costs(spec: Spec, sources: Sequence[int] | None = None, *, min_tokens: int = 16384,
                max_blocks: int = 4, budget_s: float = 2.0) -> tuple[list[float], list[int]]:
    """(seconds per token, number of files) per source, from reading its first blocks (and, for a media
    source, decoding the images, videos and audio clips they hold: what its loader does for each delivered
    sample; the block read alone takes sizes and durations from headers and would make a photo or speech
    source look as cheap as text).

    Each source reads at least two blocks (the first one warms the reader and tokenizer up and is not
    timed unless it is the only one), then more until `min_tokens` tokens were timed, `max_blocks`
    blocks were read or its slice of `budget_s` is spent. A source that reads zero tokens costs its
    time per record instead (never zero). The probe reads through its own Source objects: the loaders'
    error counts and caches are untouched.
    """
    from plait.sources import Source

    idx = list(range(len(spec.sources))) if sources is None else list(sources)
    per_source = budget_s / max(1, len(idx))
    costs, files = [], []
    for i in idx:
        src = Source.of_job(spec, i)
        try:
            files.append(len(src.files))
            key = src.first_key()
            timed_s, timed_tok, blocks = 0.0, 0, 0
            first_s, first_tok = 0.0, 0
            start = time.perf_counter()
            while blocks < max_blocks:
                t0 = time.perf_counter()
                block = src.read_block(key)
                dt = time.perf_counter() - t0 + media_seconds(src, block)
                tok = int(block.lengths.sum()) or max(1, int(block.num_positions))
                if blocks == 0:
                    first_s, first_tok = dt, tok
                else:
                    timed_s, timed_tok = timed_s + dt, timed_tok + tok
                blocks += 1
                spent = time.perf_counter() - start
                if blocks >= 2 and (timed_tok >= min_tokens or spent >= per_source):
                    break
                if blocks == 1 and spent >= per_source:
                    break
                key = src.next_key(key)
            costs.append(timed_s / timed_tok if timed_tok else first_s / max(1, first_tok))
        finally:
            src.close()
    # The probe's blocks are garbage now; hand their memory back (Arrow's allocator keeps freed pages
    # otherwise, and the Planner process that probes lives as long as the job).
    import gc

    import pyarrow as pa

    gc.collect()
    pa.default_memory_pool().release_unused()
    return costs, files


PROBE_MEDIA = 16  # media decoded per probed block (evenly spaced); the rest are extrapolated


def media_seconds(src, block) -> float:
    """Seconds to decode every medium of a block (images to patches, videos' sampled frames, audio clips
    to log-mel features), as a loader's gather does for delivered documents: measured on up to PROBE_MEDIA
    of them (evenly spaced), scaled to all. 0.0 for text."""
    table = getattr(block, "images", None)
    count = 0 if table is None or src.images is None else len(table.grid)
    if count == 0:
        return 0.0
    sample = np.unique(np.linspace(0, count - 1, min(count, PROBE_MEDIA)).astype(np.int64))
    t0 = time.perf_counter()
    for j in sample:
        src.image_pixels(block, int(j))
    return (time.perf_counter() - t0) * count / len(sample)


def describe(layout: LoaderLayout, names: Sequence[str], limit: int = 6) -> list[dict]:
    """One row per loader: its sources (`name[partitions/of]` when split, then the measured µs per 1k
    tokens when measured), the range of those costs, and the loader's demand in cores."""
    rows = []
    for k, owned in enumerate(layout.owned):
        parts: dict[int, list[int]] = {}
        for s, p in owned:
            parts.setdefault(s, []).append(p)
        items = []
        for s, ps in parts.items():
            n = layout.num_partitions[s]
            item = names[s] if n == 1 else f"{names[s]}[{','.join(map(str, ps))}/{n}]"
            items.append(f"{item} ({layout.cost[s] * 1e9:.0f})" if layout.cost else item)
        text = ", ".join(items[:limit]) + (f", … (+{len(items) - limit})" if len(items) > limit else "")
        cost = [layout.cost[s] * 1e9 for s in parts] if layout.cost else []
        us = (f"{min(cost):.1f}" if len(cost) == 1 or min(cost) == max(cost) else f"{min(cost):.1f}–{max(cost):.1f}"
              ) if cost else "-"
        rows.append({"loader": k, "sources": text, "pairs": len(owned), "us_per_1k_tokens": us,
                     "demand": layout.loader_demand(k)})
    return rows


def format_layout(layout: LoaderLayout, names: Sequence[str]) -> list[str]:
    """The decision as log lines, one per loader."""
    out = []
    for r in describe(layout, names):
        dem = "" if math.isnan(r["demand"]) else f" (µs per 1k tokens); demand {r['demand']:.3f} cores"
        out.append(f"loader-{r['loader']}: {r['sources']}{dem}")
    return out
