"""`plait mix JOB --set web=0.5 --at-step N`: change the mixture of a running ray job.

The job's one Planner applies the change (`Planner.set_weights`): the named sources get exactly that
token share from step N on, the others share the rest in their current proportions. The change is
recorded in the data state, so a resume reproduces it; a step already planned is refused.
`--show` prints the weight overrides in force.
"""

from __future__ import annotations

import json

from rich.console import Console

from plait.cli.jobs import join_cluster
from plait.errors import PlaitError

HELP = "change the mixture of a running ray job from a step on (`--set SOURCE=W --at-step N`)"
DESCRIPTION = (
    "Set token shares of a running ray job's sources from a global step on (recorded in the job's data state, "
    "so a resume reproduces it), or show the overrides in force (--show)."
)


def add_arguments(p) -> None:
    p.add_argument("job", help="the job's name (`plait jobs` lists them)")
    p.add_argument("--set", dest="weights", action="append", default=[], metavar="SOURCE=W",
                   help="a source's token share from --at-step on (repeatable)")
    p.add_argument("--at-step", type=int, default=None, help="the first global step the shares apply to")
    p.add_argument("--show", action="store_true", help="print the weight overrides in force")
    p.add_argument("--address", default="auto", help="the Ray cluster (default: auto, the running one)")


def parse_weights(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            out[name] = float(value)
        except ValueError:
            raise PlaitError(f"--set {item!r}: expected SOURCE=WEIGHT, e.g. --set web=0.5") from None
    return out


def run(args) -> int:
    weights = parse_weights(args.weights)
    if not args.show and (not weights or args.at_step is None):
        raise PlaitError("give --set SOURCE=W (one or more) and --at-step N, or --show")
    from plait.runtime.ray import jobs
    from plait.runtime.ray.common import get, ray_module

    joined = join_cluster(args.address)
    try:
        planner = jobs.find_planner(args.job, wait=0)
        if weights:
            get(planner.set_weights.remote(weights, args.at_step))
            Console().print(f"job {args.job}: from step {args.at_step}, " +
                            ", ".join(f"{n} = {w:g}" for n, w in weights.items()), highlight=False)
        if args.show:
            overrides = get(planner.weight_overrides.remote())
            print(json.dumps(overrides, indent=2))
    finally:
        if joined:
            ray_module().shutdown()
    return 0
