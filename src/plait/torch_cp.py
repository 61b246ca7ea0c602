"""The trainer's side of dynamic context parallelism, in plain torch.distributed (needs plait[torch]).

`CPGroups` creates the process group of every group the Planner may form (the vocabulary, spec
`context_parallel.groups`: `pow2` aligned blocks, as Megatron-Core pre-builds them, or `contiguous` runs of
ranks, of 2..max_degree ranks) once, at start, in the same order on every process: `new_group` is a
collective of the whole world, so it can never be called per step. A batch names its group in
stats["cp"]["group"] (pool ranks); `group_of` finds the process group.

`group_attention` is a reference causal attention over a group, for any backend (gloo on CPU included):
each member all-gathers the group's keys and values (every member holds the same local sizes: documents
are padded to a multiple of 2k, plait.context_parallel.shard_for_group), places every gathered token at
its offset in its document from the head-tail chunk rule, and lets each local query attend the keys of
its document at or before it. It is written to be checked, not to be fast: a real trainer uses a
ring / all-gather kernel (Transformer Engine's THD attention with `to_torch(layout="megatron_thd")`).

Pool ranks and global ranks. The pool is the dp x cp ranks of the job; pool rank q of the trainer with
tensor-parallel rank t and pipeline stage r is global rank t + tp * (q + pool * r) (Megatron's tp-cp-dp-pp
order, plait.topology), so with tp = pp = 1 a pool rank is a global rank.
"""

from __future__ import annotations

import numpy as np


def vocabulary(pool: int, groups: str = "pow2", max_degree: int | None = None) -> list[list[int]]:
    """The pool-rank groups of size 2..max_degree the Planner may form, in a fixed order: `pow2`, the aligned
    blocks of each power of two; `contiguous`, every run of consecutive ranks."""
    top = pool if max_degree is None else min(int(max_degree), pool)
    if groups == "pow2":
        sizes = [1 << e for e in range(1, top.bit_length()) if (1 << e) <= top]
        return [list(range(s, s + k)) for k in sizes for s in range(0, pool - k + 1, k)]
    if groups == "contiguous":
        return [list(range(s, s + k)) for k in range(2, top + 1) for s in range(pool - k + 1)]
    raise ValueError(f"context_parallel.groups must be pow2 or contiguous, not {groups!r}")


class CPGroups:
    """Every group of the vocabulary as a torch.distributed process group, made at construction (call it on
    every process, right after init_process_group). `pool`: dp x cp; `tp`, `pp`: the job's other sizes
    (each TP rank / pipeline stage gets its own copy of each group)."""

    def __init__(self, pool: int, groups: str = "pow2", max_degree: int | None = None, *, tp: int = 1, pp: int = 1):
        import torch.distributed as dist

        self.pool, self.tp = int(pool), int(tp)
        rank = dist.get_rank()
        self.tp_rank, self.pp_rank = rank % self.tp, rank // (self.tp * self.pool)
        self.groups: dict[tuple[int, ...], object] = {}
        for stage in range(pp):
            for t in range(self.tp):
                for members in vocabulary(self.pool, groups, max_degree):
                    ranks = [t + self.tp * (q + self.pool * stage) for q in members]
                    handle = dist.new_group(ranks)  # every process, every group, the same order
                    if t == self.tp_rank and stage == self.pp_rank:
                        self.groups[tuple(members)] = handle

    def group_of(self, cp: dict):
        """The process group of a batch's stats["cp"] (None for a group of one: nothing to exchange)."""
        if int(cp["size"]) == 1:
            return None
        members = tuple(int(q) for q in cp["group"])
        if members not in self.groups:
            raise ValueError(f"CP group {list(members)} is not in this trainer's vocabulary: the spec's "
                             "context_parallel.groups / max_degree and CPGroups' must agree")
        return self.groups[members]


def chunk_offsets(cu_local, size: int, member: int):
    """Per local token of a shard: its document (index in the micro-batch) and its offset in the document
    (padded positions, from the head-tail rule), both int64 tensors."""
    import torch

    lengths = cu_local[1:] - cu_local[:-1]
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=cu_local.device), lengths)
    within = torch.arange(int(cu_local[-1]), device=cu_local.device) - cu_local[:-1][doc]
    if size == 1:
        return doc, within
    chunk = (lengths // 2)[doc]
    head = within < chunk
    offset = torch.where(head, member * chunk + within, (2 * size - 1 - member) * chunk + within - chunk)
    return doc, offset


def _all_gather_function():
    import torch
    import torch.distributed as dist

    class AllGather(torch.autograd.Function):
        """All-gather of equal-sized rows along dim 0; its backward gives each member the sum over the group
        of the gradients of its rows (a reduce-scatter, done as an all-reduce: gloo has no reduce-scatter)."""

        @staticmethod
        def forward(ctx, x, group, size: int, member: int):
            ctx.group, ctx.size, ctx.member, ctx.rows = group, size, member, x.shape[0]
            parts = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(parts, x.contiguous(), group=group)
            return torch.cat(parts)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
            rows = ctx.rows
            return grad[ctx.member * rows:(ctx.member + 1) * rows], None, None, None

    return AllGather


_ALL_GATHER: list = []


def all_gather_rows(x, group, size: int, member: int):
    """The group's rows of `x`, member after member, differentiable."""
    if not _ALL_GATHER:
        _ALL_GATHER.append(_all_gather_function())
    return _ALL_GATHER[0].apply(x, group, size, member)


def group_attention(q, k, v, cu_local, cp: dict, group):
    """Causal attention of a shard's queries over its documents' keys in the whole group.

    q, k, v: [heads, local tokens, head dim] of this member; `cu_local` its cu_seqlens (int tensor); `cp`
    the batch's stats["cp"]; `group` its process group (CPGroups.group_of). Returns [heads, local, dim]."""
    import torch
    import torch.nn.functional as F

    size, member = int(cp["size"]), int(cp["rank"])
    cu_local = torch.as_tensor(np.asarray(cu_local), dtype=torch.int64) if not torch.is_tensor(cu_local) \
        else cu_local.to(torch.int64)
    doc_q, off_q = chunk_offsets(cu_local, size, member)
    if size == 1:
        keys, values, doc_k, off_k = k, v, doc_q, off_q
    else:
        heads, rows, dim = k.shape
        kv = torch.cat([k, v], dim=2).transpose(0, 1).reshape(rows, heads * 2 * dim)  # one exchange per layer
        gathered = all_gather_rows(kv, group, size, member).view(size * rows, heads, 2 * dim).transpose(0, 1)
        keys, values = gathered[..., :dim], gathered[..., dim:]
        pairs = [chunk_offsets(cu_local, size, m) for m in range(size)]
        doc_k = torch.cat([d for d, _ in pairs])
        off_k = torch.cat([o for _, o in pairs])
    # padding keys are masked; a padding query (at its document's end) still sees the document's real keys
    real = torch.as_tensor(np.diff(np.asarray(cp["cu_seqlens"], dtype=np.int64)))[doc_k] > off_k
    mask = (doc_q[:, None] == doc_k[None, :]) & (off_k[None, :] <= off_q[:, None]) & real[None, :]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
