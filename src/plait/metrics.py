"""Run statistics: per-step balance, mixture shares, throughput, stream digests.

A run may last weeks: nothing here is kept per step for ever. Summaries come from running sums, minima
and maxima; the per-step series a plot needs are the last `RECENT_STEPS` steps only.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from plait.plan import StepPlan
from plait.batch import MicroBatch


def batch_digest_update(h: "hashlib._Hash", mb: MicroBatch) -> None:
    """The stream digest: tokens, labels, positions, boundaries and sample ids; with images also their
    pixel bytes, grids and documents (a text-only batch digests as it always has)."""
    for a in (mb.input_ids, mb.labels, mb.position_ids, mb.cu_seqlens, mb.sample_ids):
        h.update(np.ascontiguousarray(a).tobytes())
    if mb.pixel_values is not None and len(mb.pixel_values):
        for a in (mb.pixel_values, mb.image_grid.astype(np.int64), mb.image_document.astype(np.int64)):
            h.update(np.ascontiguousarray(a).tobytes())
    if mb.pixel_values_videos is not None and len(mb.pixel_values_videos):
        for a in (mb.pixel_values_videos, mb.video_grid.astype(np.int64), mb.video_document.astype(np.int64)):
            h.update(np.ascontiguousarray(a).tobytes())
    if mb.input_features is not None and len(mb.input_features):  # audio: features, mask, windows, documents
        for a in (mb.input_features, mb.feature_attention_mask, mb.audio_windows, mb.audio_document):
            h.update(np.ascontiguousarray(a).tobytes())


RECENT_STEPS = 10_000  # per-step series kept for plots: the last this many steps (a few hundred KiB)


@dataclass
class RunStats:
    source_names: list[str]
    ranks: int
    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    tokens: int = 0
    padding_worst: float = 0.0  # the largest 1 - tokens / seq_len of a micro-batch
    capacity_tokens: int = 0
    source_tokens: np.ndarray = None  # type: ignore[assignment]
    target_tokens: np.ndarray = None  # type: ignore[assignment]
    # the last RECENT_STEPS steps' balance (for plots); the summary's means and minimum are running ones
    efficiency: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    max_over_lb: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    efficiency_sum: float = 0.0
    efficiency_min: float = float("inf")
    max_over_lb_sum: float = 0.0
    tokens_max_over_mean_sum: float = 0.0
    digests: dict[int, "hashlib._Hash"] = field(default_factory=dict)
    carried: int = 0
    empty_documents: int = 0  # documents of zero tokens: nothing to train on, counted and reported
    images: int = 0  # images delivered in batches
    patches: int = 0
    cost: float = 0.0  # summed item cost of the steps with images, and the encoder's part of it
    encoder_cost: float = 0.0
    videos: int = 0  # videos delivered in batches
    audio_clips: int = 0  # audio clips delivered in batches, and their seconds (as planned)
    audio_seconds: float = 0.0

    def __post_init__(self):
        n = len(self.source_names)
        self.source_tokens = np.zeros(n, dtype=np.int64)
        self.target_tokens = np.zeros(n, dtype=np.float64)

    def add_plan(self, plan: StepPlan, weights: np.ndarray) -> None:
        self.steps += 1
        self.efficiency.append(plan.efficiency)
        self.max_over_lb.append(plan.max_over_lb)
        self.efficiency_sum += plan.efficiency
        self.efficiency_min = min(self.efficiency_min, plan.efficiency)
        self.max_over_lb_sum += plan.max_over_lb
        self.tokens_max_over_mean_sum += plan.tokens_max_over_mean
        self.capacity_tokens += plan.slots
        self.source_tokens += np.bincount(plan.items.source, weights=plan.items.length, minlength=len(self.source_names)).astype(np.int64)
        self.target_tokens += weights * plan.tokens
        self.empty_documents += plan.empty_documents
        self.carried = plan.carried
        if plan.images is not None:
            self.cost += plan.images["cost"]
            self.encoder_cost += plan.images["encoder_cost"]

    def add_batch(self, mb: MicroBatch) -> None:
        self.tokens += mb.num_tokens
        self.padding_worst = max(self.padding_worst, mb.padding_fraction)
        self.images += mb.num_images
        self.patches += mb.num_patches
        self.videos += 0 if mb.video_grid is None else len(mb.video_grid)
        self.audio_clips += int(mb.stats.get("audio_clips", 0))
        self.audio_seconds += float(mb.stats.get("audio_seconds", 0.0))
        batch_digest_update(self.digests.setdefault(mb.dp_rank, hashlib.sha256()), mb)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def summary(self) -> dict:
        total = max(1, int(self.source_tokens.sum()))
        target_total = max(1e-9, float(self.target_tokens.sum()))
        return {
            "steps": self.steps,
            "tokens": int(self.tokens),
            "seconds": round(self.elapsed, 3),
            "tokens_per_s": self.tokens / max(self.elapsed, 1e-9),
            "mixture": {
                name: {"target": float(self.target_tokens[i] / target_total), "achieved": float(self.source_tokens[i] / total)}
                for i, name in enumerate(self.source_names)
            },
            "efficiency_mean": float(self.efficiency_sum / self.steps) if self.steps else None,
            "efficiency_min": float(self.efficiency_min) if self.steps else None,
            "max_over_lb_mean": float(self.max_over_lb_sum / self.steps) if self.steps else None,
            "tokens_max_over_mean": float(self.tokens_max_over_mean_sum / self.steps) if self.steps else None,
            # Padding = unfilled seq_len capacity: 1 - tokens / (micro-batches run x seq_len).
            "fill": self.tokens / max(1, self.capacity_tokens),
            "padding_fraction": 1.0 - self.tokens / max(1, self.capacity_tokens),
            "padding_fraction_worst_microbatch": float(self.padding_worst),
            "carried_at_end": self.carried,
            "empty_documents": self.empty_documents,
            "digests": {str(r): h.hexdigest() for r, h in sorted(self.digests.items())},
            **self._image_summary(),
        }

    def _image_summary(self) -> dict:
        if not self.images and not self.encoder_cost:
            return {}
        return {"images": self.images, "patches": self.patches, **({"videos": self.videos} if self.videos else {}),
                "images_per_s": self.images / max(self.elapsed, 1e-9),
                "encoder_share": self.encoder_cost / self.cost if self.cost else 0.0}


class ShareWindows:
    """Achieved token share per source over consecutive windows of `window` steps, against the target,
    accumulated as steps arrive (`plait.mixture.share_windows` over the whole run, without keeping every
    step): one entry per finished window, and the last `recent` steps' draws and weights for a plot."""

    def __init__(self, sources: int, window: int = 100, recent: int = RECENT_STEPS):
        self.window = window
        self.windows: list[dict] = []
        self.steps = 0
        self.drawn: deque = deque(maxlen=recent)  # tokens drawn per source, per step
        self.weights: deque = deque(maxlen=recent)  # the weights each of those steps was drawn with
        self._drawn = np.zeros(sources)
        self._target = np.zeros(sources)  # sum over the window of weights x tokens drawn that step
        self._start = 0

    def add(self, drawn: np.ndarray, weights: np.ndarray) -> None:
        drawn = np.asarray(drawn, dtype=np.float64)
        self.drawn.append(drawn)
        self.weights.append(np.asarray(weights, dtype=np.float64))
        self._drawn += drawn
        self._target += np.asarray(weights) * drawn.sum()
        self.steps += 1
        if self.steps - self._start == self.window:
            self._close()

    def finish(self) -> list[dict]:
        """The windows, the last one partial when the run ended inside it."""
        if self.steps > self._start:
            self._close()
        return self.windows

    def _close(self) -> None:
        total = self._drawn.sum()
        if total > 0:
            achieved, target = self._drawn / total, self._target / total
            self.windows.append({"start": self._start, "end": self.steps, "achieved": achieved.tolist(),
                                 "target": target.tolist(), "worst_error": float(np.abs(achieved - target).max())})
        self._drawn[:], self._target[:] = 0.0, 0.0
        self._start = self.steps


def combined_digest(digests: dict[str, str]) -> str:
    h = hashlib.sha256()
    for rank in sorted(digests, key=int):
        h.update(f"{rank}:{digests[rank]};".encode())
    return h.hexdigest()
