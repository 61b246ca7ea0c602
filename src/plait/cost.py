"""Cost models: what one document (or chunk) of L tokens costs to train on.

c(L) = linear * L + quadratic * L_att^2, where L_att is L rounded up to the attention kernel's tile
(short documents waste part of a tile). For a decoder layer with hidden size h, n heads, g KV groups and
FFN width f, forward FLOPs are L * [4h^2 (1 + g/n) + 6hf] + 2hL^2 (causal attention); training is ~3x
forward. The two terms are equal at L* = 2h(1 + g/n) + 3f (~49k tokens for a 7B model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plait.spec import CostSpec


@dataclass(frozen=True)
class CostModel:
    linear: float
    quadratic: float
    tile: int = 0

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

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        L = np.asarray(lengths, dtype=np.float64)
        La = np.ceil(L / self.tile) * self.tile if self.tile else L
        return self.linear * L + self.quadratic * La * La
