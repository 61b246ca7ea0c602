"""The public micro-batch type: what every rank receives (`plait.Batch`).

Fields are numpy arrays (views into one packed build where possible); `to_torch()` turns them into
tensors. The padding-free layout: documents are concatenated, `cu_seqlens` marks where each starts,
`position_ids` restart at 0 in each document, and `labels` never cross a document boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class MicroBatch:
    step: int
    microbatch: int
    num_microbatches: int
    dp_rank: int
    input_ids: np.ndarray  # int32 [T]
    labels: np.ndarray  # int32 [T], IGNORE_INDEX at each document's last token
    position_ids: np.ndarray  # int32 [T]
    cu_seqlens: np.ndarray  # int32 [docs+1]
    sample_ids: np.ndarray  # int64 [docs, 5]: source, epoch, shard, row, chunk
    source_ids: np.ndarray  # int32 [docs]
    stats: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(len(self.input_ids))

    def to_torch(self, device=None, *, pin_memory: bool = False, non_blocking: bool = False) -> "TorchBatch":
        """The batch as torch tensors: ids, labels and positions int64, the rest int32 (needs plait[torch]).

        Returns a dict of tensors only; `max_seqlen` (for varlen attention kernels) is an attribute.
        `pin_memory=True` pins the host tensors so that `non_blocking=True` copies to a CUDA `device`
        overlap with compute.
        """
        import torch

        def t(a, dtype):
            if not a.flags.writeable:  # batches from Ray's object store are read-only views
                a = a.copy()
            x = torch.from_numpy(a).to(dtype=dtype)
            if pin_memory and torch.cuda.is_available():
                x = x.pin_memory()
            return x.to(device, non_blocking=non_blocking) if device is not None else x

        out = TorchBatch(
            input_ids=t(self.input_ids, torch.long),
            labels=t(self.labels, torch.long),
            position_ids=t(self.position_ids, torch.long),
            cu_seqlens=t(self.cu_seqlens, torch.int32),
            sample_ids=t(self.sample_ids, torch.long),
            source_ids=t(self.source_ids, torch.int32),
        )
        out.max_seqlen = self.max_seqlen
        return out

    @property
    def max_token_id(self) -> int:
        """The largest id in `input_ids` (-1 when empty): must stay below the model's vocabulary."""
        return int(self.input_ids.max()) if len(self.input_ids) else -1

    @property
    def fill(self) -> float:
        """Tokens / seq_len of this micro-batch (`stats["fill"]` is the whole step's)."""
        capacity = self.stats.get("capacity", 0)
        return self.num_tokens / capacity if capacity else 0.0

    @property
    def padding_fraction(self) -> float:
        """Unfilled seq_len capacity of this micro-batch: what a padded loader would fill with padding."""
        return 1.0 - self.fill if self.stats.get("capacity") else 0.0

    @property
    def max_seqlen(self) -> int:
        return int(np.diff(self.cu_seqlens).max()) if len(self.cu_seqlens) > 1 else 0


class TorchBatch(dict):
    """A dict of tensors (what a training step unpacks) with the batch's scalars as attributes."""

    max_seqlen: int = 0


Batch = MicroBatch
