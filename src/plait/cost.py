"""Cost models: what one document (or chunk) of L tokens costs to train on.

c(L) = per_doc + linear * L + quadratic * L_att^2, where L_att is L rounded up to the attention
kernel's tile (short documents waste part of a tile). For a decoder layer with hidden size h, n heads,
g KV groups and FFN width f, forward FLOPs are L * [4h^2 (1 + g/n) + 6hf] + 2hL^2 (causal attention);
training is ~3x forward. The two terms are equal at L* = 2h(1 + g/n) + 3f (~49k tokens for a 7B model).

Coefficients come from model dimensions (FLOPs), from the spec (explicit), or from measurements:
`CostModel.fit` (and `plait fit-cost CSV`) solves a non-negative least-squares problem over rows of
(sum_L, sum_L2, count, time) measured per micro-batch.

Multimodal models add a vision encoder per image: e(P) = linear * P + quadratic * P^2 in the image's
patches P (bidirectional attention inside each image). It is a separate component (`EncoderCost`)
because the encoder runs on different shapes than the decoder; an item's total is c(L) + e(P), with
P = 0 for text. An item may hold several images: its encoder cost is the sum over them (each image's
attention is its own), `EncoderCost.per_item(patches, offsets)` from per-image patch counts in CSR form
(item i's images are patches[offsets[i]:offsets[i+1]]); `CostModel(..., encoder=e)(lengths, patches,
offsets)` adds it to c(L). With one image per item (or a precomputed per-item encoder cost) no offsets
are needed. `fit` takes the encoder's columns too: sum_P and sum_P2 (patches and squared patches of the
micro-batch's images).

Context parallelism: a replica's micro-batch is split over its `cp` ranks by head-tail sharding (each
document cut into 2*cp pieces, CP rank i taking pieces i and 2*cp-1-i). Under causal attention the
pair costs the same for every i, so each CP rank carries exactly c(L)/cp (`per_cp_rank`).

Dynamic CP (`context_parallel.mode: dynamic`) also prices the traffic of a group of k ranks (`CommCost`):
ring attention passes each member's keys and values around the ring, k - 1 passes per layer forward and
twice that backward (keys and values again, and their gradients), each paying the link's latency. A group
inside one node (`cost.interconnect.ranks_per_node`) runs at the node's bandwidth, one across nodes at the
inter-node bandwidth. Seconds become the cost model's units through `compute_tflops` (with explicit
linear/quadratic coefficients, scaled by their linear term over the FLOP count of the model's
dimensions). Linear in the group's tokens T: each member carries slope(k) * T + intercept(k), not
overlapped with compute (conservative).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np

from plait.spec import CostSpec

RING_PASSES = 3  # per layer and unit of (k - 1): forward K/V, backward K/V again and their gradients


@dataclass(frozen=True)
class EncoderCost:
    """Per-image vision-encoder cost e(P) = linear * P + quadratic * P^2 (P: patches of one image)."""

    linear: float
    quadratic: float

    @classmethod
    def from_dims(cls, hidden: int, layers: int, ffn: int, heads: int | None = None) -> "EncoderCost":
        """A ViT of these dimensions: 4h^2 (QKV+out) + 4hf (2-matrix MLP) per patch, 4hP^2 attention."""
        h, f = float(hidden), float(ffn)
        return cls(3.0 * layers * (8 * h * h + 4 * h * f), 3.0 * layers * 4 * h)

    def of_units(self, units, squares) -> np.ndarray:
        """The encoder's cost formula, the one every medium's cost goes through (the Planner's per item,
        plait.media.audio's per clip): linear * U + quadratic * Q, U the media's encoder units summed
        (an image's patches, a clip's attention spans) and Q their squares summed (a video's patches
        attend per temporal patch: t * (h*w)^2; media/registry.py, `Medium.encoder_units`)."""
        return self.linear * np.asarray(units, dtype=np.float64) + self.quadratic * np.asarray(squares, dtype=np.float64)

    def __call__(self, patches: np.ndarray) -> np.ndarray:
        """of_units for one image per entry (U = P, Q = P^2), written as (quadratic * P) * P: the rounding
        the fitted and benchmarked costs were made with."""
        P = np.asarray(patches, dtype=np.float64)
        return self.linear * P + self.quadratic * P * P

    def per_item(self, patches: np.ndarray, offsets: np.ndarray | None = None) -> np.ndarray:
        """Encoder cost of each item: the sum of e(P) over its images. patches: per image; offsets (int,
        [n + 1], CSR): item i's images are patches[offsets[i]:offsets[i + 1]] (None: one image per item,
        0 patches for none)."""
        e = self(patches)
        if offsets is None:
            return e
        offsets = np.asarray(offsets, dtype=np.int64)
        acc = np.concatenate([[0.0], np.cumsum(e)])
        return acc[offsets[1:]] - acc[offsets[:-1]]


@dataclass(frozen=True)
class CostModel:
    linear: float
    quadratic: float
    tile: int = 0
    per_doc: float = 0.0  # fixed cost per document (kernel launches, varlen bookkeeping)
    encoder: EncoderCost | None = None  # multimodal: per-image encoder term, see the module docstring

    @classmethod
    def from_spec(cls, spec: CostSpec) -> "CostModel":
        if spec.linear is not None and spec.quadratic is not None:
            return cls(float(spec.linear), float(spec.quadratic), spec.attention_tile)
        return cls.from_dims(spec.hidden, spec.layers, spec.ffn, spec.heads, spec.kv_heads, spec.attention_tile)

    @classmethod
    def from_dims(cls, hidden: int, layers: int, ffn: int, heads: int, kv_heads: int | None = None, tile: int = 0):
        h, f, n = float(hidden), float(ffn), float(heads)
        g = float(kv_heads or heads)
        per_token = 4 * h * h * (1 + g / n) + 6 * h * f
        return cls(3.0 * layers * per_token, 3.0 * layers * 2 * h, tile)

    @property
    def crossover(self) -> float:
        """Document length at which attention costs as much as everything else."""
        return self.linear / self.quadratic if self.quadratic else float("inf")

    def text(self, lengths: np.ndarray) -> np.ndarray:
        L = np.asarray(lengths, dtype=np.float64)
        La = np.ceil(L / self.tile) * self.tile if self.tile else L
        out = self.linear * L + self.quadratic * La * La
        if self.per_doc:
            out = out + self.per_doc * (L > 0)
        return out

    def __call__(self, lengths: np.ndarray, patches: np.ndarray | None = None,
                 offsets: np.ndarray | None = None) -> np.ndarray:
        """Cost of each item: its text c(L) plus, with an encoder and patches, the encoder cost of its
        images (EncoderCost.per_item: per-image patches with CSR offsets, or one image per item)."""
        out = self.text(lengths)
        if self.encoder is not None and patches is not None:
            out = out + self.encoder.per_item(patches, offsets)
        return out

    def per_cp_rank(self, lengths: np.ndarray, cp: int, patches: np.ndarray | None = None) -> np.ndarray:
        """Cost each of the `cp` ranks of a CP group carries for an item under head-tail sharding."""
        return self(lengths, patches) / max(1, int(cp))

    @classmethod
    def fit(
        cls, sum_L: np.ndarray, sum_L2: np.ndarray, count: np.ndarray, time: np.ndarray, *, tile: int = 0,
        sum_P: np.ndarray | None = None, sum_P2: np.ndarray | None = None,
    ) -> tuple["CostModel", dict]:
        """Fit time ~ linear*sum_L + quadratic*sum_L2 + per_doc*count + overhead
        (+ encoder_linear*sum_P + encoder_quadratic*sum_P2 with the encoder columns), all >= 0.

        Rows are measured micro-batches (sum_L2: sum of squared, tile-rounded lengths; sum_P, sum_P2: the
        patches and squared patches of its images). `overhead` is a per-micro-batch constant: the same
        for every micro-batch, so it does not change balancing and is reported, not kept. Returns the model
        (with `encoder` when the encoder columns were given) and a report (coefficients, r2, rms and max
        relative error).
        """
        enc = sum_P is not None and sum_P2 is not None
        cols = (sum_L, sum_L2, count) + ((sum_P, sum_P2) if enc else ())
        X = np.stack([np.asarray(a, dtype=np.float64) for a in cols], axis=1)
        X = np.concatenate([X, np.ones((len(X), 1))], axis=1)
        y = np.asarray(time, dtype=np.float64)
        if len(y) < 2:
            raise ValueError("need at least 2 measured rows to fit a cost model")
        coef = nnls(X, y)
        if enc:  # the overhead column last, as without the encoder
            coef = coef[[0, 1, 2, 5, 3, 4]]
            X = X[:, [0, 1, 2, 5, 3, 4]]
        pred = X @ coef
        ss_res = float(((y - pred) ** 2).sum())
        ss_tot = float(((y - y.mean()) ** 2).sum())
        rel = np.abs(pred - y) / np.where(y > 0, y, 1.0)
        report = {
            "linear": float(coef[0]),
            "quadratic": float(coef[1]),
            "per_doc": float(coef[2]),
            "overhead": float(coef[3]),
            "rows": int(len(y)),
            "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
            "rel_err_rms": float(np.sqrt((rel**2).mean())),
            "rel_err_max": float(rel.max()),
            "crossover": float(coef[0] / coef[1]) if coef[1] > 0 else float("inf"),
        }
        encoder = None
        if enc:
            report["encoder_linear"], report["encoder_quadratic"] = float(coef[4]), float(coef[5])
            encoder = EncoderCost(float(coef[4]), float(coef[5]))
        return cls(float(coef[0]), float(coef[1]), tile, float(coef[2]), encoder), report


@dataclass(frozen=True)
class CommCost:
    """The CP traffic one member of a group of k ranks carries (module docstring), in cost-model units."""

    kv_bytes_per_token: float  # keys and values of one token in one layer
    layers: int
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    latency_s: float
    ranks_per_node: int
    units_per_s: float  # cost-model units per second of compute

    @classmethod
    def from_spec(cls, spec: CostSpec) -> "CommCost":
        net = spec.interconnect
        hidden, heads = float(spec.hidden or 4096), float(spec.heads or 32)
        kv_heads = float(spec.kv_heads or heads)
        units_per_s = net.compute_tflops * 1e12
        if spec.linear is not None and spec.linear > 0:
            # explicit coefficients price the model of these dimensions in their own units: a second of
            # traffic is worth what a second of its compute is in them
            flops = CostModel.from_dims(int(hidden), spec.layers or 32, spec.ffn or 11008, int(heads), spec.kv_heads)
            units_per_s *= spec.linear / flops.linear
        return cls(2 * hidden * kv_heads / heads * net.kv_bytes, int(spec.layers or 32), net.bandwidth_gbps * 1e9,
                   net.inter_node_bandwidth_gbps * 1e9, net.latency_us * 1e-6, net.ranks_per_node, units_per_s)

    def slope(self, size: np.ndarray, crosses: np.ndarray) -> np.ndarray:
        """Cost per token of the group's micro-batch that each member carries."""
        k = np.asarray(size, dtype=np.float64)
        bandwidth = np.where(crosses, self.inter_bytes_per_s, self.intra_bytes_per_s)
        return RING_PASSES * self.layers * (k - 1) / k * self.kv_bytes_per_token / bandwidth * self.units_per_s

    def intercept(self, size: np.ndarray) -> np.ndarray:
        """The latency each member carries, whatever the group's tokens."""
        k = np.asarray(size, dtype=np.float64)
        return RING_PASSES * self.layers * (k - 1) * self.latency_s * self.units_per_s

    def per_member(self, tokens: np.ndarray, size: np.ndarray, crosses: np.ndarray | bool = False) -> np.ndarray:
        """What each member of groups of `size` ranks holding `tokens` tokens (padding included) carries."""
        tokens = np.asarray(tokens, dtype=np.float64)
        out = self.slope(size, crosses) * tokens + self.intercept(size)
        return np.where((np.asarray(size) > 1) & (tokens > 0), out, 0.0)


def nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best feasible subset solution.

    Columns are scaled to unit norm first (sum_L2 is ~1e9 x sum_L), so the solve is well conditioned.
    """
    k = X.shape[1]
    scale = np.linalg.norm(X, axis=0)
    scale[scale == 0] = 1.0
    Xs = X / scale
    best, best_res = np.zeros(k), float((y**2).sum())
    for size in range(1, k + 1):
        for cols in combinations(range(k), size):
            c, *_ = np.linalg.lstsq(Xs[:, cols], y, rcond=None)
            if (c < 0).any():
                continue
            res = float(((Xs[:, cols] @ c - y) ** 2).sum())
            if res < best_res - 1e-12 * max(best_res, 1e-300):
                best = np.zeros(k)
                best[list(cols)] = c
                best_res = res
    return best / scale
