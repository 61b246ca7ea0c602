"""The Planner's output: which document chunks form a step, and where each one goes.

`Items` is a struct of arrays, one entry per document chunk. Its identity columns say where the chunk
lives in its source's deterministic order (source, epoch, file_pos, block_pos, position) and in the data
(shard, row), which chunk of the document it is (chunk, offset, length). A StepPlan adds the assignment
(rank, micro) and the balance certificate.

Dynamic context parallelism (spec `context_parallel.mode: dynamic`, docs/long-context.md): the step runs
in waves over a pool of P = dp x cp ranks. `CPGroups` has one row per group micro-batch: its wave, its
first pool rank and its size k (members first..first+k-1). Every (pool rank, wave) is covered by exactly
one group, groups of size 1 included (also when empty). An item's `rank` is its group's first rank, its
`micro` the group's wave; `item_group` names the group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Integer columns, in the order used to serialise carried items in the data state.
ITEM_INT_COLUMNS = ("source", "epoch", "fpos", "bpos", "position", "shard", "row", "chunk", "offset", "length", "delayed")
# Image columns: patches of the item's images and the sum of their squares (the encoder's cost is
# quadratic per image). A carried row holds them (13 integers) only when some carried item has images,
# so text-only data states keep their 11-integer rows.
ITEM_IMAGE_COLUMNS = ("patches", "patches_sq")
# Audio columns: the audio encoder's attention spans of the item's clips, their squares, and the clips'
# placeholder tokens (labels the Constructor masks). A carried row holds them (16 integers) only when some
# carried item has audio.
ITEM_AUDIO_COLUMNS = ("audio_spans", "audio_spans_sq", "audio_tokens")
ALL_COLUMNS = ITEM_INT_COLUMNS + ITEM_IMAGE_COLUMNS + ITEM_AUDIO_COLUMNS


@dataclass
class Items:
    source: np.ndarray
    epoch: np.ndarray
    fpos: np.ndarray
    bpos: np.ndarray
    position: np.ndarray
    shard: np.ndarray
    row: np.ndarray
    chunk: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    delayed: np.ndarray  # steps this chunk has already waited (carried over)
    patches: np.ndarray | None = None  # image patches of the item (0 for text; zeros when not given)
    patches_sq: np.ndarray | None = None  # sum over its images of patches^2
    audio_spans: np.ndarray | None = None  # its clips' audio encoder spans (0 without audio)
    audio_spans_sq: np.ndarray | None = None  # sum over those spans of span^2
    audio_tokens: np.ndarray | None = None  # its clips' placeholder tokens

    def __post_init__(self):
        for c in ITEM_IMAGE_COLUMNS + ITEM_AUDIO_COLUMNS:
            if getattr(self, c) is None:
                setattr(self, c, np.zeros(len(self.length), dtype=np.int64))

    def __len__(self) -> int:
        return len(self.length)

    @property
    def has_images(self) -> bool:
        """Whether an item holds media (images, videos or audio): its payload is gathered with them."""
        return bool(len(self.patches)) and bool(self.patches.any() or self.audio_tokens.any())

    @property
    def media(self) -> np.ndarray:
        """Per item: whether it holds media (a document with media is never cut: one item)."""
        return (self.patches > 0) | (self.audio_tokens > 0)

    @classmethod
    def empty(cls) -> "Items":
        return cls(**{c: np.zeros(0, dtype=np.int64) for c in ALL_COLUMNS})

    @classmethod
    def concat(cls, parts: list["Items"]) -> "Items":
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty()
        if len(parts) == 1:
            return parts[0]
        return cls(**{c: np.concatenate([getattr(p, c) for p in parts]) for c in ALL_COLUMNS})

    def take(self, index: np.ndarray) -> "Items":
        return Items(**{c: getattr(self, c)[index] for c in ALL_COLUMNS})

    def to_rows(self) -> list[list[int]]:
        if not len(self):
            return []
        columns = ALL_COLUMNS if self.audio_tokens.any() else ITEM_INT_COLUMNS + ITEM_IMAGE_COLUMNS \
            if self.has_images else ITEM_INT_COLUMNS
        return np.stack([getattr(self, c) for c in columns], axis=1).astype(np.int64).tolist()

    @classmethod
    def from_rows(cls, rows: list[list[int]]) -> "Items":
        """Rows of 11 integers (text), 13 (with the image columns) or 16 (and the audio columns)."""
        if not rows:
            return cls.empty()
        width = len(rows[0])
        columns = ALL_COLUMNS[:width] if width in (13, len(ALL_COLUMNS)) else ITEM_INT_COLUMNS
        a = np.asarray(rows, dtype=np.int64).reshape(len(rows), len(columns))
        return cls(**{c: a[:, i].copy() for i, c in enumerate(columns)})

    def block_keys(self) -> tuple[list[tuple[int, int, int, int]], np.ndarray]:
        """Unique (source, epoch, file_pos, block_pos) keys and each item's index into them.

        Items come in runs from the same block (the Planner draws block by block), so runs are found
        with one vectorised comparison and only the few runs are deduplicated in Python.
        """
        n = len(self)
        if not n:
            return [], np.zeros(0, dtype=np.int64)
        cols = (self.source, self.epoch, self.fpos, self.bpos)
        change = np.zeros(n, dtype=bool)
        change[0] = True
        for c in cols:
            change[1:] |= c[1:] != c[:-1]
        run_starts = np.flatnonzero(change)
        index_of: dict[tuple[int, int, int, int], int] = {}
        run_index = np.empty(len(run_starts), dtype=np.int64)
        for j, key in enumerate(zip(*(c[run_starts].tolist() for c in cols))):
            run_index[j] = index_of.setdefault(key, len(index_of))
        return list(index_of), run_index[np.cumsum(change) - 1]

    def sample_ids(self) -> np.ndarray:
        """[n, 5] int64: source, epoch, shard, row, chunk. Unique per delivered chunk."""
        return np.stack([self.source, self.epoch, self.shard, self.row, self.chunk], axis=1).astype(np.int64)


def members(cache: dict, name: str, keys: np.ndarray, count: int):
    """`key -> indices of keys equal to it, in index order`, from one stable sort kept in `cache[name]`: a
    plan is asked once per rank, and a scan of every item per rank would cost ranks x items a step."""
    if name not in cache:
        order = np.argsort(keys, kind="stable")
        cache[name] = (order, np.searchsorted(keys[order], np.arange(count + 1)))
    order, bounds = cache[name]
    return lambda key: order[bounds[key] : bounds[key + 1]] if 0 <= key < count else order[:0]


@dataclass
class CPGroups:
    """The group micro-batches of a dynamic-CP step, one row each (see the module docstring)."""

    wave: np.ndarray  # [G] int32, 0..waves-1
    first: np.ndarray  # [G] int32, first pool rank of the group
    size: np.ndarray  # [G] int32, k (1 for a whole-document rank micro-batch)
    comm: np.ndarray | None = None  # [G] float64: CP communication cost each member carries

    def __len__(self) -> int:
        return len(self.size)

    def covering(self, rank: int) -> np.ndarray:
        """Ids of the groups pool rank `rank` belongs to, in wave order (one per wave)."""
        order, bounds = self._by_rank()
        if not 0 <= rank < len(bounds) - 1:
            return np.zeros(0, dtype=np.int64)
        return order[bounds[rank] : bounds[rank + 1]]

    def _by_rank(self) -> tuple[np.ndarray, np.ndarray]:
        """Group ids by member rank (in wave order), built once: a server of every pool rank asks once per
        rank, and a scan of all groups per rank would cost ranks x groups."""
        cached = self.__dict__.get("_rank_index")
        if cached is None:
            size = self.size.astype(np.int64)
            group = np.repeat(np.arange(len(size)), size)
            rank = self.first.astype(np.int64)[group] + np.arange(len(group)) - np.repeat(np.cumsum(size) - size, size)
            order = np.lexsort((self.wave[group], rank))  # by rank, then wave (stable: then group id)
            ranks = int((self.first.astype(np.int64) + size).max()) if len(size) else 0
            cached = self.__dict__["_rank_index"] = (group[order], np.searchsorted(rank[order], np.arange(ranks + 1)))
        return cached

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_rank_index"}  # an index is rebuilt, not sent


@dataclass
class StepPlan:
    step: int
    ranks: int
    microbatches: int
    capacity: int
    items: Items  # placed items only
    cost: np.ndarray  # float64 per item
    rank: np.ndarray  # int32 per item
    micro: np.ndarray  # int32 per item
    rank_cost: np.ndarray  # [R]
    micro_cost: np.ndarray  # [R, M]
    micro_tokens: np.ndarray  # [R, M]
    lower_bound: float
    carried: int  # items left for a later step
    delayed_outliers: int = 0
    empty_documents: int = 0  # zero-token documents drawn this step (nothing to place; counted, not lost)
    documents_cut: int = 0  # split: boundary: chunks cut at a micro-batch's end this step
    state_before: dict = field(default_factory=dict)  # the data state at the start of this step
    # Micro-batches of each rank: all `microbatches` in balance mode `equal`; in `variable` mode each
    # rank runs its own count (at most `microbatches`) and losses must be normalised by
    # stats()["global_label_tokens"], the label tokens of the whole step over all ranks.
    rank_microbatches: np.ndarray | None = None
    vocab_size: int | None = None  # the spec's, when it states one
    label_horizon: int = 1  # packing.label_horizon: > 1 asks the Constructor for multi-token labels
    weights: np.ndarray | None = None  # the mixture weights this step was drawn with (after run-time changes)
    drawn: np.ndarray | None = None  # tokens drawn per source this step (what the mixture's quotas took)
    # max(rank cost) / the capacity-aware lower bound (balance.capacity_lower_bound: what no placement that
    # respects each rank's token and patch capacity can beat); None on steps where it was not computed
    max_over_capacity_lb: float | None = None
    # image steps (spec `images` set): micro_patches [R, M], encoder_cost and cost (summed over the placed
    # items, per CP rank), masked_labels (labels set to -100 over the placed items' image placeholders)
    images: dict | None = None
    # dynamic CP (module docstring): ranks is the pool, microbatches the waves, capacity a rank's slot B
    cp_groups: CPGroups | None = None
    item_group: np.ndarray | None = None  # [n items] group id of each placed item

    @property
    def tokens(self) -> int:
        return int(self.items.length.sum())

    @property
    def label_tokens(self) -> int:
        """Labels that are not -100 in the whole step (all ranks and micro-batches): every token but each
        chunk's last, less the labels masked over image placeholders (the Planner counts those)."""
        masked = self.images.get("masked_labels", 0) if self.images is not None else 0
        return int((self.items.length - 1).clip(min=0).sum()) - int(masked)

    @property
    def max_over_mean(self) -> float:
        mean = float(self.rank_cost.mean())
        return float(self.rank_cost.max()) / mean if mean > 0 else 1.0

    @property
    def efficiency(self) -> float:
        """mean rank cost / max rank cost: 1.0 is perfect balance."""
        return 1.0 / self.max_over_mean

    @property
    def max_over_lb(self) -> float:
        return float(self.rank_cost.max()) / self.lower_bound if self.lower_bound > 0 else 1.0

    @property
    def tokens_max_over_mean(self) -> float:
        per_rank = self.micro_tokens.sum(axis=1)
        mean = float(per_rank.mean())
        return float(per_rank.max()) / mean if mean > 0 else 1.0

    @property
    def slots(self) -> int:
        """Token slots of the step: micro-batches actually run (all ranks) x seq_len."""
        runs = self.ranks * self.microbatches if self.rank_microbatches is None else int(self.rank_microbatches.sum())
        return runs * self.capacity

    @property
    def fill(self) -> float:
        """Tokens / token slots: 1 - fill is the step's padding (unfilled seq_len capacity)."""
        return self.tokens / self.slots if self.slots else 0.0

    def for_rank(self, dp_rank: int) -> "RankPlan":
        if self.cp_groups is not None:
            return self._for_pool_rank(dp_rank)
        sel = members(self.__dict__, "_items_by_rank", self.rank, self.ranks)(dp_rank)
        count = self.microbatches if self.rank_microbatches is None else int(self.rank_microbatches[dp_rank])
        return RankPlan(self.step, dp_rank, count, self.items.take(sel), self.micro[sel], self.stats())

    def _for_pool_rank(self, rank: int) -> "RankPlan":
        """Dynamic CP: the items of every group pool rank `rank` belongs to (micro = the group's wave) and,
        per wave, its place in that wave's group."""
        groups = self.cp_groups
        ids = groups.covering(rank)
        of_group = members(self.__dict__, "_items_by_group", self.item_group, len(groups))
        sel = np.sort(np.concatenate([of_group(int(g)) for g in ids])) if len(ids) else np.zeros(0, np.int64)
        cp = []
        for g in ids.tolist():
            first, size = int(groups.first[g]), int(groups.size[g])
            cp.append({"size": size, "rank": rank - first, "group": list(range(first, first + size)), "group_id": g})
        return RankPlan(self.step, rank, self.microbatches, self.items.take(sel), self.micro[sel], self.stats(), cp)

    def __getstate__(self) -> dict:  # the per-rank indexes are rebuilt where asked, not sent
        return {k: v for k, v in self.__dict__.items() if k not in ("_items_by_rank", "_items_by_group")}

    def stats(self) -> dict:
        cached = self.__dict__.get("_stats")
        if cached is None:
            cached = self.__dict__["_stats"] = self._stats()
        return dict(cached)

    def _stats(self) -> dict:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "samples": len(self.items),
            "vocab_size": self.vocab_size,
            "label_horizon": self.label_horizon,
            "microbatches": self.microbatches,
            "global_label_tokens": self.label_tokens,
            "efficiency": self.efficiency,
            "max_over_mean": self.max_over_mean,
            "max_over_lb": self.max_over_lb,
            "max_over_capacity_lb": self.max_over_capacity_lb,
            "max_rank_cost": float(self.rank_cost.max()) if len(self.rank_cost) else 0.0,
            "lower_bound": self.lower_bound,
            "tokens_max_over_mean": self.tokens_max_over_mean,
            "capacity": self.capacity,
            "seq_len": self.capacity,  # the step's phase (packing.schedule)
            "documents_cut": self.documents_cut,
            "fill": self.fill,
            "padding_fraction": 1.0 - self.fill,
            "carried": self.carried,
            "delayed_outliers": self.delayed_outliers,
            "empty_documents": self.empty_documents,
            **self._image_stats(),
            **self._cp_stats(),
        }

    def _cp_stats(self) -> dict:
        if self.cp_groups is None:
            return {}
        sizes = self.cp_groups.size[self.item_group].astype(np.int64)
        degrees, counts = np.unique(sizes, return_counts=True)
        comm = self.cp_groups.comm
        total = float(self.rank_cost.sum())
        comm_total = float((comm * self.cp_groups.size).sum()) if comm is not None else 0.0
        # each document of a group of k > 1 is padded to a multiple of 2k (per-document zigzag)
        lengths = self.items.length
        pad = int((np.where(sizes > 1, -(-lengths // (2 * sizes)) * 2 * sizes, lengths) - lengths).sum())
        return {"waves": self.microbatches, "cp_degrees": dict(zip(degrees.tolist(), counts.tolist())),
                "comm_share": comm_total / total if total > 0 else 0.0, "cp_groups": len(self.cp_groups),
                "cp_padding": pad / max(1, self.tokens + pad)}

    def _image_stats(self) -> dict:
        if self.images is None:
            return {}
        mp = self.images["micro_patches"]
        return {"patches": int(self.items.patches.sum()), "max_microbatch_patches": int(mp.max()) if mp.size else 0,
                "microbatch_patches": mp.tolist(), "encoder_share": self.encoder_share}

    @property
    def encoder_share(self) -> float:
        """The vision encoder's share of the step's cost (0.0 without images)."""
        if self.images is None or not self.images["cost"]:
            return 0.0
        return self.images["encoder_cost"] / self.images["cost"]


@dataclass
class RankPlan:
    """One DP rank's share of a step: what its Constructor builds."""

    step: int
    dp_rank: int
    microbatches: int
    items: Items
    micro: np.ndarray
    stats: dict
    # dynamic CP: per wave, dict(size=k, rank=position in the group, group=[pool ranks], group_id)
    cp: list[dict] | None = None
