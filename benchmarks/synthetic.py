"""Synthetic sources for `python -m benchmarks.scale`: block metadata without any file.

A `SyntheticSources` is a catalogue of S sources of four kinds (pre-tokenized web text, text tokenized
on read, long-context documents, chat/SFT pairs), each with its mixture weight, its number of files and
its preprocessing cost per token (a stated assumption, see `KINDS`). `SyntheticMetadata` is a
`plait.roles.planner.MetadataProvider` over it: `block_meta(source, key)` returns the `BlockMeta` a
SourceLoader would announce for that block (positions, row ids, document lengths), generated
deterministically from (seed, source, file, block) - the same key always gives the same block, as a
real source's does - so the real Planner can plan a 10k-GPU step without reading anything.

The provider counts what it serves (blocks, pickled bytes: what the loaders would send the Planner)
and the time it spends generating, so that a benchmark can leave its own cost out of the Planner's.
"""

from __future__ import annotations

import math
import pickle
import time
from dataclasses import dataclass

import numpy as np

from plait.roles.source_loader import BlockMeta
from plait.sources.base import file_order


@dataclass(frozen=True)
class Kind:
    """A source kind: document lengths lognormal(median, sigma) clipped to [low, high], and the cost of
    preprocessing one token on one core (read + decode + tokenize), in nanoseconds."""

    name: str
    share: float  # fraction of the sources of this kind
    median: float
    sigma: float
    low: int
    high: int
    ns_per_token: float

    def mean_length(self) -> float:
        return min(self.high, self.median * math.exp(self.sigma**2 / 2))


# Costs: pre-tokenized Parquet reads at ~200-235 M tokens/s on one core (`python -m benchmarks.throughput`'s raw
# read baseline: ~5 ns/token); tokenizing text on read with a fast BPE tokenizer runs at ~1-2 M tokens/s
# on one core (~500 ns/token). Lengths: the `web`, `longctx` and `sft` shapes of `python -m benchmarks.balance`.
KINDS = (
    Kind("web-tokens", 0.70, 400, 1.4, 16, 1_000_000, 5.0),
    Kind("text-tokenize", 0.20, 1200, 1.2, 16, 262_144, 500.0),
    Kind("longctx", 0.08, 12_000, 1.0, 1024, 1_000_000, 5.0),
    Kind("sft-tokenize", 0.02, 700, 0.8, 32, 32_768, 500.0),
)


class SyntheticSources:
    """S sources: kind, weight (lognormal, so a few sources dominate), files (in proportion to weight,
    `files` on average) and `blocks_per_file` blocks of about `block_tokens` tokens each."""

    def __init__(self, sources: int, *, seed: int = 0, files: int = 64, blocks_per_file: int = 8,
                 block_tokens: int = 4 << 20):
        if min(sources, files, blocks_per_file, block_tokens) < 1:
            raise ValueError("sources, files, blocks_per_file and block_tokens must be >= 1")
        rng = np.random.default_rng([seed, 0x5CA1E])
        self.seed = seed
        self.block_tokens = int(block_tokens)
        self.blocks_per_file = int(blocks_per_file)
        counts = np.floor(np.array([k.share for k in KINDS]) * sources).astype(int)
        counts[0] += sources - counts.sum()
        self.kind = rng.permutation(np.repeat(np.arange(len(KINDS)), counts))
        self.weight = np.round(rng.lognormal(0.0, 1.0, size=sources), 4) + 1e-3
        rel = self.weight / self.weight.mean()
        self.num_files = np.clip(np.round(files * rel), 1, 16 * files).astype(np.int64)
        self.docs_per_block = np.array([max(1, round(block_tokens / KINDS[k].mean_length())) for k in self.kind])

    def __len__(self) -> int:
        return len(self.weight)

    def name(self, i: int) -> str:
        return f"{KINDS[self.kind[i]].name}-{i:05d}"

    def spec_sources(self) -> list[dict]:
        """The spec's `sources` entries. Paths are placeholders: nothing here ever opens them."""
        return [{"name": self.name(i), "path": f"/synthetic/{self.name(i)}/*.parquet", "format": "parquet",
                 "tokens_field": "input_ids", "weight": float(self.weight[i])} for i in range(len(self))]

    def seconds_per_token(self) -> list[float]:
        return [KINDS[k].ns_per_token * 1e-9 for k in self.kind]

    def kind_counts(self) -> dict[str, int]:
        return {k.name: int((self.kind == j).sum()) for j, k in enumerate(KINDS)}

    def total_tokens(self) -> float:
        """Tokens in one epoch of all sources (approximately: blocks x block_tokens)."""
        return float(self.num_files.sum()) * self.blocks_per_file * self.block_tokens


class SyntheticMetadata:
    """MetadataProvider over `SyntheticSources`: deterministic BlockMeta per (source, key), no I/O."""

    def __init__(self, catalogue: SyntheticSources):
        self.cat = catalogue
        self.current_bytes = np.zeros(len(catalogue), dtype=np.int64)  # the last block served, per source
        self.current_tokens = np.zeros(len(catalogue), dtype=np.int64)
        self.reset_counters()

    def reset_counters(self) -> None:
        self.blocks = 0
        self.bytes = 0  # pickled BlockMeta: what a loader actor sends the Planner
        self.seconds = 0.0  # wall time generating (left out of the Planner's time)
        self.cpu_seconds = 0.0

    def first_key(self, source: int) -> tuple[int, int, int]:
        return (0, 0, 0)

    def next_key(self, source: int, key: tuple[int, int, int]) -> tuple[int, int, int]:
        epoch, fpos, bpos = key
        if bpos + 1 < self.cat.blocks_per_file:
            return (epoch, fpos, bpos + 1)
        if fpos + 1 < int(self.cat.num_files[source]):
            return (epoch, fpos + 1, 0)
        return (epoch + 1, 0, 0)

    def block_meta(self, source: int, key: tuple[int, int, int]) -> BlockMeta:
        t0, c0 = time.perf_counter(), time.thread_time()
        epoch, fpos, bpos = (int(x) for x in key)
        cat = self.cat
        file_idx = int(file_order(cat.seed, source, epoch, int(cat.num_files[source]))[fpos])
        kind = KINDS[cat.kind[source]]
        n = int(cat.docs_per_block[source])
        # The file's content does not depend on the epoch; the order of its documents does.
        content = np.random.default_rng([cat.seed, source, file_idx, bpos])
        lengths = np.clip(content.lognormal(math.log(kind.median), kind.sigma, size=n), kind.low, kind.high)
        order = np.random.default_rng([cat.seed, source, file_idx, bpos, epoch, 1]).permutation(n)
        meta = BlockMeta(
            source=source, key=(epoch, fpos, bpos), next_key=self.next_key(source, (epoch, fpos, bpos)),
            shard=file_idx, positions=np.arange(n, dtype=np.int64), rows=(order + bpos * n).astype(np.int64),
            lengths=lengths.astype(np.int64)[order], num_positions=n,
        )
        size = len(pickle.dumps(meta, protocol=5))
        self.current_bytes[source] = size
        self.current_tokens[source] = int(meta.lengths.sum())
        self.blocks += 1
        self.bytes += size
        self.seconds += time.perf_counter() - t0
        self.cpu_seconds += time.thread_time() - c0
        return meta
