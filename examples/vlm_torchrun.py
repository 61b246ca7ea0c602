"""Train a tiny vision-language model on CPU with torchrun (gloo), fed by plait, on either runtime.

    torchrun --nproc_per_node 2 examples/vlm_torchrun.py --runtime local --steps 30
    torchrun --nproc_per_node 2 examples/vlm_torchrun.py --runtime ray --steps 30

The data: `plait demo`'s image-text source (captioned JPEG/PNG images of varied sizes) and its chat
source. Each micro-batch brings its images' pixels (uint8 patches, normalised here by to_torch) next to
the packed tokens; the model (examples/tiny_vlm.py) encodes them with a tiny ViT and puts the merged
image tokens at the placeholders.

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

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_vlm import CLIP_MEAN, CLIP_STD, TinyVLM, vlm_data_parallel_step, vlm_example_spec  # noqa: E402

import plait  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runtime", choices=["local", "ray"], default="local")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "plait-example-data"))
    p.add_argument("--address", default=None, help="ray: cluster address (default: rank 0 starts a local one)")
    p.add_argument("--job", default=None, help="ray: job name shared by the ranks (default: derived from the port)")
    p.add_argument("--json", default=None, help="rank 0 writes the losses here")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if rank == 0:
        vlm_example_spec(args.data, world, args.steps, args.seq_len)  # generate the data once
    dist.barrier()
    spec = vlm_example_spec(args.data, world, args.steps, args.seq_len)

    options = {}
    if args.runtime == "ray":
        job = args.job or f"vlm-torchrun-{os.environ.get('MASTER_PORT', '0')}"
        options = {"job": job, "loaders": 1}
        # Rank 0 creates the job's actors (and a local Ray instance unless --address); the others
        # join the same instance (its address broadcast over torch.distributed) and job (attach=True).
        address = [args.address]
        if rank == 0:
            loader = plait.Loader.from_torchrun(spec, runtime="ray", address=args.address, **options)
            import ray

            address = [ray.get_runtime_context().gcs_address]
        dist.broadcast_object_list(address, src=0)
        if rank != 0:
            if args.address is None:  # rank 0's local instance uses token auth (Ray >= 2.59), shared token file
                os.environ.setdefault("RAY_AUTH_MODE", "token")
            loader = plait.Loader.from_torchrun(spec, runtime="ray", address=address[0], attach=True, **options)
    else:
        loader = plait.Loader.from_torchrun(spec)  # ranks from RANK / WORLD_SIZE

    model = TinyVLM(spec.images.image_token_id, max_len=args.seq_len)
    for prm in model.parameters():  # same initial weights on every rank
        dist.broadcast(prm.data, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, t0 = [], time.perf_counter()
    for step, mb in enumerate(loader):
        losses.append(vlm_data_parallel_step(model, opt, mb.to_torch(normalize=(CLIP_MEAN, CLIP_STD))))
        images = 0 if mb.image_grid is None else len(mb.image_grid)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  ({mb.num_tokens} tokens, {len(mb.cu_seqlens) - 1} docs, "
                  f"{images} images)", flush=True)
    elapsed = time.perf_counter() - t0
    dist.barrier()
    loader.close()
    if args.runtime == "ray" and rank != 0:
        import ray

        ray.shutdown()  # leave rank 0's Ray instance before it goes away with rank 0's process
    dist.barrier()
    if rank == 0:
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        print(f"{args.runtime}: {len(losses)} steps in {elapsed:.1f} s, loss {first:.3f} -> {last:.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"runtime": args.runtime, "losses": losses, "seconds": elapsed}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
