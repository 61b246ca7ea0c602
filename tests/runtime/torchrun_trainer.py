"""A trainer as a torchrun user writes it, for tests/runtime/test_torchrun_node_host.py: gloo, one Loader
per process (`Loader.from_torchrun`: the node's processes share LOCAL_RANK 0's data plane), an all-reduce
per micro-batch as a data-parallel step has. One JSON argument:

  spec          the spec (dict)
  resume        a Loader state file every rank loads with allow_spec_change=True (optional)
  take          micro-batches each rank reads (default: to the end)
  raise_rank    the global rank whose training loop raises ...
  raise_at      ... before its all-reduce of this micro-batch
  out           a folder: each rank writes rank-<r>.json (its micro-batches' step, index and sample ids)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import plait


def main(cfg: dict) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with plait.Loader.from_torchrun(cfg["spec"]) as loader:
        if cfg.get("resume"):
            loader.load_state_dict(json.loads(Path(cfg["resume"]).read_text()), allow_spec_change=True)
        seen = []
        for i, mb in enumerate(loader):
            if rank == cfg.get("raise_rank") and i == cfg["raise_at"]:
                raise RuntimeError(f"the model diverged at micro-batch {i}")
            dist.all_reduce(torch.ones(1))
            seen.append([mb.step, mb.microbatch, mb.sample_ids.tolist()])
            if len(seen) == cfg.get("take"):
                break
        served_by = type(loader.runtime).__name__
        changes = loader.resume_report
        dist.barrier()
    out = Path(cfg["out"]) / f"rank-{rank}.json"
    out.write_text(json.dumps({"served_by": served_by, "batches": seen, "changes": changes}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
