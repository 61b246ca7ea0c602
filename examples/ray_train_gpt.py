"""Train the tiny GPT with Ray Train's TorchTrainer (CPU workers, gloo), fed by plait's ray runtime.

    python examples/ray_train_gpt.py --workers 2 --steps 40

Ray Train starts one worker actor per data-parallel rank; inside each, `plait.Loader.from_ray_train(...,
job=...)` finds Ray already running; worker 0 creates the job's Planner/SourceLoader/Constructor actors,
the others join them (`attach=True`, waiting for worker 0 if they start first). Data never passes through
the driver or the Ray Train controller.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

EXAMPLES = os.path.dirname(os.path.abspath(__file__))


def train_loop(config: dict) -> None:
    sys.path.insert(0, config["examples"])
    import torch
    import torch.distributed as dist
    from tiny_gpt import TinyGPT, data_parallel_step, example_spec

    import plait
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    spec = example_spec(config["data"], world, config["steps"], config["seq_len"])
    # Ranks from the Train context; worker 0 creates the job, the others join it.
    loader = plait.Loader.from_ray_train(spec, job=config["job"], attach=rank > 0, loaders=1)
    model = TinyGPT(max_len=config["seq_len"])
    for prm in model.parameters():
        dist.broadcast(prm.data, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    losses = []
    for step, mb in enumerate(loader):
        losses.append(data_parallel_step(model, opt, mb.to_torch()))
    dist.barrier()
    loader.close()
    metrics = {"first_loss": sum(losses[:5]) / 5, "last_loss": sum(losses[-5:]) / 5, "losses": losses,
               "steps": len(losses)}
    if rank == 0:
        with open(config["result"], "w") as f:
            json.dump(metrics, f)
    ray.train.report({k: v for k, v in metrics.items() if k != "losses"})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "plait-example-data"))
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local instance)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    sys.path.insert(0, EXAMPLES)
    from tiny_gpt import example_spec

    example_spec(args.data, args.workers, args.steps, args.seq_len)  # generate the data once, here
    # A fresh local instance unless --address: Ray Train's workers and plait's actors share it.
    ray.init(address=args.address or "local", include_dashboard=False, namespace="plait")
    config = {"examples": EXAMPLES, "data": args.data, "steps": args.steps, "seq_len": args.seq_len, "lr": args.lr,
              "job": f"ray-train-gpt-{os.getpid()}",
              "result": args.json or os.path.join(tempfile.gettempdir(), f"plait-ray-train-{os.getpid()}.json")}
    t0 = time.perf_counter()
    trainer = TorchTrainer(
        train_loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(name=config["job"], storage_path=os.path.join(tempfile.gettempdir(), "plait-ray-train")),
    )
    trainer.fit()
    with open(config["result"]) as f:
        m = json.load(f)
    print(f"ray train: {m['steps']} steps in {time.perf_counter() - t0:.1f} s, loss {m['first_loss']:.3f} -> "
          f"{m['last_loss']:.3f}")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
