"""A tiny vision-language model for the examples, trained on plait's packed multimodal micro-batches.

A micro-batch is one row of concatenated documents plus the pixels of their images:
  pixel_values      [patches, 14*14*3] (float after `to_torch(normalize=...)`), each image's patches in
                    raster order of its grid
  image_grid        [images, 3]: (t, h, w) in patches
  image_cu_seqlens  [images + 1]: each image's patch range (one encoder sequence per image)
  input_ids         with patches / merge² copies of `image_token_id` where each image sits in the text

The model: a small ViT over the patches (patch embedding, 2-D position embeddings, a couple of
transformer layers whose attention is block-diagonal by image_cu_seqlens: an image sees only itself;
with FlashAttention one would pass image_cu_seqlens to its varlen kernel instead of building the mask),
then merge x merge neighbouring patches become one token (concatenated, projected into the language
model's width) and these tokens are scattered, image after image, into the placeholder positions of
input_ids. The language model is examples/tiny_gpt.py's TinyGPT (causal attention within each document).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tiny_gpt import Block, TinyGPT, document_causal_mask

from plait.packing import IGNORE_INDEX

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def image_block_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[P, P] bool, True where patch i may attend patch j: the same image (bidirectional)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    image = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    return image[:, None] == image[None, :]


class TinyViT(nn.Module):
    def __init__(self, patch: int = 14, dim: int = 64, layers: int = 2, heads: int = 4, merge: int = 2,
                 out_dim: int = 64, max_grid: int = 64):
        super().__init__()
        self.merge = merge
        self.embed = nn.Linear(patch * patch * 3, dim)
        self.row, self.col = nn.Embedding(max_grid, dim), nn.Embedding(max_grid, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.proj = nn.Sequential(nn.Linear(merge * merge * dim, out_dim), nn.GELU(), nn.Linear(out_dim, out_dim))

    def positions(self, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (row, col) in its image, raster order, images concatenated."""
        rows, cols = [], []
        for t, h, w in grid.tolist():
            r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            rows.append(r.reshape(-1).repeat(t))
            cols.append(c.reshape(-1).repeat(t))
        return torch.cat(rows), torch.cat(cols)

    def forward(self, pixels: torch.Tensor, grid: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Merged image tokens [sum(patches) / merge², out_dim], image after image, raster order."""
        rows, cols = self.positions(grid)
        x = self.embed(pixels) + self.row(rows) + self.col(cols)
        mask = image_block_mask(cu_seqlens)
        for blk in self.blocks:
            x = blk(x, mask)
        x = self.ln(x)
        m, out, start = self.merge, [], 0
        for t, h, w in grid.tolist():  # [t*h*w, D] -> [t, h/m, m, w/m, m, D] -> [t*(h/m)*(w/m), m*m*D]
            img = x[start : start + t * h * w].view(t, h // m, m, w // m, m, -1)
            out.append(img.permute(0, 1, 3, 2, 4, 5).reshape(t * (h // m) * (w // m), -1))
            start += t * h * w
        return self.proj(torch.cat(out))


class TinyVLM(nn.Module):
    def __init__(self, image_token_id: int, vocab: int = 4096, dim: int = 64, max_len: int = 1024,
                 patch: int = 14, merge: int = 2):
        super().__init__()
        self.image_token_id = image_token_id
        # the placeholder id may lie past the text vocabulary (an added token): give it a row too
        self.gpt = TinyGPT(vocab=max(vocab, image_token_id + 1), dim=dim, max_len=max_len)
        self.vit = TinyViT(patch=patch, merge=merge, out_dim=dim)

    def forward(self, batch: dict) -> torch.Tensor:
        ids, pos = batch["input_ids"], batch["position_ids"]
        x = self.gpt.tok(ids)
        if batch.get("pixel_values") is not None:
            img = self.vit(batch["pixel_values"], batch["image_grid"], batch["image_cu_seqlens"])
            slots = (ids == self.image_token_id).nonzero(as_tuple=True)[0]
            assert len(slots) == len(img), f"{len(slots)} placeholders for {len(img)} image tokens"
            x = x.index_copy(0, slots, img.to(x.dtype))
        else:  # no image here: keep the ViT in the graph so every rank's gradients have the same shapes
            x = x + 0.0 * sum(p.sum() for p in self.vit.parameters())
        x = x + self.gpt.pos(pos)
        mask = document_causal_mask(pos)
        for blk in self.gpt.blocks:
            x = blk(x, mask)
        return self.gpt.head(self.gpt.ln(x))


def vlm_loss_sum(model: TinyVLM, batch: dict) -> tuple[torch.Tensor, int]:
    """(summed cross-entropy over the micro-batch's label tokens, their count); placeholders carry no label."""
    labels = batch["labels"]
    total = F.cross_entropy(model(batch), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total, int((labels != IGNORE_INDEX).sum())


def vlm_data_parallel_step(model: TinyVLM, opt: torch.optim.Optimizer, batch: dict) -> float:
    """One optimizer step of plain data parallelism (gloo all-reduce), the loss normalised by the label
    tokens of all ranks together; returns the global mean loss."""
    import torch.distributed as dist

    total, count = vlm_loss_sum(model, batch)
    n = torch.tensor([count, total.item()], dtype=torch.float64)
    dist.all_reduce(n)
    (total / n[0]).backward()
    for prm in model.parameters():
        if prm.grad is None:
            prm.grad = torch.zeros_like(prm)
        dist.all_reduce(prm.grad)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(n[1] / n[0])


def vlm_example_spec(data_dir: str, dp: int, steps: int, seq_len: int = 512):
    """The demo dataset (generated once into data_dir, offline): its image-text source and its chat
    source, sized for a CPU model (images of at most 28*28*64 pixels: <= 256 patches, 64 tokens)."""
    import plait
    from plait.cli.demo_data import generate

    spec = plait.load_spec(generate(data_dir, images=True))
    by_name = {s.name: s.model_dump(mode="python") for s in spec.sources}
    sources = [dict(by_name["image"], weight=0.8), dict(by_name["chat"], weight=0.2)]
    return spec.with_overrides(
        sources=sources, topology={"dp": dp}, steps=steps,
        packing={"seq_len": seq_len, "microbatches": 1, "max_patches": 4 * seq_len},
        cost={"hidden": 64, "layers": 2, "ffn": 256, "heads": 4, "encoder": {"hidden": 64, "layers": 2, "ffn": 256}},
    )
