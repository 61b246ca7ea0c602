"""A tiny GPT for the examples, trained on plait's packed, padding-free micro-batches.

One micro-batch is one row of concatenated documents. Attention is causal *within* each document
(block-diagonal causal mask built from position_ids, which restart at 0 at every document start), and
positions come from position_ids, so packing never lets a document see another. With FlashAttention
one would pass cu_seqlens / max_seqlen to its varlen kernel instead of building the mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.packing import IGNORE_INDEX


def document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[T, T] bool, True where query i may attend key j: same document and j <= i."""
    doc = torch.cumsum((position_ids == 0).to(torch.int64), dim=0)
    same = doc[:, None] == doc[None, :]
    idx = torch.arange(len(position_ids), device=position_ids.device)
    return same & (idx[None, :] <= idx[:, None])


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(T, 3, self.heads, D // self.heads).permute(1, 2, 0, 3)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [H, T, Dh]
        x = x + self.proj(a.transpose(0, 1).reshape(T, D))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 4096, dim: int = 64, layers: int = 2, heads: int = 4, max_len: int = 1024):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        mask = document_causal_mask(position_ids)
        x = self.tok(input_ids) + self.pos(position_ids)
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.ln(x))


def loss_sum(model: TinyGPT, batch: dict) -> tuple[torch.Tensor, int]:
    """(summed cross-entropy over the micro-batch's label tokens, their count)."""
    logits = model(batch["input_ids"], batch["position_ids"])
    labels = batch["labels"]
    total = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total, int((labels != IGNORE_INDEX).sum())


def data_parallel_step(model: TinyGPT, opt: torch.optim.Optimizer, batch: dict) -> float:
    """One optimizer step of plain data parallelism (gloo all-reduce); returns the global mean loss.

    The loss is normalised by the label tokens of all ranks together, so every rank's packed batch
    counts by its tokens, whatever its size.
    """
    import torch.distributed as dist

    total, count = loss_sum(model, batch)
    n = torch.tensor([count, total.item()], dtype=torch.float64)
    dist.all_reduce(n)
    (total / n[0]).backward()
    for prm in model.parameters():
        dist.all_reduce(prm.grad)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(n[1] / n[0])


def example_spec(data_dir: str, dp: int, steps: int, seq_len: int = 256):
    """The demo dataset (generated once into data_dir, offline), sized for a CPU model."""
    import plait
    from plait.cli.demo_data import generate

    spec = plait.load_spec(generate(data_dir))
    return spec.with_overrides(
        topology={"dp": dp}, packing={"seq_len": seq_len, "microbatches": 1}, steps=steps,
        cost={"hidden": 64, "layers": 2, "ffn": 256, "heads": 4},
    )


def uniform_loss(vocab: int = 4096) -> float:
    return math.log(vocab)
