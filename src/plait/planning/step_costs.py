"""The cost side of planning a step: what each item costs per GPU, which items to hold back as cost
outliers, and the cost figures reported with the step.

With context parallelism each CP rank of a replica carries cost / cp; an item with images adds the
vision encoder's cost of its patches (linear and quadratic per image), one with audio the audio encoder's
cost of its attention spans (linear and quadratic per span, by the window policy: plait.media.audio), both
split over the CP ranks too. Every encoder's cost is plait.cost.EncoderCost over its units.
"""

from __future__ import annotations

import numpy as np

from plait import balance
from plait.cost import CostModel, EncoderCost
from plait.plan import Items
from plait.sources.multimodal import placeholder_leads
from plait.spec import Spec

CAPACITY_LB_ITEMS = 8_000  # max_over_capacity_lb on every step of at most this many items (~15 ms) ...
CAPACITY_LB_EVERY = 10  # ... else on every 10th step


def encoder_cost(spec: Spec) -> EncoderCost | None:
    """The vision encoder's per-image cost from `cost.encoder` (None: images cost nothing to encode)."""
    return _encoder(spec.cost.encoder)


def audio_encoder_cost(spec: Spec) -> EncoderCost | None:
    """The audio encoder's cost per attention span from `audio.encoder` (None without audio)."""
    return None if spec.audio is None else _encoder(spec.audio.encoder)


class Encoders:
    """The job's media encoders and the one formula of their cost: each item's sum over its media of
    EncoderCost over the media's units (an image's patches, a clip's attention spans)."""

    def __init__(self, spec: Spec):
        self.image, self.audio = encoder_cost(spec), audio_encoder_cost(spec)

    def __bool__(self) -> bool:
        return self.image is not None or self.audio is not None

    def of(self, items: Items) -> np.ndarray:
        """Each item's whole encoder cost (zeros for text)."""
        out = np.zeros(len(items))
        if not items.has_images:
            return out
        for cost, units, squares in ((self.image, items.patches, items.patches_sq),
                                     (self.audio, items.audio_spans, items.audio_spans_sq)):
            if cost is not None:
                out = out + cost.of_units(units, squares)  # the one encoder formula (plait.cost)
        return out


def _encoder(e) -> EncoderCost | None:
    if e is None:
        return None
    if e.linear is not None:
        return EncoderCost(float(e.linear), float(e.quadratic))
    return EncoderCost.from_dims(e.hidden, e.layers, e.ffn)


class StepCosts:
    """Costs of items per CP rank under the spec's cost model (and encoder), and what is derived from them."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.cp = spec.topology.cp
        self.cost_model = CostModel.from_spec(spec.cost)
        self.encoders = Encoders(spec)
        self.images = spec.images is not None  # patches, an encoder load (limited by max_patches), and a cost
        self.max_patches = spec.packing.max_patches
        self.max_audio = spec.packing.max_audio_positions  # audio positions: a load only where limited
        # patches a micro-batch can hold at most anyway (each placeholder token stands for merge^2 of them):
        # the vision encoder's capacity where only the audio encoder's is given (it never binds)
        self.patches_bound = spec.packing.seq_len * spec.images.merge ** 2 if self.images else 0

    def of(self, items: Items) -> tuple[np.ndarray, np.ndarray]:
        """Each item's cost per CP rank (LLM over its tokens + encoder over its images, both split over
        the cp ranks), and the encoder's part of it."""
        costs = self.cost_model.per_cp_rank(items.length, self.cp)
        encoder = self.encoders.of(items) / max(1, self.cp)
        return costs + encoder, encoder

    def encoder_loads(self, items: Items) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Each item's load in each encoder capacity (int64 [n, K]) and what a micro-batch may hold of
        each ([K], None: reported, not limited), for balance.assign; (None, None) without media loads.
        Images and videos load the vision encoder with their patches (packing.max_patches); audio loads
        the audio encoder with its positions (packing.max_audio_positions), a column only where that is
        set (unset, steps plan as before, bit for bit). A medium whose encoder memory the spec limits adds
        its column here: the balancer takes any K; the vision encoder's stays first (image_stats)."""
        if self.max_audio is None:
            if not self.images:
                return None, None
            loads = items.patches.reshape(-1, 1)
            return loads, None if self.max_patches is None else np.array([self.max_patches], dtype=np.int64)
        audio = items.audio_spans if items.audio_spans is not None else np.zeros(len(items), np.int64)
        columns, caps = [audio], [self.max_audio]
        if self.images:
            columns.insert(0, items.patches)
            caps.insert(0, self.patches_bound if self.max_patches is None else self.max_patches)
        return np.column_stack(columns).astype(np.int64), np.array(caps, dtype=np.int64)

    def of_tokens(self, lengths: np.ndarray) -> np.ndarray:
        """The LLM's cost per CP rank of text pieces of these lengths (no images)."""
        return self.cost_model.per_cp_rank(lengths, self.cp)

    def held_outliers(self, items: Items, ranks: int) -> np.ndarray:
        """Which items to delay: outliers (cost > outlier_factor x mean rank load), held until enough
        gather to give every rank one, or until one has waited max_delay steps; then all go together.

        One outlier in a step makes that step as slow as the outlier; gathering them makes one slow step
        out of many instead of many slow steps. Off unless balance.max_delay > 0.
        """
        held = np.zeros(len(items), dtype=bool)
        max_delay = self.spec.balance.max_delay
        if max_delay <= 0 or not len(items):
            return held
        costs = self.of(items)[0]
        outlier = costs > self.spec.balance.outlier_factor * float(costs.sum()) / ranks
        if not outlier.any():
            return held
        if int(outlier.sum()) >= ranks or bool((items.delayed[outlier] >= max_delay).any()):
            return held
        return outlier

    def capacity_certificate(self, result, items: Items, costs: np.ndarray, *, step: int, capacity: int) -> float | None:
        """The step's certificate against the capacity-aware bound (balance.max_over_capacity_lb: tokens
        per rank, and the encoder loads): only on steps of at most CAPACITY_LB_ITEMS items, or every
        CAPACITY_LB_EVERY steps, as it is slow on huge steps; None when skipped."""
        if len(items) > CAPACITY_LB_ITEMS and step % CAPACITY_LB_EVERY != 0:
            return None
        loads, load_capacity = self.encoder_loads(items)
        return balance.max_over_capacity_lb(result, items.length, costs, loads,
                                            microbatches=int(result.micro_cost.shape[1]), capacity=capacity,
                                            load_capacity=load_capacity)

    def image_stats(self, result, items: Items, encoder: np.ndarray, costs: np.ndarray, placed: np.ndarray) -> dict:
        """Patches per micro-batch and the encoder's share of the cost."""
        micro_patches = result.micro_loads[..., 0] if result.micro_loads is not None and self.images else \
            np.zeros_like(result.micro_tokens)
        return {"micro_patches": micro_patches, "encoder_cost": float(encoder[placed].sum()),
                "cost": float(costs[placed].sum()), "masked_labels": self.masked_labels(items.take(placed))}

    def masked_labels(self, items: Items) -> int:
        """Labels the Constructor sets to -100 over media placeholders in these items: one per placeholder
        (an image's patches / merge**2, a clip's tokens), less the first one where a document starts with
        a placeholder (nothing predicts it: multimodal.placeholder_leads). Text items mask none."""
        merge = self.spec.images.merge if self.spec.images is not None else 1
        leads = np.array([placeholder_leads(s) for s in self.spec.sources], dtype=np.int64)
        placeholders = items.patches // (merge * merge) + items.audio_tokens
        return int(placeholders.sum() - (leads[items.source] * items.media).sum())
