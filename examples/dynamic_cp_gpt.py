"""Train the tiny GPT with dynamic context parallelism: a CP degree per document, on CPU with gloo.

    torchrun --nproc-per-node 4 examples/dynamic_cp_gpt.py --steps 4 --check

Four processes are a pool of dp 2 x cp 2 ranks. Each step runs in waves; in each wave every rank runs one
micro-batch, alone (k = 1: whole short documents) or as a member of a group of k ranks that share long
documents (each holds a head and a tail chunk of each). Every process asks plait.Loader for its own
batches: a shard holds only its own tokens, global positions and its group (stats["cp"]). The groups of
the vocabulary are created once, at start (plait.torch_cp.CPGroups); attention over a group all-gathers
its keys and values (plait.torch_cp.group_attention). The loss is the global mean over label tokens:
each wave's summed loss divided by stats["global_label_tokens"], gradients summed over all ranks.

`--check`: every step, rank 0 also runs the same documents whole in one process (the group micro-batches
reassembled from every rank's shards) with the model's own block-diagonal causal attention, and compares
the loss and every parameter's gradient (float32). It prints `max_rel_diff` and exits non-zero above 1e-5.

"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt import TinyGPT, example_spec  # noqa: E402

import plait  # noqa: E402
from plait.context_parallel import unshard_group  # noqa: E402
from plait.packing import IGNORE_INDEX  # noqa: E402
from plait.torch_cp import CPGroups, group_attention  # noqa: E402

DP, CP = 2, 2
TOLERANCE = 1e-5


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256, help="a fixed-CP micro-batch: each rank holds seq_len / cp")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "plait-example-data"))
    p.add_argument("--check", action="store_true", help="compare loss and gradients with one process, whole documents")
    p.add_argument("--json", default=None, help="rank 0 writes losses, max_rel_diff and the degrees seen here")
    return p.parse_args()


def dynamic_spec(args: argparse.Namespace):
    spec = example_spec(args.data, DP, args.steps, args.seq_len)
    return spec.with_overrides(topology={"dp": DP, "cp": CP}, packing={"microbatches": 2},
                               context_parallel={"mode": "dynamic", "groups": "pow2", "max_degree": DP * CP})


# ----- the model's forward with attention over a CP group ----------------------------------------------------

def forward_cp(model: TinyGPT, batch: dict, cp: dict, group) -> torch.Tensor:
    """TinyGPT's forward on a shard: the same modules, each block's attention over the group."""
    x = model.tok(batch["input_ids"]) + model.pos(batch["position_ids"])
    for blk in model.blocks:
        tokens, dim = x.shape
        q, k, v = blk.qkv(blk.ln1(x)).view(tokens, 3, blk.heads, dim // blk.heads).permute(1, 2, 0, 3)
        a = group_attention(q, k, v, batch["cu_seqlens"], cp, group)
        x = x + blk.proj(a.transpose(0, 1).reshape(tokens, dim))
        x = x + blk.mlp(blk.ln2(x))
    return model.head(model.ln(x))


def forward_whole(model: TinyGPT, batch: dict) -> torch.Tensor:
    """The reference: the model's own blocks on whole documents, causal within each (from cu_seqlens)."""
    cu = batch["cu_seqlens"].long()
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    idx = torch.arange(len(doc))
    mask = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
    x = model.tok(batch["input_ids"]) + model.pos(batch["position_ids"])
    for blk in model.blocks:
        x = blk(x, mask)
    return model.head(model.ln(x))


def wave_loss(logits: torch.Tensor, labels: torch.Tensor, global_labels: int) -> torch.Tensor:
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum") / global_labels


# ----- where the batches come from ---------------------------------------------------------------------------

def loader_steps(loader: plait.Loader):
    """This process's waves, step by step (its pool rank's shards)."""
    waves = []
    for mb in loader:
        waves.append(mb)
        if mb.microbatch == mb.num_microbatches - 1:
            yield waves
            waves = []
    dist.barrier()  # rank 0's process hosts the node's data plane: the others have read their last step
    loader.close()


# ----- the check: one process, the same documents whole ----------------------------------------------------

def reference(model: TinyGPT, every_rank: list[list], global_labels: int) -> tuple[float, dict]:
    """Loss and gradients of the step's documents run whole: each group micro-batch reassembled from its
    members' shards (every rank's waves, gathered to rank 0)."""
    by_group: dict[int, dict[int, object]] = {}
    for waves in every_rank:
        for mb in waves:
            by_group.setdefault(mb.stats["cp"]["group_id"], {})[mb.stats["cp"]["rank"]] = mb
    model.zero_grad(set_to_none=True)
    total, labels = 0.0, 0
    for gid in sorted(by_group):
        members = by_group[gid]
        whole = unshard_group([members[m] for m in range(len(members))]).to_torch()
        loss = wave_loss(forward_whole(model, whole), whole["labels"], global_labels)
        loss.backward()
        total += loss.item()
        labels += int((whole["labels"] != IGNORE_INDEX).sum())
    assert labels == global_labels, (labels, global_labels)  # the normaliser is exact over the whole step
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return total, grads


def max_rel_diff(loss: float, ref_loss: float, grads: dict, ref_grads: dict) -> float:
    worst = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
    for name, g in ref_grads.items():
        worst = max(worst, float((grads[name] - g).abs().max()) / max(float(g.abs().max()), 1e-12))
    return worst


def main() -> int:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == DP * CP, f"run with --nproc-per-node {DP * CP}"
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if rank == 0:
        example_spec(args.data, DP, args.steps, args.seq_len)  # generate the data once
    dist.barrier()
    groups = CPGroups(world, "pow2", world)  # the whole vocabulary, once: never per step
    loader = plait.Loader.from_torchrun(dynamic_spec(args), cp=CP)  # NodeRuntime: LOCAL_RANK 0 hosts the job
    served_by = type(loader.runtime).__name__

    model = TinyGPT(max_len=4 * args.seq_len * DP)
    for prm in model.parameters():  # same initial weights on every rank
        dist.broadcast(prm.data, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, diffs, degrees = [], [], {}
    for step, waves in enumerate(loader_steps(loader)):
        global_labels = int(waves[0].stats["global_label_tokens"])
        total = 0.0
        for mb in waves:  # every rank runs its waves in order: a group's members meet in the same wave
            cp = mb.stats["cp"]
            degrees[int(cp["size"])] = degrees.get(int(cp["size"]), 0) + 1
            batch = mb.to_torch()
            loss = wave_loss(forward_cp(model, batch, cp, groups.group_of(cp)), batch["labels"], global_labels)
            loss.backward()
            total += loss.item()
        reduced = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(reduced)
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
        losses.append(float(reduced))
        if args.check:
            every_rank = [None] * world if rank == 0 else None
            dist.gather_object(waves, every_rank, dst=0)
            if rank == 0:
                grads = {name: p.grad.clone() for name, p in model.named_parameters()}
                ref_loss, ref_grads = reference(model, every_rank, global_labels)
                for name, p in model.named_parameters():
                    p.grad = grads[name]
                diffs.append(max_rel_diff(losses[-1], ref_loss, grads, ref_grads))
                print(f"step {step}: loss {losses[-1]:.6f} (whole documents {ref_loss:.6f}), "
                      f"max_rel_diff {diffs[-1]:.2e}", flush=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    seen = [None] * world
    dist.all_gather_object(seen, degrees)
    worst = max(diffs) if diffs else None
    if rank == 0:
        merged = {k: sum(d.get(k, 0) for d in seen) for k in sorted({k for d in seen for k in d})}
        print(f"max_rel_diff {worst if worst is not None else 'n/a'}  (wave micro-batches by CP degree: {merged})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"losses": losses, "max_rel_diff": worst, "degrees": merged, "steps": len(losses),
                           "served_by": served_by}, f)
    dist.destroy_process_group()
    return 1 if worst is not None and worst > TOLERANCE else 0


if __name__ == "__main__":
    sys.exit(main())
