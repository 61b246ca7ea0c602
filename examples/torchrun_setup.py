"""What the torchrun examples share: their arguments, the Loader of this rank on either runtime, and the
end of a run (close, report). The models and training steps stay in the examples themselves."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch.distributed as dist

import plait


def parse_args(description: str, *, steps: int, seq_len: int) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--runtime", choices=["local", "ray"], default="local")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "plait-example-data"))
    p.add_argument("--address", default=None, help="ray: cluster address (default: rank 0 starts a local one)")
    p.add_argument("--job", default=None, help="ray: job name shared by the ranks (default: derived from the port)")
    p.add_argument("--json", default=None, help="rank 0 writes the losses here")
    return p.parse_args()


def open_loader(spec, args: argparse.Namespace, name: str) -> plait.Loader:
    """This rank's Loader (ranks from RANK / WORLD_SIZE). On ray, rank 0 creates the job's actors (and a
    local Ray instance unless --address); the other ranks attach to the job by themselves (on rank 0's
    machine they find its local instance)."""
    if args.runtime != "ray":
        return plait.Loader.from_torchrun(spec)
    job = args.job or f"{name}-{os.environ.get('MASTER_PORT', '0')}"
    return plait.Loader.from_torchrun(spec, runtime="ray", address=args.address, job=job, loaders=1)


def finish(args: argparse.Namespace, loader: plait.Loader, losses: list[float], elapsed: float) -> None:
    """Close the Loader on every rank (the job ends with the last), then rank 0 reports the losses."""
    rank = dist.get_rank()
    served_by = type(loader.runtime).__name__  # NodeRuntime: the node's processes shared one data plane
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
                json.dump({"runtime": args.runtime, "served_by": served_by, "losses": losses, "seconds": elapsed}, f)
    dist.destroy_process_group()
