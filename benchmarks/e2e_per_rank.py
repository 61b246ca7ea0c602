"""The baseline of `python -m benchmarks.e2e`: per-rank loaders, as a torch training script builds them.

Every DP rank owns a `torch.utils.data.DataLoader(num_workers=W)` over `RankShare`, an IterableDataset
that reads the rank's share of the same sources with plait's own readers (`plait.sources.Source`: the
same block decoding, tokenizer and image decode + resize + patchify as plait's SourceLoaders, so the
work per sample is the same). The R x W workers of the job split each source's blocks round-robin
(worker w of rank r takes blocks k with k % (R*W) == r*W + w, in the source's seeded order); a source
with fewer blocks per epoch than that keeps every (R*W)-th document of every block instead, as
`datasets.distributed.split_dataset_by_node` does. Each worker interleaves its sources by the mixture's
token weights (the source furthest below its share goes next) and packs greedily in arrival order:
text is concatenated and cut at the micro-batch boundary (the rest continues the next one), a document
holding images is never cut (it closes the micro-batch when it does not fit). No rank sees another's
samples: there is no global balance.

torch is an optional extra: it is imported here only, and `require_torch` names it when missing.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import numpy as np

from plait.errors import PlaitError
from plait.packing import pack_fields
from plait.sources import Source
from plait.spec import Spec


def require_torch():
    """torch, or a PlaitError saying that this benchmark's baseline needs it."""
    try:
        import torch
        import torch.utils.data
    except ImportError:
        raise PlaitError("the e2e benchmarks' per-rank baseline needs torch (torch.utils.data.DataLoader): "
                         "pip install 'plait[torch]' (or torch)") from None
    return torch


class Document:
    """One document (or the rest of a cut one) as a worker read it: tokens, and its images' patches."""

    __slots__ = ("grids", "pixels", "tokens")

    def __init__(self, tokens: np.ndarray, pixels: list[np.ndarray], grids: list[np.ndarray]):
        self.tokens, self.pixels, self.grids = tokens, pixels, grids

    @property
    def patches(self) -> int:
        return int(sum(len(p) for p in self.pixels))


def source_documents(source: Source, share: int, shares: int) -> Iterator[Document]:
    """Source documents of share `share` of `shares`, forever (epochs follow each other), decoded."""
    blocks_per_epoch = sum(source.num_blocks(f) for f in range(len(source.files)))
    by_block = blocks_per_epoch >= shares
    key, k, doc_count = source.first_key(0), 0, 0
    while True:
        if not by_block or k % shares == share:
            block = source.read_block(key)
            docs = np.arange(len(block.lengths))
            if not by_block:
                docs = docs[(doc_count + docs) % shares == share]
                doc_count += len(block.lengths)
            if block.failed is not None:  # planned, then failed at decode: a dropped sample, as plait drops it
                docs = docs[~block.failed[docs]]
            for d in docs:
                start, length = int(block.starts[d]), int(block.lengths[d])
                pixels, grids = [], []
                if block.images is not None:
                    first, count = int(block.images.start[d]), int(block.images.count[d])
                    for j in range(first, first + count):
                        pixels.append(source.image_pixels(block, j))
                        grids.append(block.images.grid[j])
                yield Document(block.tokens[start:start + length], pixels, grids)
        key, k = source.next_key(key), k + 1


def interleave(streams: list[Iterator[Document]], weights: np.ndarray) -> Iterator[Document]:
    """Documents of the sources by token weight: next comes the source furthest below its share."""
    taken = np.zeros(len(streams))
    share = weights / weights.sum()
    live = share > 0
    while True:
        total = taken.sum()
        behind = np.where(live, share * max(total, 1.0) - taken, -np.inf)
        i = int(np.argmax(behind))
        doc = next(streams[i])
        taken[i] += len(doc.tokens)
        yield doc


def micro_batch(docs: list[Document]) -> dict[str, np.ndarray]:
    """The packed micro-batch of documents: input_ids, cu_seqlens, position_ids, labels, pixels, grids."""
    lengths = np.array([len(d.tokens) for d in docs], dtype=np.int64)
    input_ids = np.concatenate([d.tokens for d in docs]).astype(np.int32)
    out = {"input_ids": input_ids, **pack_fields(input_ids, lengths)}
    pixels = [p for d in docs for p in d.pixels]
    grids = [g for d in docs for g in d.grids]
    out["image_grid"] = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    out["pixel_values"] = np.concatenate(pixels) if pixels else np.zeros((0, 1), np.uint8)
    return out


def pack_greedy(docs: Iterator[Document], seq_len: int, max_patches: int | None) -> Iterator[dict]:
    """Micro-batches of documents in arrival order, full to `seq_len` tokens: text is cut at the boundary
    (its rest opens the next micro-batch); a document with images is never cut, and one that does not fit
    (tokens or `max_patches`) closes the micro-batch."""
    room, patches, held = seq_len, 0, []
    for doc in docs:
        while True:
            n = len(doc.tokens)
            if doc.pixels:
                fits = n <= room and (max_patches is None or patches + doc.patches <= max_patches)
                if fits or not held:  # (a document too large for an empty micro-batch: the source refuses it)
                    held.append(doc)
                    room, patches = room - n, patches + doc.patches
                    break
            elif n <= room:
                held.append(doc)
                room -= n
                break
            elif room > 0:  # text: fill the room, carry the rest
                held.append(Document(doc.tokens[:room], [], []))
                doc = Document(doc.tokens[room:], [], [])
            yield micro_batch(held)
            room, patches, held = seq_len, 0, []
        if room <= 0:
            yield micro_batch(held)
            room, patches, held = seq_len, 0, []


def rank_share_dataset(spec: Spec, rank: int, ranks: int):
    """The IterableDataset of rank `rank`: its workers' shares of every source, packed (module docstring)."""
    torch = require_torch()

    class RankShare(torch.utils.data.IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
            share, shares = rank * workers + worker, ranks * workers
            sources = [Source.of_job(spec, i) for i in range(len(spec.sources))]
            weights = np.array([s.weight for s in spec.sources], dtype=np.float64)
            streams = [source_documents(src, share, shares) for src in sources]
            return pack_greedy(interleave(streams, weights), spec.packing.seq_len, spec.packing.max_patches)

    return RankShare()


def rank_loaders_for(spec: Spec, rank: int, workers: int, prefetch_factor: int = 2):
    """Rank `rank`'s started DataLoader iterator (a trainer process of its own)."""
    torch = require_torch()
    loader = torch.utils.data.DataLoader(rank_share_dataset(spec, rank, spec.topology.dp), batch_size=None,
                                         num_workers=workers, prefetch_factor=prefetch_factor if workers else None)
    return iter(loader)


def rank_loaders(spec: Spec, workers: int, prefetch_factor: int = 2) -> list:
    """One started DataLoader iterator per DP rank (workers forked here, before any thread or Ray)."""
    torch = require_torch()
    ranks = spec.topology.dp
    out = []
    for rank in range(ranks):
        loader = torch.utils.data.DataLoader(rank_share_dataset(spec, rank, ranks), batch_size=None,
                                             num_workers=workers, prefetch_factor=prefetch_factor)
        out.append(iter(loader))
    return out


def torch_shape(mb: dict) -> tuple[np.ndarray, np.ndarray, int]:
    """(document lengths, patches per image, tokens) of a per-rank DataLoader's micro-batch (a dict of tensors)."""
    cu = mb["cu_seqlens"].numpy()
    return np.diff(cu), mb["image_grid"].numpy().prod(axis=1), int(cu[-1])


def run_per_rank(spec: Spec, args, clock) -> dict:
    """One row of the simulated job (plait.cli.bench.e2e_run) fed by per-rank DataLoaders: W = cpus / DP
    worker processes per rank."""
    from plait.cli.bench.e2e_run import load_average, run_synchronous, summarize
    from plait.kernels import warm_up

    warm_up()  # compiled before the workers fork, as plait's actors compile theirs at start
    workers = max(1, args.cpus // spec.topology.dp)
    load_before = load_average()
    t0 = time.perf_counter()
    streams = rank_loaders(spec, workers)
    trace = run_synchronous(streams, args.steps, args.microbatches, clock, torch_shape)
    trace.start = t0
    row = summarize(trace, args.warmup)
    row["images_delivered"] = int(trace.images.sum())
    del streams, trace
    gc.collect()  # ends the DataLoaders' worker processes now
    row.update(workers_per_rank=workers, processes=workers * spec.topology.dp,
               load_average=[load_before, load_average()])
    return row
