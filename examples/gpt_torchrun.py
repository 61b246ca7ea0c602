"""Train a tiny GPT on CPU with torchrun (gloo), fed by plait, on either runtime.

    torchrun --nproc_per_node 2 examples/gpt_torchrun.py --runtime local --steps 40
    torchrun --nproc_per_node 2 examples/gpt_torchrun.py --runtime ray --steps 40

Every process is one data-parallel rank and asks plait for its own micro-batches:
  local  each rank plans the (cheap, metadata-only) global step itself and builds only its share;
  ray    rank 0 starts a local Ray instance (or joins --address) and creates the job; the other ranks
         join it by name (attach=True): one Planner actor plans each step once, a Constructor builds
         each rank's batches. The job ends when every rank has closed its Loader (or, for a rank killed
         without closing, after the job's idle timeout).
The gradient is the exact gradient of the global mean token loss: each rank's summed loss is divided by
the global label-token count, and gradients are summed (all-reduce) across ranks.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt import TinyGPT, data_parallel_step, example_spec  # noqa: E402
from torchrun_setup import finish, open_loader, parse_args  # noqa: E402


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], steps=40, seq_len=256)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if rank == 0:
        example_spec(args.data, world, args.steps, args.seq_len)  # generate the data once
    dist.barrier()
    spec = example_spec(args.data, world, args.steps, args.seq_len)

    loader = open_loader(spec, args, "gpt-torchrun")

    model = TinyGPT(max_len=args.seq_len)
    for prm in model.parameters():  # same initial weights on every rank
        dist.broadcast(prm.data, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, t0 = [], time.perf_counter()
    for step, mb in enumerate(loader):
        losses.append(data_parallel_step(model, opt, mb.to_torch()))
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  ({mb.num_tokens} tokens, {len(mb.cu_seqlens) - 1} docs)",
                  flush=True)
    finish(args, loader, losses, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
